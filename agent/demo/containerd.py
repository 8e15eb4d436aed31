"""A stand-in container runtime for the demo: ``runtime.v1.RuntimeService/ListContainers`` on
a unix socket, answering the containers the demo's pods run.

It follows containerd's CRI plugin (``internal/cri/server/container_list.go``):
``ListContainers`` lists every container of the runtime's store, each with its ID, sandbox ID,
metadata, image, state, and the labels and annotations of the ``ContainerConfig`` it was
created with. The kubelet puts ``io.kubernetes.pod.name``, ``io.kubernetes.pod.namespace``,
``io.kubernetes.pod.uid`` and ``io.kubernetes.container.name`` in those labels
(``pkg/kubelet/types/labels.go``), which is how the agent learns a container ID's pod. A
request's filter is applied as containerd's ``filterCRIContainers`` does (exact container ID,
exact sandbox ID, state, every ``label_selector`` pair; the resolution of a short ID prefix
is not modelled). ``RuntimeService``'s other methods are absent from the agent's definition
(``proto/cri_runtime_v1.proto``), so they answer UNIMPLEMENTED, as a server without them would.
It serves through the agent's :class:`agent.kubelet.unix_server.UnixGrpcServer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from agent._proto import cri_runtime_v1_pb2 as cri
from agent._proto import cri_runtime_v1_pb2_grpc as cri_grpc
from agent.kubelet.unix_server import UnixGrpcServer


@dataclass(frozen=True)
class PodContainer:
    """A container the kubelet created for a pod, as the runtime stores it."""

    id: str  # the runtime's 64-hex container ID
    pod: str
    namespace: str
    container: str
    pod_uid: str
    image: str = "registry.example.com/app:1"

    def listed(self) -> cri.Container:
        """The container as containerd lists a running one the kubelet created."""
        return cri.Container(
            id=self.id,
            pod_sandbox_id=f"sandbox-{self.pod_uid}",
            metadata=cri.ContainerMetadata(name=self.container, attempt=0),
            image=cri.ImageSpec(image=self.image),
            image_ref=self.image,
            state=cri.CONTAINER_RUNNING,
            labels={
                "io.kubernetes.pod.name": self.pod,
                "io.kubernetes.pod.namespace": self.namespace,
                "io.kubernetes.pod.uid": self.pod_uid,
                "io.kubernetes.container.name": self.container,
            },
            annotations={"io.kubernetes.container.restartCount": "0"},
        )


class _RuntimeServicer(cri_grpc.RuntimeServiceServicer):
    def __init__(self, containers: Sequence[cri.Container]) -> None:
        self.containers = list(containers)

    def ListContainers(  # noqa: N802 (the gRPC method's name)
        self, request: cri.ListContainersRequest, context: grpc.ServicerContext
    ) -> cri.ListContainersResponse:
        return cri.ListContainersResponse(containers=_filtered(self.containers, request))


def _filtered(
    containers: list[cri.Container], request: cri.ListContainersRequest
) -> list[cri.Container]:
    if not request.HasField("filter"):
        return containers
    f = request.filter
    return [
        c for c in containers
        if (not f.id or f.id == c.id)
        and (not f.pod_sandbox_id or f.pod_sandbox_id == c.pod_sandbox_id)
        and (not f.HasField("state") or f.state.state == c.state)
        and all(c.labels.get(k) == v for k, v in f.label_selector.items())
    ]


class ContainerdStub:
    """``/runtime.v1.RuntimeService`` on ``socket_path`` listing ``containers``."""

    def __init__(self, socket_path: str, containers: Sequence[PodContainer]) -> None:
        self.socket_path = socket_path
        self.containers = tuple(containers)
        servicer = _RuntimeServicer([c.listed() for c in self.containers])
        self._server = UnixGrpcServer(
            socket_path, lambda server: cri_grpc.add_RuntimeServiceServicer_to_server(servicer, server),
            name="containerd-stub", max_workers=2, in_use="a container runtime is serving on this socket",
        )

    def start(self) -> ContainerdStub:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)
