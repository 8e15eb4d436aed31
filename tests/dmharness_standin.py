"""A stand-in for ``dmharness``: the kubelet's device manager and topology manager (Kubernetes
v1.32) around a fake pod admission loop, in Python, so that the conformance tier runs in every
test run and not only where the real binary is (``tests/k8s_binaries.py``).

Run as the real one is, with the same flags (``python tests/dmharness_standin.py -dir D -log L
-json S -policy P -scope S -numa N -sizes 1,2,4 -resource R -timeout 20s [-agent-first 1s] --
AGENT ARGS``, ``{DIR}`` in the agent's arguments replaced by ``-dir``): it starts the agent,
admits the pods, restarts the managers, stops the agent, writes the JSON summary to ``-json``,
its managers' log (klog format) to ``-log`` and the agent's output to ``-log`` + ``.agent``.
Exit 0 when every phase ran (what the agent did is the tests' to judge), 1 when one could not
(the agent never registered, never came back after the restart, never exited).

What each part follows (kubernetes/kubernetes v1.32, ``pkg/kubelet/cm/``):

* Registration (:class:`_Registration`, :meth:`DeviceManager.connect`):
  ``devicemanager/plugin/v1beta1/server.go`` ``Register`` (version ``v1beta1`` and an extended
  resource name, else the call fails), ``connectClient`` (the client is registered under the
  resource, then ``Connect``: dial the plugin's socket, ``PluginConnected`` calls
  GetDevicePluginOptions and keeps the endpoint and its options) and ``runClient`` (when
  ``client.Run``'s ListAndWatch ends, whatever client is registered under the resource then is
  disconnected: ``PluginDisconnected``). ``client.go`` ``Run`` logs ``ListAndWatch ended
  unexpectedly for device plugin`` at E level with the stream's error (``EOF`` for a stream the
  plugin ended, else the gRPC status as Go prints it).
* Device lists and capacity: ``manager.go`` ``genericDeviceUpdateCallback`` (each list replaces
  the resource's devices: healthy, unhealthy, TopologyInfo; the checkpoint is written),
  ``PluginDisconnected`` / ``markResourceUnhealthy`` (every device unhealthy: allocatable 0,
  capacity kept for the stop grace period) and ``GetCapacity`` (capacity healthy + unhealthy,
  allocatable healthy).
* Start and restart: ``server.go`` ``Start`` -> ``manager.go`` ``CleanupPluginDirectory``
  (every socket in the directory is removed, the checkpoint and other files stay, then
  ``kubelet.sock`` is listened on) after ``readCheckpoint`` (pod devices and allocate
  responses restored; each registered resource has no healthy device until its plugin
  registers again). A restart is the old managers vanishing without a word (a killed
  process: nothing more in the log, the plugin's stream ends) and new ones starting on the
  same directory.
* Hints: ``devicemanager/topology_hints.go`` ``GetTopologyHints`` / ``GetPodTopologyHints``
  (``UpdateAllocatedDevices`` first; no hint (nil) for a resource none of whose devices has
  TopologyInfo; hints regenerated from the devices already allocated to the container or pod;
  ``Unable to generate topology hints: requested number of devices unavailable`` at E level and
  an empty list when too few are free), ``generateDeviceTopologyHints`` (every NUMA mask of the
  manager's nodes; a mask is a hint when enough available devices touch it; preferred when its
  size is the smallest that holds the request counting *all* the resource's devices).
* Merging and admission: ``topologymanager/policy.go`` (``filterProvidersHints``,
  ``mergePermutation``, ``HintMerger.compare`` with ``maxOfMinAffinityCounts``, narrowest mask
  via ``bitmask.IsNarrowerThan``; prefer-closest-numa-nodes off, the default),
  ``policy_best_effort.go`` (always admits), ``policy_restricted.go`` (admits a preferred
  hint), ``policy_single_numa_node.go`` (``filterSingleNumaHints``; a best hint equal to the
  default mask becomes nil), ``scope_container.go`` / ``scope_pod.go`` (hint per container /
  one per pod, stored, then each container's resources allocated), ``scope_none.go`` (policy
  none: no hints, allocation only); ``admission.GetPodAdmitResult`` (reasons
  ``TopologyAffinityError`` / ``UnexpectedAdmissionError``).
* Allocation: ``manager.go`` ``Allocate`` / ``allocateContainerResources`` (Allocate RPC with
  the chosen devices, response kept, checkpoint written) / ``devicesToAllocate`` (reuse, the
  ``requested number of devices unavailable`` error, then ``filterByAffinity``'s aligned /
  unaligned / no-affinity sets; GetPreferredAllocation over the aligned set when it holds more
  than needed, else all aligned first and GetPreferredAllocation over every available device;
  only with ``getPreferredAllocationAvailable``) / ``callGetPreferredAllocationIfAvailable``.
  Go iterates sets in random order; the stand-in takes devices and passes lists sorted (one
  order the real one may take).
* Container start: ``GetDeviceRunContainerOptions`` (PreStartContainer with the container's
  devices where the plugin's options ask for it) and ``pod_devices.go``
  ``deviceRunContainerOptions`` (envs, mounts and device specs deduplicated by container path,
  annotations, CDI devices).

Where it differs: one container per pod; no CPU or memory manager (the device manager is the
only hint provider); the checkpoint is JSON of the same shape with a CRC-32 checksum (upstream
hashes the Go object); messages at I level are paraphrased, those at E level are upstream's.
Summary fields: see :meth:`Session.summary`.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from agent._proto import deviceplugin_v1beta1_pb2 as pb
from agent._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
NO_TOPOLOGY = -1  # upstream's nodeWithoutTopology
CONTAINER = "gpu"
_GO_CODES = {
    "CANCELLED": "Canceled",
    "DEADLINE_EXCEEDED": "DeadlineExceeded",
    "INVALID_ARGUMENT": "InvalidArgument",
}


def _go_status(exc: grpc.RpcError) -> str:
    """An RPC error as Go's grpc prints it (``rpc error: code = Unavailable desc = ...``)."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    name = _GO_CODES.get(code.name, code.name.title().replace("_", ""))
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return f"rpc error: code = {name} desc = {details}"


class KLog:
    """klog-format lines (``E1123 13:39:09.123456 4242 file.go] "msg" key="value"``) to a file;
    the W and E lines are also kept for the summary's ``managerWarningsAndErrors``."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()
        self.problems: list[str] = []

    def _line(
        self, level: str, where: str, msg: str, err: str | None, kv: dict[str, object]
    ) -> None:
        now = time.time()
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
        parts = [json.dumps(msg)] + ([f"err={json.dumps(err)}"] if err is not None else [])
        parts += [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in kv.items()]
        line = f"{level}{stamp} {os.getpid():7d} {where}] {' '.join(parts)}"
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            if level in "WE":
                self.problems.append(line)

    def info(self, where: str, msg: str, **kv: object) -> None:
        self._line("I", where, msg, None, kv)

    def error(self, where: str, msg: str, err: str | None = None, **kv: object) -> None:
        self._line("E", where, msg, err, kv)

    def close(self) -> None:
        self._file.close()


# ----------------------------------------------------------------------------- topology manager


def _count(mask: int) -> int:
    return bin(mask).count("1")


def _bits(mask: int) -> list[int]:
    return [i for i in range(64) if mask >> i & 1]


def _narrower(a: int, b: int) -> bool:
    """``bitmask.IsNarrowerThan``: fewer bits; with as many, the smaller number."""
    return a < b if _count(a) == _count(b) else _count(a) < _count(b)


@dataclass(frozen=True)
class Hint:
    """``topologymanager.TopologyHint``: a NUMA mask (None: any) and whether it is preferred."""

    mask: int | None
    preferred: bool

    def text(self) -> str:
        """``0,1*``: the mask's NUMA nodes (``nil`` for none), ``*`` when preferred."""
        nodes = "nil" if self.mask is None else ",".join(map(str, _bits(self.mask)))
        return nodes + ("*" if self.preferred else "")


HintsByResource = dict[str, list[Hint] | None]


class TopologyManager:
    """Policy, scope and hint store (see the module docstring for the upstream files)."""

    def __init__(self, policy: str, scope: str, numa_nodes: list[int], log: KLog) -> None:
        self.policy, self.scope, self.log = policy, scope, log
        self.default = sum(1 << n for n in numa_nodes)
        self.store: dict[tuple[str, str], Hint] = {}

    def get_affinity(self, uid: str, container: str) -> Hint:
        return self.store.get((uid, container), Hint(None, False))

    def merge(self, provider_hints: list[HintsByResource]) -> tuple[Hint, bool]:
        filtered = self._filter(provider_hints)
        if self.policy == "single-numa-node":
            filtered = [
                [h for h in hints if h.preferred and (h.mask is None or _count(h.mask) == 1)]
                for hints in filtered
            ]
        best = self._merge(filtered)
        if self.policy == "single-numa-node" and best.mask == self.default:
            best = Hint(None, best.preferred)
        admit = self.policy == "best-effort" or best.preferred
        return best, admit

    @staticmethod
    def _filter(provider_hints: list[HintsByResource]) -> list[list[Hint]]:
        out: list[list[Hint]] = []
        for hints in provider_hints:
            if not hints:
                out.append([Hint(None, True)])
                continue
            for resource_hints in hints.values():
                if resource_hints is None:
                    out.append([Hint(None, True)])
                elif not resource_hints:
                    out.append([Hint(None, False)])
                else:
                    out.append(resource_hints)
        return out

    def _merge(self, filtered: list[list[Hint]]) -> Hint:
        best_non_preferred = 0
        for hints in filtered:
            masks = [h.mask for h in hints if h.mask is not None]
            if masks:
                narrowest = masks[0]
                for m in masks[1:]:
                    if _narrower(m, narrowest):
                        narrowest = m
                best_non_preferred = max(best_non_preferred, _count(narrowest))
        best: Hint | None = None
        for permutation in itertools.product(*filtered):
            preferred, masks = True, []
            for hint in permutation:
                if hint.mask is not None:
                    masks.append(hint.mask)
                    if hint.mask != masks[0]:
                        preferred = False
                if not hint.preferred:
                    preferred = False
            merged = self.default
            for m in masks:
                merged &= m
            best = self._compare(best, Hint(merged, preferred), best_non_preferred)
        return best if best is not None else Hint(self.default, False)

    @staticmethod
    def _fitter(current: Hint, candidate: Hint) -> Hint:
        assert current.mask is not None and candidate.mask is not None
        if candidate.mask == current.mask or _narrower(current.mask, candidate.mask):
            return current
        return candidate

    def _compare(self, current: Hint | None, candidate: Hint, target: int) -> Hint | None:
        assert candidate.mask is not None
        if _count(candidate.mask) == 0:
            return current
        if current is None:
            return candidate
        if current.preferred != candidate.preferred:
            return current if current.preferred else candidate
        if current.preferred:
            return self._fitter(current, candidate)
        assert current.mask is not None
        have, cand = _count(current.mask), _count(candidate.mask)
        if have > target:
            return self._fitter(current, candidate)
        if have == target:
            return current if cand != target else self._fitter(current, candidate)
        if cand > target:
            return current
        if cand == target:
            return candidate
        if cand != have:
            return candidate if cand > have else current
        return self._fitter(current, candidate)


# ----------------------------------------------------------------------------- device manager


@dataclass
class Pod:
    uid: str
    name: str
    resource: str
    request: int


@dataclass
class Entry:
    """One container's allocation of one resource (``podDevices``' entry)."""

    devices: list[str]
    numa: dict[int, list[str]]
    response: pb.ContainerAllocateResponse


@dataclass
class Endpoint:
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    options: pb.DevicePluginOptions | None
    stopped: bool = False


@dataclass
class Client:
    resource: str
    socket: str
    endpoint: Endpoint | None = None
    call: Any = None


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, manager: "DeviceManager") -> None:
        self.manager = manager

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        m = self.manager
        m.log.info(
            "server.go",
            "Got registration request from device plugin with resource",
            resourceName=request.resource_name,
        )
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f'requested device plugin API version {request.version} is not supported by kubelet. Supported versions are ["v1beta1"]',
            )
        name = request.resource_name
        if (
            "/" not in name
            or name.startswith("kubernetes.io/")
            or name.split("/", 1)[0].endswith(".kubernetes.io")
            or name.startswith("requests.")
        ):
            context.abort(grpc.StatusCode.UNKNOWN, f"the ResourceName {name!r} is invalid")
        error = m.connect(name, os.path.join(m.dir, request.endpoint))
        if error is not None:
            context.abort(grpc.StatusCode.UNKNOWN, error)
        m.on_register(name)
        return pb.Empty()


class DeviceManager:
    """The device manager's state and its Registration server (module docstring)."""

    def __init__(
        self, directory: str, numa_nodes: list[int], log: KLog, active: Callable[[], list[Pod]]
    ) -> None:
        self.dir, self.numa_nodes, self.log, self.active = directory, numa_nodes, log, active
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.endpoints: dict[str, Endpoint] = {}
        self.clients: dict[str, Client] = {}
        self.all_devices: dict[str, dict[str, list[int]]] = {}
        self.healthy: dict[str, set[str]] = {}
        self.unhealthy: dict[str, set[str]] = {}
        self.pod_devices: dict[str, dict[str, dict[str, Entry]]] = {}
        self.allocated: dict[str, set[str]] = {}
        self.pending: Pod | None = None
        self.registrations: list[tuple[str, float]] = []
        self.lists: dict[str, list[tuple[list[str], list[str]]]] = {}
        self.preferred_seen: list[str] = []
        self.dead = False
        self._server: grpc.Server | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> float:
        os.makedirs(self.dir, mode=0o750, exist_ok=True)
        self._read_checkpoint()
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name == CHECKPOINT:
                continue
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError as exc:
                self.log.error("manager.go", "Failed to remove file", err=str(exc), path=path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix:{os.path.join(self.dir, KUBELET_SOCKET)}")
        server.start()
        self._server = server
        self.log.info(
            "server.go",
            "Serving device plugin registration server on socket",
            path=os.path.join(self.dir, KUBELET_SOCKET),
        )
        return time.monotonic()

    def kill(self) -> None:
        """Vanish as a killed kubelet does: no more log lines, streams and server gone."""
        with self.lock:
            self.dead = True
            clients = list(self.clients.values())
        for c in clients:
            if c.call is not None:
                c.call.cancel()
            if c.endpoint is not None:
                c.endpoint.channel.close()
        if self._server is not None:
            self._server.stop(0).wait(5)

    # ---------------------------------------------------------------- plugins
    def connect(self, resource: str, socket: str) -> str | None:
        client = Client(resource, socket)
        with self.lock:
            self.clients[resource] = client
        channel = grpc.insecure_channel(f"unix:{socket}")
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            channel.close()
            with self.lock:
                self.clients.pop(resource, None)
            err = _go_status(exc) if isinstance(exc, grpc.RpcError) else "context deadline exceeded"
            self.log.error(
                "server.go",
                "Failed to connect to new client",
                err=f"failed to get device plugin options: {err}",
                resource=resource,
            )
            return f"failed to get device plugin options: {err}"
        endpoint = Endpoint(channel, stub, options)
        client.endpoint = endpoint
        with self.lock:
            self.endpoints[resource] = endpoint
        self.log.info("manager.go", "Device plugin connected", resourceName=resource)
        call = stub.ListAndWatch(pb.Empty())
        client.call = call
        threading.Thread(
            target=self._run_client, args=(client, call), daemon=True, name=f"law-{resource}"
        ).start()
        return None

    def on_register(self, resource: str) -> None:
        with self.cond:
            self.registrations.append((resource, time.monotonic()))
            self.cond.notify_all()

    def _run_client(self, client: Client, call: Any) -> None:
        try:
            for response in call:
                self._device_update(client.resource, response)
            err = "EOF"
        except grpc.RpcError as exc:
            err = _go_status(exc)
        with self.lock:
            if self.dead:
                return
            self.log.error(
                "client.go",
                "ListAndWatch ended unexpectedly for device plugin",
                err=err,
                resource=client.resource,
            )
            current = self.clients.pop(client.resource, None)
        if current is not None and current.endpoint is not None:
            current.endpoint.channel.close()
            self._disconnected(client.resource)

    def _device_update(self, resource: str, response: pb.ListAndWatchResponse) -> None:
        with self.cond:
            healthy, unhealthy, devices = set(), set(), {}
            for d in response.devices:
                (healthy if d.health == "Healthy" else unhealthy).add(d.ID)
                devices[d.ID] = (
                    sorted(n.ID for n in d.topology.nodes) if d.HasField("topology") else []
                )
            self.all_devices[resource] = devices
            self.healthy[resource], self.unhealthy[resource] = healthy, unhealthy
            self.lists.setdefault(resource, []).append((sorted(healthy), sorted(unhealthy)))
            self._write_checkpoint()
            self.cond.notify_all()

    def _disconnected(self, resource: str) -> None:
        with self.cond:
            endpoint = self.endpoints.get(resource)
            if endpoint is None:
                return
            self.unhealthy[resource] = self.unhealthy.get(resource, set()) | self.healthy.get(
                resource, set()
            )
            self.healthy[resource] = set()
            endpoint.stopped = True
            self.log.info("manager.go", "Endpoint became unhealthy", resourceName=resource)
            self.cond.notify_all()

    def capacity(self, resource: str) -> tuple[int, int]:
        with self.lock:
            healthy = len(self.healthy.get(resource, ()))
            return healthy + len(self.unhealthy.get(resource, ())), healthy

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout_s)

    # ---------------------------------------------------------------- checkpoint
    def _checkpoint_path(self) -> str:
        return os.path.join(self.dir, CHECKPOINT)

    def _write_checkpoint(self) -> None:
        entries = [
            {
                "PodUID": uid,
                "ContainerName": cname,
                "ResourceName": res,
                "DeviceIDs": {str(n): ids for n, ids in e.numa.items()},
                "AllocResp": base64.b64encode(e.response.SerializeToString()).decode(),
            }
            for uid, containers in self.pod_devices.items()
            for cname, resources in containers.items()
            for res, e in resources.items()
        ]
        registered = {
            r: sorted(self.healthy.get(r, set()) | self.unhealthy.get(r, set()))
            for r in self.all_devices
        }
        data = {"PodDeviceEntries": entries, "RegisteredDevices": registered}
        blob = {"Data": data, "Checksum": zlib.crc32(json.dumps(data, sort_keys=True).encode())}
        tmp = self._checkpoint_path() + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(blob, f)
        os.replace(tmp, self._checkpoint_path())

    def _read_checkpoint(self) -> None:
        try:
            with open(self._checkpoint_path(), encoding="utf-8") as f:
                blob = json.load(f)
        except FileNotFoundError:
            return
        data = blob["Data"]
        if zlib.crc32(json.dumps(data, sort_keys=True).encode()) != blob["Checksum"]:
            self.log.error(
                "manager.go", "Failed to read data from checkpoint", err="checkpoint is corrupted"
            )
            return
        for e in data["PodDeviceEntries"]:
            numa = {int(n): ids for n, ids in e["DeviceIDs"].items()}
            response = pb.ContainerAllocateResponse.FromString(base64.b64decode(e["AllocResp"]))
            devices = sorted({d for ids in numa.values() for d in ids})
            self.pod_devices.setdefault(e["PodUID"], {}).setdefault(e["ContainerName"], {})[
                e["ResourceName"]
            ] = Entry(devices, numa, response)
        self.allocated = self._pod_devices_in_use()
        for resource in data["RegisteredDevices"]:
            self.healthy[resource], self.unhealthy[resource] = set(), set()

    def _pod_devices_in_use(self) -> dict[str, set[str]]:
        used: dict[str, set[str]] = {}
        for containers in self.pod_devices.values():
            for resources in containers.values():
                for res, e in resources.items():
                    used.setdefault(res, set()).update(e.devices)
        return used

    # ---------------------------------------------------------------- hints
    def _update_allocated(self) -> None:
        keep = {p.uid for p in self.active()} | ({self.pending.uid} if self.pending else set())
        gone = [uid for uid in self.pod_devices if uid not in keep]
        for uid in gone:
            del self.pod_devices[uid]
        if gone:
            self.allocated = self._pod_devices_in_use()

    def _aligned(self, resource: str) -> bool:
        return any(self.all_devices.get(resource, {}).values())

    def topology_hints(self, pod: Pod) -> HintsByResource:
        """``GetTopologyHints`` (one container: the pod's hints are the same)."""
        with self.lock:
            self._update_allocated()
            resource, requested = pod.resource, pod.request
            if not self._aligned(resource):
                return {resource: None}
            entry = self.pod_devices.get(pod.uid, {}).get(CONTAINER, {}).get(resource)
            if entry is not None:
                if len(entry.devices) != requested:
                    self.log.error(
                        "topology_hints.go",
                        "Resource already allocated to pod with different number than request",
                        resource=resource,
                        request=requested,
                        allocated=len(entry.devices),
                    )
                    return {resource: []}
                return {resource: self._generate(resource, set(entry.devices), requested)}
            available = self.healthy.get(resource, set()) - self.allocated.get(resource, set())
            if len(available) < requested:
                self.log.error(
                    "topology_hints.go",
                    "Unable to generate topology hints: requested number of devices unavailable",
                    resource=resource,
                    request=requested,
                    available=len(available),
                )
                return {resource: []}
            return {resource: self._generate(resource, available, requested)}

    def _generate(self, resource: str, available: set[str], request: int) -> list[Hint]:
        devices = self.all_devices[resource]
        min_size = len(self.numa_nodes)
        hints: list[Hint] = []
        for size in range(1, len(self.numa_nodes) + 1):
            for combo in itertools.combinations(self.numa_nodes, size):
                in_mask = sum(1 for nodes in devices.values() if set(nodes) & set(combo))
                if in_mask >= request and size < min_size:
                    min_size = size
                matching = sum(1 for d in available if set(devices.get(d, [])) & set(combo))
                if matching >= request:
                    hints.append(Hint(sum(1 << n for n in combo), False))
        return [Hint(h.mask, _count(h.mask or 0) == min_size) for h in hints]

    # ---------------------------------------------------------------- allocation
    def allocate(self, pod: Pod, hint: Hint) -> str | None:
        """``Allocate`` for the pod's one container; an error text or None."""
        with self.lock:
            self.pending = pod
            self._update_allocated()
            try:
                chosen = self._devices_to_allocate(pod, hint)
            except _AllocError as exc:
                return str(exc)
            if not chosen:
                return None
            endpoint = self.endpoints.get(pod.resource)
        if endpoint is None:
            with self.lock:
                self.allocated = self._pod_devices_in_use()
            return f"unknown Device Plugin {pod.resource}"
        request = pb.AllocateRequest()
        request.container_requests.add(devices_ids=sorted(chosen))
        try:
            response = endpoint.stub.Allocate(request, timeout=10)
        except grpc.RpcError as exc:
            with self.lock:
                self.allocated = self._pod_devices_in_use()
            return _go_status(exc)
        if not response.container_responses:
            return f"no containers return in allocation response {response}"
        with self.lock:
            numa: dict[int, list[str]] = {}
            for d in sorted(chosen):
                for n in self.all_devices[pod.resource].get(d) or [NO_TOPOLOGY]:
                    numa.setdefault(n, []).append(d)
            self.pod_devices.setdefault(pod.uid, {}).setdefault(CONTAINER, {})[pod.resource] = (
                Entry(sorted(chosen), numa, response.container_responses[0])
            )
            self._write_checkpoint()
        return None

    def _devices_to_allocate(self, pod: Pod, hint: Hint) -> set[str]:
        resource, needed = pod.resource, pod.request
        entry = self.pod_devices.get(pod.uid, {}).get(CONTAINER, {}).get(resource)
        if entry is not None:
            if len(entry.devices) != needed:
                raise _AllocError(
                    f"pod {pod.uid} container {CONTAINER} changed request for resource {resource!r} from {len(entry.devices)} to {needed}"
                )
            needed = 0
        if resource not in self.healthy:
            raise _AllocError(f"cannot allocate unregistered device {resource}")
        healthy = self.healthy[resource]
        if not healthy:
            raise _AllocError(
                f"no healthy devices present; cannot allocate unhealthy devices {resource}"
            )
        if entry is not None and not healthy >= set(entry.devices):
            raise _AllocError(
                f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {resource}"
            )
        if needed == 0:
            return set()
        allocated: set[str] = set()
        in_use = self.allocated.setdefault(resource, set())

        def take(devices: set[str]) -> bool:
            nonlocal needed
            for d in sorted(devices - allocated):
                if needed <= 0:
                    break
                in_use.add(d)
                allocated.add(d)
                needed -= 1
            return needed == 0

        available = healthy - in_use
        if len(available) < needed:
            raise _AllocError(
                f"requested number of devices unavailable for {resource}. Requested: {needed}, Available: {len(available)}"
            )
        aligned, unaligned, no_affinity = self._filter_by_affinity(resource, hint, available)
        if needed < len(aligned):
            preferred = self._preferred(pod, aligned | allocated, allocated, pod.request)
            if take(preferred & aligned) or take(aligned):
                return allocated
            raise _AllocError(
                f"unexpectedly allocated less resources than required. Requested: {pod.request}, Got: {pod.request - needed}"
            )
        if take(aligned):
            return allocated
        preferred = self._preferred(pod, available | allocated, allocated, pod.request)
        if take(preferred & available) or take(unaligned) or take(no_affinity):
            return allocated
        raise _AllocError(
            f"unexpectedly allocated less resources than required. Requested: {pod.request}, Got: {pod.request - needed}"
        )

    def _filter_by_affinity(
        self, resource: str, hint: Hint, available: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        if not self._aligned(resource) or hint.mask is None:
            return set(), set(), set(available)
        mask = hint.mask
        per_node: dict[int, set[str]] = {}
        for d in available:
            for n in self.all_devices[resource].get(d) or [NO_TOPOLOGY]:
                per_node.setdefault(n, set()).add(d)

        def order(n: int) -> tuple[int, int, int]:
            group = 0 if n >= 0 and mask >> n & 1 else (2 if n == NO_TOPOLOGY else 1)
            return group, len(per_node[n]), n

        nodes = sorted(per_node, key=order)
        sets: tuple[set[str], set[str], set[str]] = (set(), set(), set())
        for d in available:
            n = next(n for n in nodes if d in per_node[n])
            sets[order(n)[0]].add(d)
        return sets

    def _preferred(self, pod: Pod, available: set[str], must: set[str], size: int) -> set[str]:
        endpoint = self.endpoints.get(pod.resource)
        if endpoint is None:
            raise _AllocError(
                f"endpoint not found in cache for a registered resource: {pod.resource}"
            )
        if endpoint.options is None or not endpoint.options.get_preferred_allocation_available:
            return set()
        request = pb.PreferredAllocationRequest()
        request.container_requests.add(
            available_deviceIDs=sorted(available),
            must_include_deviceIDs=sorted(must),
            allocation_size=size,
        )
        self.lock.release()
        try:
            response = endpoint.stub.GetPreferredAllocation(request, timeout=10)
        except grpc.RpcError as exc:
            raise _AllocError(
                f"device plugin GetPreferredAllocation rpc failed with err: {_go_status(exc)}"
            ) from None
        finally:
            self.lock.acquire()
        ids = (
            list(response.container_responses[0].deviceIDs) if response.container_responses else []
        )
        self.preferred_seen = ids
        return set(ids)

    def pre_start(self, pod: Pod) -> list[str] | None:
        """``GetDeviceRunContainerOptions``' PreStartContainer call, where the plugin asks."""
        with self.lock:
            endpoint = self.endpoints.get(pod.resource)
            entry = self.pod_devices.get(pod.uid, {}).get(CONTAINER, {}).get(pod.resource)
        if (
            endpoint is None
            or entry is None
            or endpoint.options is None
            or not endpoint.options.pre_start_required
        ):
            return None
        endpoint.stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=entry.devices), timeout=10
        )
        return entry.devices

    def run_options(self, pod: Pod) -> dict[str, Any]:
        """``deviceRunContainerOptions`` of the pod's container, as the summary writes them."""
        envs: dict[str, str] = {}
        mounts: dict[str, str] = {}
        nodes: dict[str, str] = {}
        annotations: dict[str, str] = {}
        cdi: list[str] = []
        with self.lock:
            resources = self.pod_devices.get(pod.uid, {}).get(CONTAINER, {})
            for resource in sorted(resources):
                resp = resources[resource].response
                for k, v in resp.envs.items():
                    if k in envs and envs[k] != v:
                        self.log.error(
                            "pod_devices.go",
                            "Environment variable has conflicting setting",
                            envVar=k,
                            current=envs[k],
                            new=v,
                        )
                    envs[k] = v
                for mount in resp.mounts:
                    mounts.setdefault(
                        mount.container_path,
                        f"{mount.host_path}->{mount.container_path} ro={str(mount.read_only).lower()}",
                    )
                for spec in resp.devices:
                    nodes.setdefault(
                        spec.container_path,
                        f"{spec.host_path}->{spec.container_path} {spec.permissions}",
                    )
                for k, v in resp.annotations.items():
                    if k in annotations and annotations[k] != v:
                        self.log.error(
                            "pod_devices.go",
                            "Annotation has conflicting setting",
                            annotation=k,
                            current=annotations[k],
                            new=v,
                        )
                    annotations[k] = v
                cdi += [c.name for c in resp.cdi_devices if c.name not in cdi]
        return {
            "envs": envs,
            "mounts": list(mounts.values()),
            "deviceNodes": list(nodes.values()),
            "annotations": annotations,
            "cdiDevices": cdi,
        }

    def devices_of(self, pod: Pod) -> list[str]:
        with self.lock:
            entry = self.pod_devices.get(pod.uid, {}).get(CONTAINER, {}).get(pod.resource)
            return list(entry.devices) if entry else []


class _AllocError(Exception):
    pass


# ----------------------------------------------------------------------------- the harness


def _duration(text: str) -> float:
    """A Go duration (``20s``, ``500ms``, ``1m``) in seconds."""
    total = 0.0
    for number, unit in re.findall(r"([0-9.]+)(ms|s|m|h)", text):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    if not total and text not in ("0", "0s"):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}")
    return total


@dataclass
class Options:
    dir: str
    log: str
    json: str
    policy: str
    scope: str
    numa: int
    sizes: list[int]
    resource: str
    timeout: float
    agent_first: float | None
    agent: list[str] = field(default_factory=list)


class Session:
    """One harness run: the phases, in order, and what the summary says of each."""

    def __init__(self, opts: Options) -> None:
        self.o = opts
        self.log = KLog(opts.log)
        self.running: list[Pod] = []
        self.pods: list[dict[str, Any]] = []
        self.out: dict[str, Any] = {}
        self.agent: subprocess.Popen[bytes] | None = None
        self._uids = itertools.count(1)
        self.topology = TopologyManager(opts.policy, opts.scope, list(range(opts.numa)), self.log)
        self.manager = self._new_manager()

    def _new_manager(self) -> DeviceManager:
        return DeviceManager(
            self.o.dir, list(range(self.o.numa)), self.log, lambda: list(self.running)
        )

    def say(self, text: str) -> None:
        print(f"dmharness-standin: {text}", flush=True)

    # ---------------------------------------------------------------- phases
    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.agent is not None and self.agent.poll() is None:
                self.agent.kill()
                self.agent.wait()
            self.manager.kill()
            with open(self.o.json, "w", encoding="utf-8") as f:
                json.dump(self.summary(), f, indent=1, sort_keys=True)
            self.log.close()

    def _run(self) -> int:
        os.makedirs(self.o.dir, exist_ok=True)
        if self.o.agent_first is not None:
            self._start_agent()
            time.sleep(self.o.agent_first)
            started = self.manager.start()
        else:
            started = self.manager.start()
            self._start_agent()
        if not self._wait_first_list():
            return self._fail("the agent never registered and listed its devices")
        self.out["managerStartToCapacitySeconds"] = round(time.monotonic() - started, 3)
        for i, size in enumerate(self.o.sizes, 1):
            self._admit(Pod(self._uid(), f"p{i}-gpu{size}", self.o.resource, size), "new")
        for rejected in [p for p in self.pods if p["phase"] == "new" and not p["admit"]]:
            if not self.running:
                break
            ended = self.running.pop(0)
            self.say(f"pod {ended.name} ended")
            self._admit(
                Pod(self._uid(), rejected["pod"], self.o.resource, rejected["request"]),
                f"retry-after-{ended.name}-ended",
            )
        if not self._restart():
            return self._fail("the agent did not come back after the kubelet restart")
        if not self._sigterm():
            return self._fail("the agent did not exit after SIGTERM")
        return 0

    def _fail(self, why: str) -> int:
        self.say(f"FAILED: {why}")
        self.out["error"] = why
        return 1

    def _uid(self) -> str:
        return f"00000000-0000-0000-0000-{next(self._uids):012d}"

    def _start_agent(self) -> None:
        argv = [a.replace("{DIR}", self.o.dir) for a in self.o.agent]
        out = open(self.o.log + ".agent", "ab")  # noqa: SIM115 (the agent holds it)
        self.agent = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.say(f"agent started: {' '.join(argv)}")

    def _wait_first_list(self) -> bool:
        m, r = self.manager, self.o.resource
        if not m.wait(lambda: bool(m.lists.get(r)), self.o.timeout):
            return False
        healthy, unhealthy = m.lists[r][0]
        self.out["endpointAfterRegistration"] = {"Healthy": healthy, "Unhealthy": unhealthy}
        self.out["capacity"], self.out["allocatable"] = m.capacity(r)
        with m.lock:
            options = m.endpoints[r].options
            self.out["allocatableDeviceNUMA"] = {
                d: m.all_devices[r][d] for d in sorted(m.healthy[r])
            }
        assert options is not None
        self.out["pluginOptions"] = {
            "preStartRequired": options.pre_start_required,
            "getPreferredAllocationAvailable": options.get_preferred_allocation_available,
        }
        self.say(f"{r}: capacity {self.out['capacity']}, allocatable {self.out['allocatable']}")
        return True

    def _admit(self, pod: Pod, phase: str, *, keep_running: bool = False) -> None:
        m = self.manager
        m.preferred_seen = []
        hint = Hint(None, False)
        admit, reason, message = True, "", ""
        if self.o.policy != "none":
            hint, admit = self.topology.merge([m.topology_hints(pod)])
            self.log.info("scope.go", "Best TopologyHint", bestHint=hint.text(), pod=pod.name)
            if not admit:
                reason, message = (
                    "TopologyAffinityError",
                    "Resources cannot be allocated with Topology locality",
                )
        if admit:
            self.topology.store[(pod.uid, CONTAINER)] = hint
            error = m.allocate(pod, hint)
            m.pending = None
            if error is not None:
                admit, reason, message = (
                    False,
                    "UnexpectedAdmissionError",
                    f"Allocate failed due to {error}, which is unexpected",
                )
        entry: dict[str, Any] = {
            "pod": pod.name,
            "uid": pod.uid,
            "phase": phase,
            "request": pod.request,
            "admit": admit,
            "affinity": hint.text(),
            "pluginPreferredReconstructed": list(m.preferred_seen),
        }
        if admit:
            if not keep_running:
                self.running.append(pod)
                entry["preStartDevices"] = m.pre_start(pod)
            devices = m.devices_of(pod)
            with m.lock:
                numa = sorted(
                    {n for d in devices for n in m.all_devices[pod.resource].get(d) or []}
                )
            entry.update(devices=devices, numaSet=numa, **m.run_options(pod))
        else:
            entry.update(devices=[], numaSet=[], reason=reason, message=message)
        self.pods.append(entry)
        self.say(
            f"{phase} {pod.name}: {'admitted ' + ','.join(entry['devices']) if admit else 'rejected: ' + message}"
        )

    def _restart(self) -> bool:
        before = {p.uid: self.manager.devices_of(p) for p in self.running}
        capacity_before = (self.out["capacity"], self.out["allocatable"])
        self.manager.kill()
        self.say("kubelet restart")
        self.manager = self._new_manager()
        m, r = self.manager, self.o.resource
        started = m.start()
        registered = m.wait(lambda: any(res == r for res, _ in m.registrations), self.o.timeout)
        back = registered and m.wait(
            lambda: bool(m.lists.get(r)) and m.capacity(r) == capacity_before, self.o.timeout
        )
        restored = {p.uid: m.devices_of(p) for p in self.running}
        mismatches = [
            f"{p.name}: {before[p.uid]} before, {restored[p.uid]} restored"
            for p in self.running
            if restored[p.uid] != before[p.uid]
        ]
        self.out["restart"] = {
            "registrationSeconds": round(
                next((t for res, t in m.registrations if res == r), float("inf")) - started, 3
            )
            if registered
            else None,
            "capacityBackOK": back,
            "capacityAfter": list(m.capacity(r)),
            "podsRestoredFromCheckpoint": f"{len(self.running) - len(mismatches)}/{len(self.running)}",
            "mismatches": mismatches,
        }
        if not back:
            return False
        for pod in list(self.running):  # the restarted kubelet admits the pods it finds running
            self._admit(pod, "after-kubelet-restart", keep_running=True)
        return True

    def _sigterm(self) -> bool:
        assert self.agent is not None
        m, r = self.manager, self.o.resource
        sent = time.monotonic()
        self.agent.send_signal(signal.SIGTERM)
        zero = m.wait(lambda: m.capacity(r)[1] == 0, self.o.timeout)
        zero_s = time.monotonic() - sent
        try:
            code = self.agent.wait(self.o.timeout)
            exit_text = (
                f"exit {code} after {time.monotonic() - sent:.2f}s"
                if code >= 0
                else f"signal {-code}"
            )
        except subprocess.TimeoutExpired:
            exit_text = f"still running {self.o.timeout:.0f}s after SIGTERM"
        self.out["sigterm"] = {
            "allocatableZeroOK": zero,
            "allocatableZeroSeconds": round(zero_s, 3),
            "agentExit": exit_text,
            "dirAfterExit": sorted(os.listdir(self.o.dir)),
        }
        return exit_text.startswith("exit ")

    def summary(self) -> dict[str, Any]:
        """The JSON summary: ``capacity``/``allocatable`` and ``endpointAfterRegistration``
        (``Healthy``/``Unhealthy`` device IDs) from the first device list of ``-resource``;
        ``allocatableDeviceNUMA`` (healthy device -> its TopologyInfo NUMA nodes, [] for none);
        ``managerStartToCapacitySeconds``; ``pods`` (one entry per admission, in order: ``pod``,
        ``phase`` (``new``, ``retry-after-<pod>-ended``, ``after-kubelet-restart``),
        ``request``, ``admit``, ``reason``/``message`` when refused, ``affinity`` (the
        topology manager's hint, :meth:`Hint.text`), ``devices``, ``numaSet`` (the devices' NUMA
        nodes), ``pluginPreferredReconstructed`` (what GetPreferredAllocation answered during
        this admission), and the container's ``envs``, ``mounts`` (``HOST->CONTAINER
        ro=BOOL``), ``deviceNodes`` (``HOST->CONTAINER PERMISSIONS``), ``annotations``,
        ``cdiDevices``); ``restart`` (``registrationSeconds``, ``capacityBackOK``,
        ``podsRestoredFromCheckpoint`` ``n/m``, ``mismatches``); ``sigterm``
        (``allocatableZeroOK``, ``allocatableZeroSeconds``, ``agentExit`` ``exit N after
        Xs``, ``dirAfterExit``); ``managerWarningsAndErrors`` (the W and E lines of ``-log``)."""
        return {**self.out, "pods": self.pods, "managerWarningsAndErrors": list(self.log.problems)}


def parse(argv: list[str]) -> Options:
    if "--" not in argv:
        raise SystemExit(
            "usage: dmharness_standin.py -dir DIR -log FILE -json FILE [...] -- AGENT ARGS"
        )
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="dmharness_standin.py")
    parser.add_argument("-dir", required=True)
    parser.add_argument("-log", required=True)
    parser.add_argument("-json", required=True)
    parser.add_argument(
        "-policy", default="none", choices=["none", "best-effort", "restricted", "single-numa-node"]
    )
    parser.add_argument("-scope", default="container", choices=["container", "pod"])
    parser.add_argument("-numa", type=int, default=1)
    parser.add_argument("-sizes", default="1")
    parser.add_argument("-resource", default="nvidia.com/gpu")
    parser.add_argument("-timeout", type=_duration, default=20.0)
    parser.add_argument("-agent-first", dest="agent_first", type=_duration, default=None)
    a = parser.parse_args(argv[:cut])
    agent = argv[cut + 1 :]
    if not agent:
        parser.error("no agent command after --")
    if not 1 <= a.numa <= 8:
        parser.error("-numa: 1 to 8 NUMA nodes (the topology manager refuses more than 8)")
    return Options(
        a.dir,
        a.log,
        a.json,
        a.policy,
        a.scope,
        a.numa,
        [int(s) for s in a.sizes.split(",")],
        a.resource,
        a.timeout,
        a.agent_first,
        agent,
    )


def main(argv: list[str] | None = None) -> int:
    return Session(parse(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
