"""Helpers for the metrics tests (no tests here).

- :class:`StandInBackend`: the ``NvmlBackend`` interface of contract (2) (``call``,
  ``handle``, ``const``, ``lost_gpus``, ``error_counts``) over per-GPU values, answering
  with pynvml's own return types (ctypes structs from the real ``pynvml`` module). It lets
  the sampler and collector be tested field by field; the end-to-end tests use the real
  ``NvmlBackend`` on ``agent.hw.sim.nvml.FakeNvml`` where that is available.
- :class:`PodResourcesStandIn`: a kubelet pod-resources v1 server on a unix socket,
  serving whatever ``List`` answer the test sets.
"""

from __future__ import annotations

import re
import threading
from concurrent import futures
from typing import Any

import grpc
import pynvml

from agent._proto import podresources_v1_pb2 as pb
from agent._proto import podresources_v1_pb2_grpc as pb_grpc
from agent.errors import AgentError
from agent.topology.model import Gpu, Link, MigDevice, Nic, PcieLevel, Topology


class StandInNvmlError(AgentError):
    """What NvmlBackend.call raises for an NVML failure other than NotSupported/lost."""


class StandInBackend:
    def __init__(self, gpu_count: int, gpm: bool = True) -> None:
        self.gpu_count = gpu_count
        self.gpm = gpm
        self.lost_gpus: set[int] = set()
        self.error_counts: dict[str, int] = {}
        self.unsupported: set[tuple[str, int | None]] = set()
        self.failing: set[tuple[str, int | None]] = set()
        self.calls = 0
        self.values: dict[int, dict[str, float]] = {
            i: {"util": 40.0 + i, "temp": 50.0 + i, "power_mw": 300000.0 + i * 1000,
                "energy_mj": 1_000_000.0 * (i + 1)}
            for i in range(gpu_count)
        }
        self._lock = threading.Lock()

    # contract (2) surface
    def handle(self, index: int) -> Any:
        if not 0 <= index < self.gpu_count:
            raise AgentError(f"no GPU {index}")
        return ("handle", index)

    def const(self, name: str) -> Any:
        return getattr(pynvml, name)

    def call(self, function: str, *args: Any, gpu: int | None = None) -> Any:
        with self._lock:
            self.calls += 1
        if gpu in self.lost_gpus:
            return None
        if (function, None) in self.unsupported or (function, gpu) in self.unsupported:
            return None
        if (function, None) in self.failing or (function, gpu) in self.failing:
            self.error_counts[function] = self.error_counts.get(function, 0) + 1
            raise StandInNvmlError(f"{function}: Unknown Error")
        return getattr(self, "_" + function)(gpu, *args)

    def set_value(self, index: int, key: str, value: float) -> None:
        self.values[index][key] = value

    # pynvml functions, pynvml's shapes
    def _nvmlDeviceGetClockInfo(self, gpu, h, clock_type):
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[clock_type]

    def _nvmlDeviceGetTemperature(self, gpu, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self.values[gpu]["temp"])

    def _nvmlDeviceGetPowerUsage(self, gpu, h):
        return int(self.values[gpu]["power_mw"])

    def _nvmlDeviceGetTotalEnergyConsumption(self, gpu, h):
        self.values[gpu]["energy_mj"] += 1000
        return int(self.values[gpu]["energy_mj"])

    def _nvmlDeviceGetPcieReplayCounter(self, gpu, h):
        return 3

    def _nvmlDeviceGetUtilizationRates(self, gpu, h):
        u = pynvml.c_nvmlUtilization_t()
        u.gpu = int(self.values[gpu]["util"])
        u.memory = 12
        return u

    def _nvmlDeviceGetEncoderUtilization(self, gpu, h):
        return [0, 167000]

    def _nvmlDeviceGetDecoderUtilization(self, gpu, h):
        return [5, 167000]

    def _nvmlDeviceGetMemoryInfo(self, gpu, h, version=None):
        total = 80 * 1024 << 20
        if version:
            m = pynvml.c_nvmlMemory_v2_t()
            m.version = version
            m.reserved = 512 << 20
        else:
            m = pynvml.c_nvmlMemory_t()
        m.total = total
        m.used = 1024 << 20
        m.free = total - m.used - (512 << 20 if version else 0)
        return m

    def _nvmlDeviceGetFieldValues(self, gpu, h, ids):
        arr = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for k, fid in enumerate(ids):
            arr[k].fieldId = fid
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                arr[k].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                arr[k].value.uiVal = 45
            elif fid == pynvml.NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL:
                arr[k].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                arr[k].value.ullVal = 123456789
            else:
                arr[k].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return arr

    def _nvmlDeviceGetRemappedRows(self, gpu, h):
        return (2, 1, 0, 0)

    def _nvmlDeviceGetTotalEccErrors(self, gpu, h, error_type, counter_type):
        return 7 if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def _nvmlDeviceGetPcieThroughput(self, gpu, h, counter):
        return 1000 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 2000

    def _nvmlGpmQueryDeviceSupport(self, gpu, h):
        s = pynvml.c_nvmlGpmSupport_t()
        s.isSupportedDevice = 1 if self.gpm else 0
        return s

    def _nvmlGpmSampleAlloc(self, gpu):
        return pynvml.c_nvmlGpmSample_t()

    def _nvmlGpmSampleGet(self, gpu, h, sample):
        return sample

    def _nvmlGpmSampleFree(self, gpu, sample):
        return None

    def _nvmlGpmMetricsGet(self, gpu, request):
        per = {pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 60.0,
               pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 25.0,
               pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 10.0,
               pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 3.0,
               pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 4.0}
        for k in range(request.numMetrics):
            request.metrics[k].value = per[request.metrics[k].metricId]
            request.metrics[k].nvmlReturn = 0
        return request


# ---------------------------------------------------------------------- topologies
def small_topology(n: int = 4, name: str = "NVIDIA H100 80GB HBM3") -> Topology:
    """``n`` GPUs: NVLinked in pairs (0-1, 2-3, ...), two per NUMA node, one NIC per pair."""
    gpus = [
        Gpu(i, f"GPU-{i:08x}-aaaa-bbbb-cccc-000000000000", name, memory_mib=81559,
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", minor_number=i,
            compute_capability=(9, 0), numa_node=i // 2,
            mig_devices=(MigDevice(f"MIG-{i:04x}-0000-0000-0000-000000000000", i, 0, "1g.10gb",
                                   9856),) if i == n - 1 else (),
            mig_enabled=i == n - 1)
        for i in range(n)
    ]
    links = [Link(a, b, nvlinks=4 if a // 2 == b // 2 else 0,
                  pcie=PcieLevel.PIX if a // 2 == b // 2 else PcieLevel.SYS)
             for a in range(n) for b in range(a + 1, n)]
    nics = tuple(
        Nic(f"mlx5_{k}", numa_node=k,
            levels=tuple(PcieLevel.PIX if g // 2 == k else PcieLevel.SYS for g in range(n)))
        for k in range(n // 2)
    )
    return Topology.build(gpus, links, nics=nics, driver_version="550.54.15",
                          cuda_driver_version="12.4", machine="Test Box")


# ---------------------------------------------------------------------- pod-resources
def pod(namespace: str, name: str, containers: dict[str, list[tuple[str, list[str]]]]) -> Any:
    """A ``PodResources`` message: container -> [(resource, device ids)]."""
    return pb.PodResources(
        name=name, namespace=namespace,
        containers=[
            pb.ContainerResources(
                name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=ids)
                                 for r, ids in devs])
            for c, devs in containers.items()
        ],
    )


class _Lister(pb_grpc.PodResourcesListerServicer):
    def __init__(self, owner: "PodResourcesStandIn") -> None:
        self.owner = owner

    def List(self, request, context):  # noqa: N802 (gRPC's name)
        with self.owner.lock:
            self.owner.list_calls += 1
            if self.owner.fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
            return pb.ListPodResourcesResponse(pod_resources=list(self.owner.pods))


class PodResourcesStandIn:
    """The kubelet's pod-resources server on ``socket_path`` (a real gRPC server)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: list[Any] = []
        self.fail = False
        self.list_calls = 0
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), self.server)
        self.server.add_insecure_port(f"unix://{socket_path}")

    def __enter__(self) -> "PodResourcesStandIn":
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None).wait(5)


# ---------------------------------------------------------------------- exposition
class Sample:
    def __init__(self, name: str, labels: dict[str, str], value: float) -> None:
        self.name, self.labels, self.value = name, labels, value


_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[Sample]:
    """Sample lines of the text format, names as written (prometheus_client's parser would
    append ``_total`` to dcgm-exporter's counter samples)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        assert m, line
        out.append(Sample(m.group(1), dict(_PAIR.findall(m.group(2) or "")), float(m.group(3))))
    return out


def samples_of(text: str, name: str) -> list[Sample]:
    return [s for s in parse_samples(text) if s.name == name]
