"""Discovery through NVML: :func:`read_node_facts` reads the node's :class:`NodeFacts` from
NVML (every call through the wrapper, :meth:`agent.hw.nvml.calls.NvmlCalls.call`, never
``pynvml`` itself) and sysfs.

From NVML: count, UUID, name, memory, PCI bus id, minor number, compute capability, compute
mode, MIG mode, MIG geometry and MIG devices (with their placements; :mod:`agent.hw.nvml.mig`),
every NVLink's state and remote end, the common-ancestor PCIe level of each GPU pair, P2P
NVLink status, GPU fabric info, driver and CUDA driver versions. From sysfs (when a
:class:`SysfsReader` is given): NUMA node and local cpulist of each GPU, NUMA distances and
cpulists, RDMA NICs and their PCIe level to each GPU, the DMI product name.

NVSwitch systems: a link whose remote end is an NVSwitch makes every pair of switch-attached
GPUs (in one fabric clique, P2P-capable over NVLink) NVLinked with the smaller of their
switch-link counts, ``Link.nvswitch=True``.

Size: above 400 lines because it is one discovery pass: the GPUs, their MIG devices, fabric and
placement, the NICs and the links all share the pass's handles, sysfs reader and notes.
"""

from __future__ import annotations

import ctypes
import uuid as uuid_mod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.formats import BusIdError, format_cpulist, parse_cpulist, sysfs_to_nvml_bus_id
from agent.hw.nvml.calls import NvmlCalls
from agent.hw.nvml.mig import gi_placement, read_geometry
from agent.records import COMPUTE_MODES, Gpu, Link, MigDevice, Nic, NodeFacts, PcieLevel

if TYPE_CHECKING:  # pragma: no cover
    from agent.hw.sysfs import NumaNode, SysfsReader

_MIB = 1 << 20


def text_of(value: object) -> str:
    """pynvml returns ``str`` or ``bytes`` depending on its version and the field."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _nvml_bus_id(value: object) -> str:
    """NVML's bus-id spelling (``00000000:3B:00.0``) of whatever NVML returned."""
    text = text_of(value).strip()
    try:
        return sysfs_to_nvml_bus_id(text)
    except BusIdError:
        return text.upper()


def _cpus(cpulist: str) -> set[int]:
    try:
        return set(parse_cpulist(cpulist))
    except ValueError:
        return set()


def _cpulist_from_words(words: Iterable[int]) -> str:
    """``[0xF000F, 0]`` (64-bit affinity words) -> ``"0-3,16-19"``."""
    return format_cpulist(
        w_i * 64 + bit for w_i, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1
    )


#: the NVML_BRAND_* constants (pynvml 12-13), matched against the library in use
_BRANDS = (
    "QUADRO", "TESLA", "NVS", "GRID", "GEFORCE", "TITAN", "NVIDIA_VAPPS", "NVIDIA_VPC",
    "NVIDIA_VCS", "NVIDIA_VWS", "NVIDIA_CLOUD_GAMING", "NVIDIA_VGAMING", "QUADRO_RTX",
    "NVIDIA_RTX", "NVIDIA", "GEFORCE_RTX", "TITAN_RTX", "NVIDIA_DLA", "NVIDIA_VGAMEDEV", "NVIDIA_NPU",
)
#: nvidia-smi's spelling of the words in NVML_BRAND_* names that are not plain capitals
_BRAND_WORDS = {"TESLA": "Tesla", "QUADRO": "Quadro", "GEFORCE": "GeForce", "TITAN": "Titan"}


def brand_display_name(constant_suffix: str) -> str:
    """``"GEFORCE_RTX"`` (from ``NVML_BRAND_GEFORCE_RTX``) -> ``"GeForce RTX"``."""
    return " ".join(_BRAND_WORDS.get(w, w) for w in constant_suffix.split("_"))


def mig_memory_gb(parent_total_bytes: int, mig_memory_mib: int) -> int:
    """The ``<N>gb`` of a MIG profile name, computed as NVIDIA's device plugin (go-nvlib)
    does: the MIG memory's fraction of the GPU rounded up to eighths, times the GPU's
    memory in whole GB."""
    one_gb = 1 << 30
    if parent_total_bytes <= 0:
        return round(mig_memory_mib / 1024)
    fraction = mig_memory_mib * _MIB / parent_total_bytes
    fraction = -(-fraction * 8 // 1) / 8  # ceil to eighths
    total_gb = (parent_total_bytes + one_gb - 1) // one_gb
    return int(round(fraction * total_gb))


def read_node_facts(
    backend: NvmlCalls, sysfs: SysfsReader | None, source: str = "nvml"
) -> NodeFacts:
    """Discover the node (module docstring), as read. GPUs lost while being read are
    returned with ``lost=True`` and whatever was read before; the others are complete."""
    reader = _FactsReader(backend, sysfs)
    notes = reader.notes
    n = backend.device_count()
    driver = backend.call("nvmlSystemGetDriverVersion")
    cuda = backend.call("nvmlSystemGetCudaDriverVersion_v2")
    if cuda is None:
        cuda = backend.call("nvmlSystemGetCudaDriverVersion")
    read = [reader.gpu(index) for index in range(n)]
    gpus = [gpu for gpu, _ in read]
    links = reader.links(gpus, [h for _, h in read])
    lost = sorted(g.index for g in gpus if g.lost)
    if lost:
        notes.append(f"GPUs lost during discovery (partly read): {lost}")
    numa_nodes = reader.numa_nodes
    return NodeFacts(
        gpus=tuple(gpus),
        links=tuple(links),
        nics=tuple(reader.nics(gpus)),
        numa_distances={k: tuple(v.distances) for k, v in numa_nodes.items()},
        numa_cpulists={k: v.cpulist for k, v in numa_nodes.items()},
        driver_version=text_of(driver) if driver is not None else None,
        cuda_driver_version=f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else None,
        machine=sysfs.product_name() if sysfs is not None else None,
        source=source,
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class _Identity:
    """What NVML says of one GPU before its placement: read first, so a GPU lost half-way
    is still known by UUID and bus id."""

    uuid: Any
    name: Any
    memory: Any
    minor: Any
    cc: Any
    brand: Any
    bus_id: str
    compute_mode: Any


class _FactsReader:
    """One discovery pass: the backend, the sysfs reader and the notes gathered."""

    def __init__(self, backend: NvmlCalls, sysfs: SysfsReader | None) -> None:
        self.backend = backend
        self.sysfs = sysfs
        self.numa_nodes: Mapping[int, NumaNode] = sysfs.numa_nodes() if sysfs is not None else {}
        self.notes: list[str] = []

    # ------------------------------------------------------------------ one GPU
    def gpu(self, index: int) -> tuple[Gpu, Any]:
        """GPU ``index`` and its handle (None if lost)."""
        b = self.backend
        h = b.handle(index)
        ident = self._identity(index, h)
        total_bytes = int(ident.memory.total) if ident.memory is not None else 0
        mig_capable, mig_enabled = self._mig_mode(index, h)
        mig_devices = self._read_mig(index, h, total_bytes) if mig_enabled else ()
        geometry = read_geometry(b, index, h) if mig_capable and index not in b.lost_gpus else None
        cluster, clique = self._read_fabric(index, h)
        numa, cpulist, pci_class = self._placement(index, h, ident.bus_id)
        lost = index in b.lost_gpus
        uuid = ident.uuid
        if uuid is None:
            uuid = f"GPU-unknown-{index}"
            self.notes.append(f"GPU {index}: UUID unknown (GPU lost), shown as {uuid}")
        gpu = Gpu(
            index=index,
            uuid=text_of(uuid),
            name=text_of(ident.name) if ident.name is not None else "unknown",
            brand=self._brand_name(ident.brand),
            memory_mib=total_bytes // _MIB if ident.memory is not None else None,
            pci_bus_id=ident.bus_id,
            minor_number=int(ident.minor) if ident.minor is not None else None,
            compute_capability=(int(ident.cc[0]), int(ident.cc[1])) if ident.cc is not None else None,
            mig_enabled=mig_enabled,
            mig_capable=mig_capable,
            mig_devices=mig_devices,
            mig_geometry=geometry,
            numa_node=numa,
            cpu_affinity=cpulist,
            pci_class=pci_class,
            pcie_root=(
                self.sysfs.pcie_root(ident.bus_id) if self.sysfs is not None and ident.bus_id else None
            ),
            fabric_cluster_uuid=cluster,
            fabric_clique_id=clique,
            lost=lost,
            compute_mode=(
                COMPUTE_MODES.get(int(ident.compute_mode)) if ident.compute_mode is not None else None
            ),
        )
        return gpu, (None if lost else h)

    def _brand_name(self, value: Any) -> str | None:
        """NVML's brand constant as nvidia-smi spells it ("NVIDIA", "Tesla", "GeForce RTX");
        None where NVML does not say or the constant is one this pynvml does not name."""
        if value is None:
            return None
        for suffix in _BRANDS:
            if self.backend.const(f"NVML_BRAND_{suffix}", None) == int(value):
                return brand_display_name(suffix)
        return None

    def _identity(self, index: int, h: Any) -> _Identity:
        def ask(function: str) -> Any:
            return self.backend.call(function, h, gpu=index) if h is not None else None

        uuid = ask("nvmlDeviceGetUUID")
        pci = ask("nvmlDeviceGetPciInfo")
        return _Identity(
            uuid=uuid,
            name=ask("nvmlDeviceGetName"),
            memory=ask("nvmlDeviceGetMemoryInfo"),
            minor=ask("nvmlDeviceGetMinorNumber"),
            cc=ask("nvmlDeviceGetCudaComputeCapability"),
            brand=ask("nvmlDeviceGetBrand"),
            bus_id=_nvml_bus_id(pci.busId) if pci is not None else "",
            compute_mode=ask("nvmlDeviceGetComputeMode"),
        )

    def _mig_mode(self, index: int, h: Any) -> tuple[bool | None, bool]:
        """(MIG capable, MIG enabled). GetMigMode answers on MIG-capable GPUs and is
        NotSupported (None) elsewhere; a driver without the function says nothing."""
        if h is None:
            return None, False
        b = self.backend
        mode = b.call("nvmlDeviceGetMigMode", h, gpu=index)
        capable: bool | None = mode is not None
        if mode is None and "nvmlDeviceGetMigMode" in b.missing_functions:
            capable = None
        enabled = mode is not None and int(mode[0]) == b.const("NVML_DEVICE_MIG_ENABLE")
        return capable, enabled

    def _placement(
        self, index: int, h: Any, bus_id: str
    ) -> tuple[int | None, str | None, int | None]:
        """(NUMA node, local cpulist, PCI class): sysfs first, then NVML's CPU affinity
        (a NUMA node inferred from it where one node holds those CPUs), then NVML's NUMA
        node id on a machine without NUMA nodes in sysfs."""
        numa: int | None = None
        cpulist: str | None = None
        pci_class: int | None = None
        if self.sysfs is not None and bus_id:
            numa = self.sysfs.pci_numa_node(bus_id)
            cpulist = self.sysfs.pci_local_cpulist(bus_id)
            pci_class = self.sysfs.pci_class(bus_id)
        if cpulist is None and h is not None:
            words = self.backend.call(
                "nvmlDeviceGetCpuAffinity", h, max(1, -(-self._cpu_count() // 64)), gpu=index
            )
            if words is not None:
                cpulist = _cpulist_from_words(words) or None
        if numa is None and cpulist and self.numa_nodes:
            mine = _cpus(cpulist)
            matches = [
                k for k, node in self.numa_nodes.items() if mine and mine <= _cpus(node.cpulist)
            ]
            if len(matches) == 1:
                numa = matches[0]
                self.notes.append(f"GPU {index}: NUMA node {numa} inferred from its CPU affinity")
        if numa is None and h is not None and not self.numa_nodes:
            numa = self.backend.call("nvmlDeviceGetNumaNodeId", h, gpu=index)
            if numa is not None:
                self.notes.append(f"GPU {index}: NUMA node {numa} from nvmlDeviceGetNumaNodeId")
        return numa, cpulist, pci_class

    def _cpu_count(self) -> int:
        highest = 0
        for node in self.numa_nodes.values():
            cpus = _cpus(node.cpulist)
            if cpus:
                highest = max(highest, max(cpus) + 1)
        return max(highest, 1024)

    def _read_mig(self, index: int, h: Any, total_bytes: int) -> tuple[MigDevice, ...]:
        b = self.backend
        count = b.call("nvmlDeviceGetMaxMigDeviceCount", h, gpu=index) or 0
        not_found = (b.const("NVML_ERROR_NOT_FOUND"), b.const("NVML_ERROR_INVALID_ARGUMENT"))
        out: list[MigDevice] = []
        for slot in range(int(count)):
            mh = b.call("nvmlDeviceGetMigDeviceHandleByIndex", h, slot, gpu=index, absent=not_found)
            if mh is None:
                continue
            uuid = b.call("nvmlDeviceGetUUID", mh, gpu=index)
            attrs = b.call("nvmlDeviceGetAttributes", mh, gpu=index)
            if uuid is None or attrs is None:
                continue
            gi = b.call("nvmlDeviceGetGpuInstanceId", mh, gpu=index)
            ci = b.call("nvmlDeviceGetComputeInstanceId", mh, gpu=index)
            where = gi_placement(b, index, h, int(gi)) if gi is not None else None
            gi_slices = int(attrs.gpuInstanceSliceCount)
            ci_slices = int(attrs.computeInstanceSliceCount)
            memory_mib = int(attrs.memorySizeMB)
            base = f"{gi_slices}g.{mig_memory_gb(total_bytes, memory_mib)}gb"
            out.append(
                MigDevice(
                    uuid=text_of(uuid),
                    parent_index=index,
                    index=slot,
                    profile=base if ci_slices == gi_slices else f"{ci_slices}c.{base}",
                    memory_mib=memory_mib,
                    gi_id=int(gi) if gi is not None else None,
                    ci_id=int(ci) if ci is not None else None,
                    placement=where[0] if where is not None else None,
                    profile_id=where[1] if where is not None else None,
                )
            )
        return tuple(out)

    def _read_fabric(self, index: int, h: Any) -> tuple[str | None, int | None]:
        if h is None:
            return None, None
        b = self.backend
        info: Any = None
        if b.has("nvmlDeviceGetGpuFabricInfoV") and b.has("c_nvmlGpuFabricInfoV_t"):
            info = b.const("c_nvmlGpuFabricInfoV_t")()
            info.version = b.const("nvmlGpuFabricInfo_v2")
            if b.call("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info), gpu=index) is None:
                info = None
        elif b.has("nvmlDeviceGetGpuFabricInfo") and b.has("c_nvmlGpuFabricInfo_t"):
            info = b.const("c_nvmlGpuFabricInfo_t")()
            if b.call("nvmlDeviceGetGpuFabricInfo", h, ctypes.byref(info), gpu=index) is None:
                info = None
        if info is None:
            return None, None
        if int(info.state) != b.const("NVML_GPU_FABRIC_STATE_COMPLETED") or int(
            info.status
        ) != b.const("NVML_SUCCESS"):
            return None, None
        raw = bytes(bytearray(info.clusterUuid))
        cluster = str(uuid_mod.UUID(bytes=raw)) if any(raw) else None
        return cluster, int(info.cliqueId)

    # ------------------------------------------------------------------ NICs
    def nics(self, gpus: Sequence[Gpu]) -> list[Nic]:
        """The RDMA NICs sysfs lists, with their PCIe level to each GPU."""
        sysfs = self.sysfs
        if sysfs is None:
            return []
        out: list[Nic] = []
        for nic in sysfs.rdma_nics():
            levels = tuple(
                sysfs.pcie_level(nic.pci_bus_id, g.pci_bus_id)
                if nic.pci_bus_id and g.pci_bus_id
                else None
                for g in gpus
            )
            root = sysfs.pcie_root(nic.pci_bus_id) if nic.pci_bus_id else None
            out.append(Nic(nic.name, nic.pci_bus_id, nic.numa_node, levels, pcie_root=root))
        return out

    # ------------------------------------------------------------------ links
    def links(self, gpus: Sequence[Gpu], handles: Sequence[Any]) -> list[Link]:
        """Every GPU pair with NVLinks or a known PCIe level."""
        direct, switch_links = self._scan_nvlinks(gpus, handles)
        links: list[Link] = []
        for a in range(len(gpus)):
            for b in range(a + 1, len(gpus)):
                link = self._pair(gpus, handles, a, b, direct, switch_links)
                if link is not None:
                    links.append(link)
        if any(switch_links):
            self.notes.append(
                "NVSwitch: every pair of switch-attached GPUs counts the smaller of their "
                "switch-link counts as NVLinks"
            )
        return links

    def _scan_nvlinks(
        self, gpus: Sequence[Gpu], handles: Sequence[Any]
    ) -> tuple[dict[tuple[int, int], int], list[int]]:
        """Active NVLinks: per ordered GPU pair the direct ones, per GPU those to switches."""
        b = self.backend
        by_bus = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
        direct: dict[tuple[int, int], int] = {}
        switch_links = [0] * len(gpus)
        gpu_type = b.const("NVML_NVLINK_DEVICE_TYPE_GPU", 0)
        switch_type = b.const("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        enabled = b.const("NVML_FEATURE_ENABLED", 1)
        invalid = (b.const("NVML_ERROR_INVALID_ARGUMENT"),)
        for i, h in enumerate(handles):
            if h is None:
                continue
            for link in range(int(b.const("NVML_NVLINK_MAX_LINKS", 18))):
                state = b.call("nvmlDeviceGetNvLinkState", h, link, gpu=i, absent=invalid)
                if state is None or int(state) != enabled:
                    continue
                kind = b.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, gpu=i)
                remote = b.call("nvmlDeviceGetNvLinkRemotePciInfo", h, link, gpu=i)
                remote_gpu = by_bus.get(_nvml_bus_id(remote.busId)) if remote is not None else None
                if kind is not None and int(kind) == switch_type:
                    switch_links[i] += 1
                elif remote_gpu not in (None, i) and (kind is None or int(kind) == gpu_type):
                    assert remote_gpu is not None
                    direct[(i, remote_gpu)] = direct.get((i, remote_gpu), 0) + 1
                elif kind is None and remote is not None and remote_gpu is None:
                    # drivers without RemoteDeviceType: a remote end that is no GPU is a switch
                    switch_links[i] += 1
        return direct, switch_links

    def _pair(
        self,
        gpus: Sequence[Gpu],
        handles: Sequence[Any],
        a: int,
        b: int,
        direct: Mapping[tuple[int, int], int],
        switch_links: Sequence[int],
    ) -> Link | None:
        backend = self.backend
        ha, hb = handles[a], handles[b]
        level: PcieLevel | None = None
        if ha is not None and hb is not None:
            raw = backend.call("nvmlDeviceGetTopologyCommonAncestor", ha, hb, gpu=a)
            if raw is not None and int(raw) in PcieLevel._value2member_map_:
                level = PcieLevel(int(raw))
        if level is None and self.sysfs is not None and gpus[a].pci_bus_id and gpus[b].pci_bus_id:
            level = self.sysfs.pcie_level(gpus[a].pci_bus_id, gpus[b].pci_bus_id)
        count = max(direct.get((a, b), 0), direct.get((b, a), 0))
        via_switch = False
        if switch_links[a] and switch_links[b] and _same_fabric(gpus[a], gpus[b]):
            nvlink_cap = backend.const("NVML_P2P_CAPS_INDEX_NVLINK", 2)
            status = backend.call("nvmlDeviceGetP2PStatus", ha, hb, nvlink_cap, gpu=a)
            if status is None or int(status) == backend.const("NVML_P2P_STATUS_OK", 0):
                count += min(switch_links[a], switch_links[b])
                via_switch = True
        if count or level is not None:
            return Link(a, b, count, level, via_switch)
        return None


def _same_fabric(a: Gpu, b: Gpu) -> bool:
    if a.fabric_clique_id is None or b.fabric_clique_id is None:
        return True
    return (a.fabric_cluster_uuid, a.fabric_clique_id) == (
        b.fabric_cluster_uuid,
        b.fabric_clique_id,
    )
