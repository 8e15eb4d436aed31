"""A client of the kubelet's pod-resources API v1 (``PodResourcesLister`` on
``/var/lib/kubelet/pod-resources/kubelet.sock``): which container holds which devices.

It only asks; what the answer means for the GPUs is the caller's business (the metrics'
pod attribution). A failed call is a :class:`PodResourcesError` naming the gRPC status, so
callers need no gRPC of their own.
"""

from __future__ import annotations

from typing import Any

import grpc

from agent._proto import podresources_v1_pb2, podresources_v1_pb2_grpc
from agent.errors import AgentError


class PodResourcesError(AgentError):
    """``List`` failed: the kubelet is absent, restarting, or refused (``CODE: details``)."""


class PodResourcesClient:
    """A ``PodResourcesLister`` client on a unix socket; the channel is reused."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def list(self) -> Any:
        """``List`` -> ``ListPodResourcesResponse``; raises PodResourcesError on failure."""
        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
            self._stub = podresources_v1_pb2_grpc.PodResourcesListerStub(self._channel)
        try:
            return self._stub.List(podresources_v1_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise PodResourcesError(rpc_message(exc)) from exc

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None


def rpc_message(exc: grpc.RpcError) -> str:
    """A failed call as one line: ``CODE: details``."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    try:
        return f"{code().name if code else 'UNKNOWN'}: {details() if details else exc}"
    except Exception:  # an RpcError that is not a Call
        return str(exc)
