"""A stand-in container runtime for tests: ``runtime.v1.RuntimeService/ListContainers`` on a
unix socket (no tests here).

It follows containerd's CRI plugin (``internal/cri/server/container_list.go``):
``ListContainers`` answers every container of the runtime's store, in any state (created,
running, exited), each with its ID, sandbox ID, metadata, image, state and the labels and
annotations of the ``ContainerConfig`` it was created with; the kubelet puts
``io.kubernetes.pod.name``/``.namespace``/``.uid`` and ``io.kubernetes.container.name`` in
those labels (``pkg/kubelet/types/labels.go``), which is how a container ID names its pod.
A filter is applied as ``filterCRIContainers`` does: exact container ID, exact sandbox ID,
state, and every ``label_selector`` pair must match (containerd's resolution of a short ID
prefix is not modelled: the agent sends no filter). Every other ``RuntimeService`` method
answers UNIMPLEMENTED, as a server without them would.

Test knobs: :attr:`CriStub.containers` (edit between calls), :meth:`CriStub.fail` (answer
UNAVAILABLE, as a runtime restarting), :attr:`CriStub.calls`.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from agent._proto import cri_runtime_v1_pb2 as cri
from agent._proto import cri_runtime_v1_pb2_grpc as cri_grpc
from agent.kubelet.unix_server import UnixGrpcServer


def pod_container(cid: str, pod: str, namespace: str, container: str, pod_uid: str,
                  *, state: int = cri.CONTAINER_RUNNING, sandbox: str = "") -> cri.Container:
    """A container as containerd lists one the kubelet created."""
    return cri.Container(
        id=cid,
        pod_sandbox_id=sandbox or f"sandbox-{pod_uid}",
        metadata=cri.ContainerMetadata(name=container, attempt=0),
        image=cri.ImageSpec(image="registry.example.com/train:1"),
        image_ref="sha256:" + "ab" * 32,
        state=state,
        created_at=1_700_000_000_000_000_000,
        labels={
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.uid": pod_uid,
            "io.kubernetes.container.name": container,
        },
        annotations={"io.kubernetes.container.restartCount": "0"},
    )


class _Servicer(cri_grpc.RuntimeServiceServicer):
    def __init__(self, stub: CriStub) -> None:
        self.stub = stub

    def ListContainers(self, request: Any, context: Any) -> cri.ListContainersResponse:  # noqa: N802
        with self.stub.lock:
            self.stub.calls += 1
            if self.stub.failing:
                context.abort(grpc.StatusCode.UNAVAILABLE, "containerd is restarting")
            listed = list(self.stub.containers)
        return cri.ListContainersResponse(containers=_filtered(listed, request))


def _filtered(containers: list[cri.Container], request: Any) -> list[cri.Container]:
    if not request.HasField("filter"):
        return containers
    f = request.filter
    out = []
    for c in containers:
        if f.id and f.id != c.id:
            continue
        if f.pod_sandbox_id and f.pod_sandbox_id != c.pod_sandbox_id:
            continue
        if f.HasField("state") and f.state.state != c.state:
            continue
        if any(c.labels.get(k) != v for k, v in f.label_selector.items()):
            continue
        out.append(c)
    return out


class CriStub:
    """``/runtime.v1.RuntimeService`` on ``socket_path`` answering ``containers``."""

    def __init__(self, socket_path: str, containers: list[cri.Container] | None = None) -> None:
        self.socket_path = socket_path
        self.containers = list(containers or [])
        self.calls = 0
        self.failing = False
        self.lock = threading.Lock()
        servicer = _Servicer(self)
        self._server = UnixGrpcServer(
            socket_path, lambda server: cri_grpc.add_RuntimeServiceServicer_to_server(servicer, server),
            name="cri-stub", max_workers=2, in_use="a container runtime is serving on this socket",
        )

    def fail(self, failing: bool = True) -> None:
        with self.lock:
            self.failing = failing

    def start(self) -> CriStub:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)
