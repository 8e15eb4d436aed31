"""A read-only client of the container runtime's CRI API v1 (``runtime.v1.RuntimeService`` on
the runtime's socket: containerd's ``/run/containerd/containerd.sock``, CRI-O's
``/var/run/crio/crio.sock``): which pod and container a container ID is.

It calls ``ListContainers`` and nothing else, and answers in plain records
(:class:`CriContainer`) named from the labels the kubelet sets on every container it creates
(``io.kubernetes.pod.name``, ``io.kubernetes.pod.namespace``, ``io.kubernetes.pod.uid``,
``io.kubernetes.container.name``); a container the kubelet did not create has empty names.
A failed call is a :class:`CriError` naming the gRPC status, so callers need no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from agent._proto import cri_runtime_v1_pb2, cri_runtime_v1_pb2_grpc
from agent.errors import AgentError
from agent.kubelet.podresources import rpc_message

__all__ = ["CriClient", "CriContainer", "CriError"]

#: The kubelet's labels on the containers it creates (pkg/kubelet/types/labels.go).
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"

#: The kubelet's own limit on CRI messages (a node with thousands of containers).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class CriError(AgentError):
    """``ListContainers`` failed: the runtime is absent, restarting, or refused
    (``CODE: details``)."""


@dataclass(frozen=True)
class CriContainer:
    """A container as the runtime lists it, named by the kubelet's labels."""

    id: str
    pod: str
    namespace: str
    container: str
    pod_uid: str = ""


def socket_target(path: str) -> str:
    """The gRPC target of a CRI endpoint given as a path or as ``unix://PATH`` (the
    kubelet's ``--container-runtime-endpoint`` spelling)."""
    return path if path.startswith("unix://") else f"unix://{path}"


class CriClient:
    """A ``RuntimeService`` client on a unix socket, for ``ListContainers`` only; the channel
    is reused."""

    def __init__(self, socket_path: str, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: cri_runtime_v1_pb2_grpc.RuntimeServiceStub | None = None

    def list_containers(self) -> list[CriContainer]:
        """Every container the runtime knows (all states); raises CriError on failure."""
        if self._stub is None:
            self._channel = grpc.insecure_channel(
                socket_target(self.socket_path),
                options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
            )
            self._stub = cri_runtime_v1_pb2_grpc.RuntimeServiceStub(self._channel)
        try:
            response = self._stub.ListContainers(
                cri_runtime_v1_pb2.ListContainersRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            raise CriError(rpc_message(exc)) from exc
        return [_container(c) for c in response.containers]

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None


def _container(c: cri_runtime_v1_pb2.Container) -> CriContainer:
    labels = c.labels
    return CriContainer(
        id=c.id,
        pod=labels.get(POD_NAME_LABEL, ""),
        namespace=labels.get(POD_NAMESPACE_LABEL, ""),
        container=labels.get(CONTAINER_NAME_LABEL, ""),
        pod_uid=labels.get(POD_UID_LABEL, ""),
    )
