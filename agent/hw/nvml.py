"""The NVML backend: the only module of ours that imports ``pynvml``.

:class:`NvmlBackend` wraps either the real ``pynvml`` module (imported lazily by
:meth:`NvmlBackend.init`) or a module-like fake (:class:`agent.hw.sim.nvml.FakeNvml`). Every NVML
call goes through :meth:`NvmlBackend.call`, which turns NVML's failure modes into ours:

* ``NotSupported`` -> ``None`` (the fact is absent);
* ``GpuIsLost`` -> that GPU is marked lost (:attr:`NvmlBackend.lost_gpus`), ``None``; later
  calls for it return ``None`` without touching NVML until :meth:`NvmlBackend.probe` sees it
  answer again. One failing GPU never takes the others down;
* ``FunctionNotFound`` (an older driver) -> ``None``, logged once per function;
* anything else -> :class:`NvmlError` (exit code 1) with the NVML error chained.

Errors other than NotSupported are counted per function in
:attr:`NvmlBackend.error_counts` (exported as a metric).

NVML missing (no driver, no ``libnvidia-ml.so.1`` in the container): :meth:`init` raises
:class:`NvmlUnavailable` with one clear line. What the agent does then is the
``fail_on_init_error`` setting (the anchor's ``failOnInitError``): exit 1 (True, default), or
log and retry until NVML comes up (False): the daemon's loop (``agent.daemon``) does that.

Discovery (:meth:`read_facts`) reads from NVML: count, UUID, name, memory, PCI bus id,
minor number, compute capability, MIG mode and MIG devices, every NVLink's state and remote
end, the common-ancestor PCIe level of each GPU pair, P2P NVLink status, GPU fabric info,
driver and CUDA driver versions; and from sysfs (when a :class:`SysfsReader` is given): NUMA
node and local cpulist of each GPU, NUMA distances and cpulists, RDMA NICs and their PCIe
level to each GPU, the DMI product name. NVSwitch systems: a link whose remote end is an
NVSwitch makes every pair of switch-attached GPUs (in one fabric clique, P2P-capable over
NVLink) NVLinked with the smaller of their switch-link counts, ``Link.nvswitch=True``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import uuid as uuid_mod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError
from agent.records import Gpu, Link, MigDevice, Nic, NodeFacts, PcieLevel

if TYPE_CHECKING:  # pragma: no cover
    from agent.hw.sysfs import SysfsReader

log = logging.getLogger(__name__)

_MIB = 1 << 20
_MISSING = object()
#: Waits that block: never taken under the library lock.
_BLOCKING = frozenset({"nvmlEventSetWait", "nvmlEventSetWait_v2"})


class NvmlUnavailable(AgentError):
    """NVML cannot be used on this node (library or driver missing, no permission)."""

    exit_code = 1


class NvmlError(AgentError):
    """An NVML call failed in a way we do not translate; the NVML error is ``__cause__``."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        function_name: str | None = None,
        code: int | None = None,
        gpu: int | None = None,
    ) -> None:
        super().__init__(message)
        self.function_name = function_name
        self.code = code
        self.gpu = gpu


@dataclass(frozen=True)
class HealthEvent:
    """Something happened to a GPU: an XID, a double-bit ECC error, or it fell off the bus."""

    gpu_index: int
    kind: str  # "xid" | "ecc_dbe" | "lost"
    xid: int | None = None


def _text(value: object) -> str:
    """pynvml returns ``str`` or ``bytes`` depending on its version and the field."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _nvml_bus_id(value: object) -> str:
    """NVML's bus-id spelling (``00000000:3B:00.0``) of whatever NVML returned."""
    text = _text(value).strip()
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, rest = parts
        try:
            return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{rest.upper()}"
        except ValueError:
            pass
    return text.upper()


def _cpulist_from_words(words: Iterable[int]) -> str:
    """``[0xF000F, 0]`` (64-bit affinity words) -> ``"0-3,16-19"``."""
    cpus = [
        w_i * 64 + bit
        for w_i, word in enumerate(words)
        for bit in range(64)
        if int(word) >> bit & 1
    ]
    parts: list[str] = []
    start = prev = None
    for cpu in cpus + [None]:  # type: ignore[list-item]
        if start is None:
            start = prev = cpu
        elif cpu is not None and cpu == prev + 1:  # type: ignore[operator]
            prev = cpu
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = cpu
    return ",".join(parts)


def _cpus_of(cpulist: str) -> set[int]:
    cpus: set[int] = set()
    for part in cpulist.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return set()
    return cpus


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


class NvmlBackend:
    """NVML (real or fake) behind one wrapper; see the module docstring.

    ``lib``: None for the real ``pynvml`` (imported in :meth:`init`), else a module-like
    object with pynvml's API (the fake). ``sysfs``: where NUMA, cpulists, NICs and the
    product name come from; None means NVML only (no NICs, no NUMA distances).
    Thread-safe: calls are serialised by one lock, except event waits.
    """

    # Locks: ``_call_lock`` serialises NVML calls (held across the call, the only lock held
    # across I/O; nothing but the call runs under it). ``_lock`` guards the bookkeeping
    # (lost GPUs, error counts, handles, the event set) that other threads read, a scrape
    # included, and is never held across an NVML call. Order: ``_lock`` is never taken
    # while ``_call_lock`` is held, and the reverse does not happen either.

    def __init__(self, lib: Any = None, sysfs: SysfsReader | None = None) -> None:
        self._lib: Any = lib
        self._sysfs = sysfs
        self._call_lock = threading.Lock()
        self._lock = threading.RLock()
        self._lost: set[int] = set()
        self._reported_lost: set[int] = set()
        self._errors: dict[str, int] = {}
        self._missing_logged: set[str] = set()
        self._handles: dict[int, Any] = {}
        self._handle_gpu: dict[object, int] = {}
        self._event_set: Any = None
        self._events_registered: set[int] = set()
        self._event_gpus: int | None = None  # GPU count, read once for event registration
        self._initialized = False

    # ------------------------------------------------------------------ state
    @property
    def lost_gpus(self) -> frozenset[int]:
        """Indices of the GPUs NVML answered GPU_IS_LOST for (until a successful probe)."""
        with self._lock:
            return frozenset(self._lost)

    @property
    def error_counts(self) -> dict[str, int]:
        """NVML errors (not NotSupported) by function name, since start; a copy."""
        with self._lock:
            return dict(self._errors)

    @property
    def lib(self) -> Any:
        """The pynvml module (or fake) in use; None before :meth:`init` with the real one."""
        return self._lib

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        """Load and initialise NVML; :class:`NvmlUnavailable` with a clear message if the
        library, the driver or the permission is missing."""
        if self._lib is None:
            try:
                import pynvml
            except ModuleNotFoundError as exc:
                if exc.name != "pynvml":  # pynvml is there but broken: not "not installed"
                    raise
                raise NvmlUnavailable(
                    "NVML is not available: the Python module pynvml (package nvidia-ml-py) "
                    "is not installed"
                ) from None
            self._lib = pynvml
        lib = self._lib
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            raise NvmlUnavailable(self._init_message(exc)) from exc
        except OSError as exc:  # a broken libnvidia-ml.so.1 (wrong architecture, ...)
            raise NvmlUnavailable(
                f"NVML is not available: cannot load libnvidia-ml.so.1: {exc}"
            ) from exc
        self._initialized = True

    def _init_message(self, exc: Any) -> str:
        code = getattr(exc, "value", None)
        reasons = {
            self.const("NVML_ERROR_LIBRARY_NOT_FOUND", 12): (
                "libnvidia-ml.so.1 was not found: no NVIDIA driver on this node, or the "
                "container runs without the NVIDIA runtime / driver libraries mounted"
            ),
            self.const("NVML_ERROR_DRIVER_NOT_LOADED", 9): "the NVIDIA kernel driver is not loaded",
            self.const("NVML_ERROR_NO_PERMISSION", 4): (
                "no permission to open /dev/nvidia*: give the container the NVIDIA runtime "
                "(runtimeClassName: nvidia) or NVIDIA_VISIBLE_DEVICES=all, or run as root"
            ),
            self.const("NVML_ERROR_LIB_RM_VERSION_MISMATCH", 18): (
                "the NVML library and the kernel driver versions differ (driver upgraded "
                "without a reboot?)"
            ),
        }
        reason = reasons.get(code, f"nvmlInit failed: {exc} (NVML error {code})")
        return f"NVML is not available: {reason}"

    def shutdown(self) -> None:
        """Free the event set and shut NVML down; never raises."""
        lib = self._lib
        if lib is None or not self._initialized:
            return
        with self._lock:
            event_set, self._event_set = self._event_set, None
            self._events_registered.clear()
            self._event_gpus = None
            self._handles.clear()
            self._handle_gpu.clear()
            self._initialized = False
        try:
            if event_set is not None:
                lib.nvmlEventSetFree(event_set)
            lib.nvmlShutdown()
        except lib.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)

    # ------------------------------------------------------------------ the wrapper
    def const(self, name: str, default: Any = _MISSING) -> Any:
        """An NVML constant (or struct class) of the library in use, by pynvml name."""
        value = getattr(self._lib, name, _MISSING) if self._lib is not None else _MISSING
        if value is _MISSING:
            if default is not _MISSING:
                return default
            raise NvmlError(f"the NVML library in use has no {name}")
        return value

    @staticmethod
    def _handle_key(handle: object) -> object:
        # Real handles are ctypes pointers (a new Python object per call): key them by address.
        try:
            return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)  # type: ignore[arg-type]
        except (TypeError, ctypes.ArgumentError):
            return ("obj", id(handle))

    def _gpu_of_args(self, args: Sequence[object]) -> int | None:
        if not self._handle_gpu:
            return None
        for arg in args:
            if arg is None or isinstance(arg, (int, float, str, bytes)):
                continue
            gpu = self._handle_gpu.get(self._handle_key(arg))
            if gpu is not None:
                return gpu
        return None

    def call(self, function_name: str, *args: Any, gpu: int | None = None) -> Any:
        """Call ``lib.<function_name>(*args)``, translating NVML errors (module docstring).

        ``gpu`` names the GPU the call is about; when None it is inferred from a device
        handle among ``args`` (handles from :meth:`handle`). Returns the function's result,
        or None where the fact is absent.
        """
        return self._invoke(function_name, args, gpu, ())

    def _invoke(
        self, function_name: str, args: Sequence[Any], gpu: int | None, absent: tuple[int, ...]
    ) -> Any:
        lib = self._lib
        if lib is None:
            raise NvmlError(f"NVML call {function_name} before init()", function_name=function_name)
        if gpu is None:
            gpu = self._gpu_of_args(args)
        if gpu is not None and gpu in self._lost:
            return None
        fn = getattr(lib, function_name, None)
        if fn is None:
            self._function_missing(function_name)
            return None
        try:
            if function_name in _BLOCKING:
                return fn(*args)
            with self._call_lock:
                return fn(*args)
        except lib.NVMLError as exc:
            code = exc.value
            if code == self.const("NVML_ERROR_NOT_SUPPORTED") or code in absent:
                return None
            with self._lock:
                self._errors[function_name] = self._errors.get(function_name, 0) + 1
            if code == self.const("NVML_ERROR_GPU_IS_LOST"):
                if gpu is not None:
                    self._mark_lost(gpu, function_name)
                else:
                    log.error("NVML %s: a GPU is lost", function_name)
                return None
            if code == self.const("NVML_ERROR_FUNCTION_NOT_FOUND"):
                self._function_missing(function_name)
                return None
            where = f" for GPU {gpu}" if gpu is not None else ""
            raise NvmlError(
                f"NVML {function_name}{where} failed: {exc} (NVML error {code})",
                function_name=function_name,
                code=code,
                gpu=gpu,
            ) from exc
        except Exception as exc:
            # pynvml raises NVMLLibraryMismatchError for an unversioned function the driver lacks
            if type(exc).__name__ == "NVMLLibraryMismatchError":
                self._function_missing(function_name)
                return None
            raise

    def _function_missing(self, function_name: str) -> None:
        with self._lock:
            if function_name in self._missing_logged:
                return
            self._missing_logged.add(function_name)
        log.warning(
            "NVML function %s is not available with this driver; its data is skipped", function_name
        )

    def _mark_lost(self, gpu: int, function_name: str) -> None:
        with self._lock:
            if gpu in self._lost:
                return
            self._lost.add(gpu)
        log.error(
            "GPU %d is lost (NVML %s answered GPU_IS_LOST); it is marked unhealthy",
            gpu,
            function_name,
        )

    # ------------------------------------------------------------------ devices
    def device_count(self) -> int:
        """The number of GPUs NVML sees; NvmlError if it cannot say."""
        count = self.call("nvmlDeviceGetCount")
        if count is None:
            raise NvmlError("NVML cannot count the GPUs (nvmlDeviceGetCount not supported)")
        return int(count)

    def handle(self, index: int) -> Any:
        """The (cached) device handle of GPU ``index``; None if the GPU is lost."""
        with self._lock:
            if index in self._handles:
                return self._handles[index]
        h = self.call("nvmlDeviceGetHandleByIndex", index, gpu=index)
        if h is not None:
            with self._lock:
                self._handles[index] = h
                self._handle_gpu[self._handle_key(h)] = index
        return h

    def probe(self, index: int) -> bool:
        """Whether GPU ``index`` answers NVML normally right now. A lost GPU that answers is
        no longer lost (its handle and event registration are renewed)."""
        lib = self._lib
        if lib is None:
            return False
        was_lost = index in self._lost
        with self._lock:
            h = self._handles.get(index)
        try:
            with self._call_lock:
                if h is None or was_lost:
                    h = lib.nvmlDeviceGetHandleByIndex(index)
                lib.nvmlDeviceGetUUID(h)
        except lib.NVMLError as exc:
            with self._lock:
                self._errors["nvmlDeviceGetUUID"] = self._errors.get("nvmlDeviceGetUUID", 0) + 1
            if exc.value == self.const("NVML_ERROR_GPU_IS_LOST"):
                self._mark_lost(index, "nvmlDeviceGetUUID")
            return False
        with self._lock:
            self._handles[index] = h
            self._handle_gpu[self._handle_key(h)] = index
            if was_lost:
                self._lost.discard(index)
                self._reported_lost.discard(index)
                self._events_registered.discard(index)
        if was_lost:
            log.warning("GPU %d answers NVML again", index)
            if self._event_set is not None:
                self._register_gpu_events(index)
        return True

    # ------------------------------------------------------------------ events
    def register_events(self) -> bool:
        """Create the event set and register XID and double-bit ECC events for every GPU
        that supports them (idempotent). False if NVML has no event support here."""
        if self._event_set is None:  # only the health watcher's thread registers events
            event_set = self.call("nvmlEventSetCreate")
            with self._lock:
                self._event_set = event_set
        if self._event_set is None:
            return False
        if self._event_gpus is None:
            self._event_gpus = self.device_count()
        for index in range(self._event_gpus):
            if index not in self._events_registered:
                self._register_gpu_events(index)
        return True

    def _register_gpu_events(self, index: int) -> None:
        h = self.handle(index)
        if h is None:
            return
        wanted = self.const("nvmlEventTypeXidCriticalError") | self.const(
            "nvmlEventTypeDoubleBitEccError"
        )
        supported = self.call("nvmlDeviceGetSupportedEventTypes", h, gpu=index)
        if supported is None:
            log.warning(
                "GPU %d: NVML events not supported; XID health checks are off for it", index
            )
            self._events_registered.add(index)
            return
        mask = wanted & int(supported)
        if mask:
            self.call("nvmlDeviceRegisterEvents", h, mask, self._event_set, gpu=index)
        if index not in self._lost:
            self._events_registered.add(index)

    def wait_events(self, timeout_ms: int) -> list[HealthEvent]:
        """Block up to ``timeout_ms`` for health events; [] on timeout. Returns every event
        already queued once one arrives, plus a ``lost`` event for each GPU newly marked lost
        (by any call, or found when NVML reports a lost GPU during the wait)."""
        lib = self._lib
        if lib is None:
            raise NvmlError("wait_events before init()")
        events: list[HealthEvent] = []
        if not self.register_events():
            time.sleep(max(0, timeout_ms) / 1000)
        else:
            wait_name = (
                "nvmlEventSetWait_v2" if hasattr(lib, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
            )
            wait = getattr(lib, wait_name)
            timeout = max(0, int(timeout_ms))
            while len(events) < 256:
                try:
                    data = wait(self._event_set, timeout)
                except lib.NVMLError as exc:
                    if exc.value == self.const("NVML_ERROR_TIMEOUT"):
                        break
                    with self._lock:
                        self._errors[wait_name] = self._errors.get(wait_name, 0) + 1
                    if exc.value == self.const("NVML_ERROR_GPU_IS_LOST"):
                        for index in range(self._event_gpus or 0):
                            if index not in self._lost:
                                self.probe(index)
                        timeout = 0
                        continue
                    raise NvmlError(
                        f"NVML {wait_name} failed: {exc} (NVML error {exc.value})",
                        function_name=wait_name,
                        code=exc.value,
                    ) from exc
                events.extend(self._health_events(data))
                timeout = 0  # drain what is already queued, without waiting again
        with self._lock:
            new_lost = sorted(self._lost - self._reported_lost)
            self._reported_lost.update(new_lost)
        events.extend(HealthEvent(i, "lost") for i in new_lost)
        return events

    def _health_events(self, data: Any) -> list[HealthEvent]:
        index = self._handle_gpu.get(self._handle_key(data.device))
        if index is None:
            index = self.call("nvmlDeviceGetIndex", data.device)
        if index is None:
            return []
        out: list[HealthEvent] = []
        event_type = int(data.eventType)
        if event_type & self.const("nvmlEventTypeXidCriticalError"):
            out.append(HealthEvent(int(index), "xid", int(data.eventData)))
        if event_type & self.const("nvmlEventTypeDoubleBitEccError"):
            out.append(HealthEvent(int(index), "ecc_dbe"))
        return out

    # ------------------------------------------------------------------ discovery
    def read_facts(self, source: str = "nvml") -> NodeFacts:
        """Discover the node (module docstring), as read: ``agent.topology`` derives the
        model from it. GPUs that are lost while being read are returned with ``lost=True``
        and whatever was read before; the others are complete."""
        notes: list[str] = []
        n = self.device_count()
        driver = self.call("nvmlSystemGetDriverVersion")
        cuda = self.call("nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self.call("nvmlSystemGetCudaDriverVersion")
        sysfs = self._sysfs
        numa_nodes = sysfs.numa_nodes() if sysfs is not None else {}

        gpus: list[Gpu] = []
        handles: list[Any] = []
        for index in range(n):
            gpu, h = self._read_gpu(index, numa_nodes, notes)
            gpus.append(gpu)
            handles.append(h)

        links = self._read_links(gpus, handles, notes)
        nics: list[Nic] = []
        if sysfs is not None:
            for nic in sysfs.rdma_nics():
                levels = tuple(
                    sysfs.pcie_level(nic.pci_bus_id, g.pci_bus_id)
                    if nic.pci_bus_id and g.pci_bus_id
                    else None
                    for g in gpus
                )
                root = sysfs.pcie_root(nic.pci_bus_id) if nic.pci_bus_id else None
                nics.append(Nic(nic.name, nic.pci_bus_id, nic.numa_node, levels, pcie_root=root))
        lost = sorted(g.index for g in gpus if g.lost)
        if lost:
            notes.append(f"GPUs lost during discovery (partly read): {lost}")
        return NodeFacts(
            gpus=tuple(gpus),
            links=tuple(links),
            nics=tuple(nics),
            numa_distances={k: tuple(v.distances) for k, v in numa_nodes.items()},
            numa_cpulists={k: v.cpulist for k, v in numa_nodes.items()},
            driver_version=_text(driver) if driver is not None else None,
            cuda_driver_version=f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else None,
            machine=sysfs.product_name() if sysfs is not None else None,
            source=source,
            notes=tuple(notes),
        )

    def _read_gpu(
        self, index: int, numa_nodes: dict[int, Any], notes: list[str]
    ) -> tuple[Gpu, Any]:
        h = self.handle(index)
        call = self.call
        # identity first: a GPU lost half-way is still known by UUID and bus id
        uuid = call("nvmlDeviceGetUUID", h, gpu=index) if h is not None else None
        pci = call("nvmlDeviceGetPciInfo", h, gpu=index) if h is not None else None
        name = call("nvmlDeviceGetName", h, gpu=index) if h is not None else None
        memory = call("nvmlDeviceGetMemoryInfo", h, gpu=index) if h is not None else None
        minor = call("nvmlDeviceGetMinorNumber", h, gpu=index) if h is not None else None
        cc = call("nvmlDeviceGetCudaComputeCapability", h, gpu=index) if h is not None else None
        bus_id = _nvml_bus_id(pci.busId) if pci is not None else ""
        total_bytes = int(memory.total) if memory is not None else 0

        mig_enabled = False
        mig_devices: tuple[MigDevice, ...] = ()
        mode = call("nvmlDeviceGetMigMode", h, gpu=index) if h is not None else None
        # GetMigMode answers on MIG-capable GPUs and is NotSupported (None) elsewhere
        mig_capable = mode is not None if h is not None else None
        if mode is None and "nvmlDeviceGetMigMode" in self._missing_logged:
            mig_capable = None  # a driver without the function says nothing either way
        if mode is not None and int(mode[0]) == self.const("NVML_DEVICE_MIG_ENABLE"):
            mig_enabled = True
            mig_devices = self._read_mig(index, h, total_bytes)

        cluster, clique = self._read_fabric(index, h)

        numa: int | None = None
        cpulist: str | None = None
        pci_class: int | None = None
        pcie_root: str | None = None
        if self._sysfs is not None and bus_id:
            pcie_root = self._sysfs.pcie_root(bus_id)
            numa = self._sysfs.pci_numa_node(bus_id)
            cpulist = self._sysfs.pci_local_cpulist(bus_id)
            pci_class = self._sysfs.pci_class(bus_id)
        if cpulist is None and h is not None:
            words = call(
                "nvmlDeviceGetCpuAffinity",
                h,
                max(1, -(-self._cpu_count(numa_nodes) // 64)),
                gpu=index,
            )
            if words is not None:
                cpulist = _cpulist_from_words(words) or None
        if numa is None and cpulist and numa_nodes:
            mine = _cpus_of(cpulist)
            matches = [
                k for k, node in numa_nodes.items() if mine and mine <= _cpus_of(node.cpulist)
            ]
            if len(matches) == 1:
                numa = matches[0]
                notes.append(f"GPU {index}: NUMA node {numa} inferred from its CPU affinity")
        if numa is None and h is not None and not numa_nodes:
            numa = call("nvmlDeviceGetNumaNodeId", h, gpu=index)
            if numa is not None:
                notes.append(f"GPU {index}: NUMA node {numa} from nvmlDeviceGetNumaNodeId")

        lost = index in self._lost
        if uuid is None:
            uuid = f"GPU-unknown-{index}"
            notes.append(f"GPU {index}: UUID unknown (GPU lost), shown as {uuid}")
        gpu = Gpu(
            index=index,
            uuid=_text(uuid),
            name=_text(name) if name is not None else "unknown",
            memory_mib=total_bytes // _MIB if memory is not None else None,
            pci_bus_id=bus_id,
            minor_number=int(minor) if minor is not None else None,
            compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
            mig_enabled=mig_enabled,
            mig_capable=mig_capable,
            mig_devices=mig_devices,
            numa_node=numa,
            cpu_affinity=cpulist,
            pci_class=pci_class,
            fabric_cluster_uuid=cluster,
            fabric_clique_id=clique,
            lost=lost,
            pcie_root=pcie_root,
        )
        return gpu, (None if lost else h)

    def _cpu_count(self, numa_nodes: dict[int, Any]) -> int:
        highest = 0
        for node in numa_nodes.values():
            cpus = _cpus_of(node.cpulist)
            if cpus:
                highest = max(highest, max(cpus) + 1)
        return max(highest, 1024)

    def _read_mig(self, index: int, h: Any, total_bytes: int) -> tuple[MigDevice, ...]:
        count = self.call("nvmlDeviceGetMaxMigDeviceCount", h, gpu=index) or 0
        not_found = (self.const("NVML_ERROR_NOT_FOUND"), self.const("NVML_ERROR_INVALID_ARGUMENT"))
        out: list[MigDevice] = []
        for slot in range(int(count)):
            mh = self._invoke("nvmlDeviceGetMigDeviceHandleByIndex", (h, slot), index, not_found)
            if mh is None:
                continue
            uuid = self.call("nvmlDeviceGetUUID", mh, gpu=index)
            attrs = self.call("nvmlDeviceGetAttributes", mh, gpu=index)
            if uuid is None or attrs is None:
                continue
            gi = self.call("nvmlDeviceGetGpuInstanceId", mh, gpu=index)
            ci = self.call("nvmlDeviceGetComputeInstanceId", mh, gpu=index)
            gi_slices, ci_slices = (
                int(attrs.gpuInstanceSliceCount),
                int(attrs.computeInstanceSliceCount),
            )
            memory_mib = int(attrs.memorySizeMB)
            base = f"{gi_slices}g.{mig_memory_gb(total_bytes, memory_mib)}gb"
            out.append(
                MigDevice(
                    uuid=_text(uuid),
                    parent_index=index,
                    index=slot,
                    profile=base if ci_slices == gi_slices else f"{ci_slices}c.{base}",
                    memory_mib=memory_mib,
                    gi_id=int(gi) if gi is not None else None,
                    ci_id=int(ci) if ci is not None else None,
                )
            )
        return tuple(out)

    def _read_fabric(self, index: int, h: Any) -> tuple[str | None, int | None]:
        if h is None:
            return None, None
        lib = self._lib
        info: Any = None
        if hasattr(lib, "nvmlDeviceGetGpuFabricInfoV") and hasattr(lib, "c_nvmlGpuFabricInfoV_t"):
            info = lib.c_nvmlGpuFabricInfoV_t()
            info.version = self.const("nvmlGpuFabricInfo_v2")
            if self.call("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info), gpu=index) is None:
                info = None
        elif hasattr(lib, "nvmlDeviceGetGpuFabricInfo") and hasattr(lib, "c_nvmlGpuFabricInfo_t"):
            info = lib.c_nvmlGpuFabricInfo_t()
            if self.call("nvmlDeviceGetGpuFabricInfo", h, ctypes.byref(info), gpu=index) is None:
                info = None
        if info is None:
            return None, None
        if int(info.state) != self.const("NVML_GPU_FABRIC_STATE_COMPLETED") or int(
            info.status
        ) != self.const("NVML_SUCCESS"):
            return None, None
        raw = bytes(bytearray(info.clusterUuid))
        cluster = str(uuid_mod.UUID(bytes=raw)) if any(raw) else None
        return cluster, int(info.cliqueId)

    def _read_links(self, gpus: list[Gpu], handles: list[Any], notes: list[str]) -> list[Link]:
        n = len(gpus)
        by_bus = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
        direct: dict[tuple[int, int], int] = {}
        switch_links = [0] * n
        gpu_type = self.const("NVML_NVLINK_DEVICE_TYPE_GPU", 0)
        switch_type = self.const("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        enabled = self.const("NVML_FEATURE_ENABLED", 1)
        max_links = int(self.const("NVML_NVLINK_MAX_LINKS", 18))
        invalid = (self.const("NVML_ERROR_INVALID_ARGUMENT"),)
        for i, h in enumerate(handles):
            if h is None:
                continue
            for link in range(max_links):
                state = self._invoke("nvmlDeviceGetNvLinkState", (h, link), i, invalid)
                if state is None or int(state) != enabled:
                    continue
                kind = self.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, gpu=i)
                remote = self.call("nvmlDeviceGetNvLinkRemotePciInfo", h, link, gpu=i)
                remote_gpu = by_bus.get(_nvml_bus_id(remote.busId)) if remote is not None else None
                if kind is not None and int(kind) == switch_type:
                    switch_links[i] += 1
                elif (
                    remote_gpu is not None
                    and remote_gpu != i
                    and (kind is None or int(kind) == gpu_type)
                ):
                    key = (i, remote_gpu)
                    direct[key] = direct.get(key, 0) + 1
                elif kind is None and remote is not None and remote_gpu is None:
                    # drivers without RemoteDeviceType: a remote end that is no GPU is a switch
                    switch_links[i] += 1
        nvlink_cap = self.const("NVML_P2P_CAPS_INDEX_NVLINK", 2)
        p2p_ok = self.const("NVML_P2P_STATUS_OK", 0)
        links: list[Link] = []
        for a in range(n):
            for b in range(a + 1, n):
                ha, hb = handles[a], handles[b]
                level: PcieLevel | None = None
                if ha is not None and hb is not None:
                    raw = self.call("nvmlDeviceGetTopologyCommonAncestor", ha, hb, gpu=a)
                    if raw is not None and int(raw) in PcieLevel._value2member_map_:
                        level = PcieLevel(int(raw))
                if (
                    level is None
                    and self._sysfs is not None
                    and gpus[a].pci_bus_id
                    and gpus[b].pci_bus_id
                ):
                    level = self._sysfs.pcie_level(gpus[a].pci_bus_id, gpus[b].pci_bus_id)
                count = max(direct.get((a, b), 0), direct.get((b, a), 0))
                via_switch = False
                if switch_links[a] and switch_links[b] and self._same_fabric(gpus[a], gpus[b]):
                    status = self.call("nvmlDeviceGetP2PStatus", ha, hb, nvlink_cap, gpu=a)
                    if status is None or int(status) == p2p_ok:
                        count += min(switch_links[a], switch_links[b])
                        via_switch = True
                if count or level is not None:
                    links.append(Link(a, b, count, level, via_switch))
        if any(switch_links):
            notes.append(
                "NVSwitch: every pair of switch-attached GPUs counts the smaller of their "
                "switch-link counts as NVLinks"
            )
        return links

    @staticmethod
    def _same_fabric(a: Gpu, b: Gpu) -> bool:
        if a.fabric_clique_id is None or b.fabric_clique_id is None:
            return True
        return (a.fabric_cluster_uuid, a.fabric_clique_id) == (
            b.fabric_cluster_uuid,
            b.fabric_clique_id,
        )
