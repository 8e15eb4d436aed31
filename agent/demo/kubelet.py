"""A stand-in kubelet over real unix sockets, for the demo and the tests.

* :class:`KubeletStub` serves ``/v1beta1.Registration/Register`` on ``<dir>/kubelet.sock``.
  Like the kubelet's device manager, its Register handler checks the version and resource
  name, dials the plugin's socket and calls GetDevicePluginOptions *before* answering, then
  opens ListAndWatch in the background and keeps the latest device list per resource.
* :class:`PluginClient` is a client of one plugin socket.
* :class:`PodResourcesStub` serves ``/v1.PodResourcesLister/*`` with a canned answer.

Both serve through the agent's own :class:`agent.kubelet.unix_server.UnixGrpcServer` (a
stale socket file is replaced, a live server's never taken; stop removes only ours), as the
kubelet's ``grpc.NewServer`` on a ``net.Listen("unix", ...)`` after removing a stale file.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc

from agent._proto import deviceplugin_v1beta1_pb2 as pb
from agent._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from agent._proto import podresources_v1_pb2 as pr
from agent._proto import podresources_v1_pb2_grpc as pr_grpc
from agent.kubelet.unix_server import UnixGrpcServer


class PluginClient:
    """A gRPC client of one device-plugin socket."""

    def __init__(self, socket_path: str) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)

    def options(self, timeout_s: float = 5.0) -> pb.DevicePluginOptions:
        options: pb.DevicePluginOptions = self.stub.GetDevicePluginOptions(pb.Empty(), timeout=timeout_s)
        return options

    def preferred(self, available: Iterable[str], must_include: Iterable[str], size: int,
                  timeout_s: float = 5.0) -> list[str]:
        req = pb.PreferredAllocationRequest()
        req.container_requests.add(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size
        )
        resp = self.stub.GetPreferredAllocation(req, timeout=timeout_s)
        return list(resp.container_responses[0].deviceIDs)

    def allocate(self, *containers: Iterable[str], timeout_s: float = 5.0) -> pb.AllocateResponse:
        req = pb.AllocateRequest()
        for ids in containers:
            req.container_requests.add(devices_ids=list(ids))
        response: pb.AllocateResponse = self.stub.Allocate(req, timeout=timeout_s)
        return response

    def start_containers(self, *containers: Iterable[str], timeout_s: float = 5.0) -> pb.AllocateResponse:
        """What the kubelet does for a pod's containers: Allocate at admission, then, before
        each container starts, PreStartContainer where the plugin's options ask for it (the
        device manager's ``GetDeviceRunContainerOptions`` -> ``callPreStartContainerIfNeeded``)."""
        response = self.allocate(*containers, timeout_s=timeout_s)
        if self.options(timeout_s).pre_start_required:
            for ids in containers:
                self.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=list(ids)), timeout=timeout_s)
        return response

    def close(self) -> None:
        self.channel.close()


@dataclass
class Registration:
    request: pb.RegisterRequest
    options: pb.DevicePluginOptions  # what GetDevicePluginOptions answered during Register


class _RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: "KubeletStub") -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        k = self.kubelet
        if k.refuse_reason:
            context.abort(grpc.StatusCode.UNKNOWN, k.refuse_reason)
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.UNKNOWN, f"unsupported API version {request.version!r}")
        if "/" not in request.resource_name:
            context.abort(grpc.StatusCode.UNKNOWN, f"invalid resource name {request.resource_name!r}")
        path = os.path.join(k.kubelet_dir, request.endpoint)
        client = PluginClient(path)
        try:
            options = client.options(timeout_s=2.0)
        except grpc.RpcError as exc:
            client.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"cannot reach plugin at {path}: {exc.code()}")
        with k.cond:
            k.registrations.append(Registration(request, options))
            k.cond.notify_all()
        if k.watch:
            k._start_watch(request.resource_name, client)
        else:
            client.close()
        return pb.Empty()


class KubeletStub:
    """Registration server on ``<kubelet_dir>/kubelet.sock`` (see the module docstring)."""

    def __init__(self, kubelet_dir: str, *, watch: bool = True, refuse_reason: str | None = None) -> None:
        self.kubelet_dir = kubelet_dir
        self.socket_path = os.path.join(kubelet_dir, "kubelet.sock")
        self.watch = watch
        self.refuse_reason = refuse_reason
        self.cond = threading.Condition()
        self.registrations: list[Registration] = []
        self.device_lists: dict[str, list[pb.ListAndWatchResponse]] = {}
        servicer = _RegistrationServicer(self)
        self._server = UnixGrpcServer(
            self.socket_path, lambda server: pb_grpc.add_RegistrationServicer_to_server(servicer, server),
            name="kubelet-stub", max_workers=8, in_use="a kubelet is serving on this socket",
        )
        self._streams: list[tuple[PluginClient, grpc.Call, threading.Thread]] = []

    # -------------------------------------------------------------- lifecycle
    def start(self) -> "KubeletStub":
        """Listen on ``kubelet.sock`` (making the directory, as the kubelet's ``MkdirAll``)."""
        self._server.start()
        return self

    def stop(self) -> None:
        for client, call, thread in self._streams:
            call.cancel()
            thread.join(5)
            client.close()
        self._streams = []
        self._server.stop(0)  # and removes kubelet.sock

    # -------------------------------------------------------------- streams
    def _start_watch(self, resource: str, client: PluginClient) -> None:
        call = client.stub.ListAndWatch(pb.Empty())

        def consume() -> None:
            try:
                for msg in call:
                    with self.cond:
                        self.device_lists.setdefault(resource, []).append(msg)
                        self.cond.notify_all()
            except grpc.RpcError:
                pass

        thread = threading.Thread(target=consume, name=f"kubelet-stub-watch-{resource}", daemon=True)
        thread.start()
        self._streams.append((client, call, thread))

    # -------------------------------------------------------------- queries
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def registered(self, resource: str) -> list[Registration]:
        with self.cond:
            return [r for r in self.registrations if r.request.resource_name == resource]

    def latest(self, resource: str) -> pb.ListAndWatchResponse | None:
        with self.cond:
            lists = self.device_lists.get(resource)
            return lists[-1] if lists else None


class _PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, stub: "PodResourcesStub") -> None:
        self.stub = stub

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        gate = self.stub.list_gate
        if gate is not None:  # a slow kubelet: answer once the gate opens (or the call ends)
            while not gate.wait(0.05) and context.is_active():
                pass
        return self.stub.list_response

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        return self.stub.allocatable_response

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        for pod in self.stub.list_response.pod_resources:
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=pod)
        context.set_code(grpc.StatusCode.NOT_FOUND)
        context.set_details(f"pod {request.pod_namespace}/{request.pod_name} not found")
        return pr.GetPodResourcesResponse()


class PodResourcesStub:
    """``/v1.PodResourcesLister`` on ``socket_path`` answering ``list_response``. With
    ``list_gate`` set to an event, ``List`` answers only once the event is set (a slow
    kubelet)."""

    def __init__(self, socket_path: str, list_response: pr.ListPodResourcesResponse | None = None) -> None:
        self.socket_path = socket_path
        self.list_response = list_response or pr.ListPodResourcesResponse()
        self.allocatable_response = pr.AllocatableResourcesResponse()
        self.list_gate: threading.Event | None = None
        servicer = _PodResourcesServicer(self)
        self._server = UnixGrpcServer(
            socket_path, lambda server: pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server),
            name="podres-stub", max_workers=4, in_use="a pod-resources server is serving on this socket",
        )

    def start(self) -> "PodResourcesStub":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)
