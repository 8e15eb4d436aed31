"""The NVML call wrapper: the only module of ours that imports ``pynvml``.

:class:`NvmlCalls` wraps either the real ``pynvml`` module (imported lazily by
:meth:`NvmlCalls.init`) or a module-like fake (:class:`agent.hw.sim.nvml.FakeNvml`). Every NVML
call goes through :meth:`NvmlCalls.call`, which turns NVML's failure modes into ours:

* ``NotSupported`` -> ``None`` (the fact is absent);
* ``GpuIsLost`` -> that GPU is marked lost (:attr:`NvmlCalls.lost_gpus`), ``None``; later
  calls for it return ``None`` without touching NVML until :meth:`NvmlCalls.probe` sees it
  answer again. One failing GPU never takes the others down;
* ``FunctionNotFound`` (an older driver) -> ``None``, logged once per function;
* anything else -> :class:`NvmlError` (exit code 1) with the NVML error chained.

Errors other than NotSupported are counted per function in
:attr:`NvmlCalls.error_counts` (exported as a metric).

NVML missing (no driver, no ``libnvidia-ml.so.1`` in the container): :meth:`NvmlCalls.init`
raises :class:`NvmlUnavailable` with one clear line. What the agent does then is the
``fail_on_init_error`` setting (NVIDIA's device plugin's ``failOnInitError``): exit 1 (True, default), or
log and retry until NVML comes up (False): the daemon's loop (``agent.daemon``) does that.

Discovery (:mod:`agent.hw.nvml.facts`), health events (:mod:`agent.hw.nvml.events`) and
telemetry (:mod:`agent.hw.nvml.telemetry`) call NVML through this wrapper;
:mod:`agent.hw.nvml.backend` puts them together.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

from agent.errors import AgentError

__all__ = ["NvmlCalls", "NvmlError", "NvmlUnavailable"]

log = logging.getLogger(__name__)

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


class NvmlCalls:
    """NVML (real or fake) behind one wrapper; see the module docstring.

    ``lib``: None for the real ``pynvml`` (imported in :meth:`init`), else a module-like
    object with pynvml's API (the fake). Thread-safe: calls are serialised by one lock,
    except event waits.
    """

    # Locks: ``_call_lock`` serialises NVML calls (held across the call, the only lock held
    # across I/O; nothing but the call runs under it). ``_lock`` guards the bookkeeping
    # (lost GPUs, error counts, handles) that other threads read, a scrape included, and is
    # never held across an NVML call. Order: ``_lock`` is never taken while ``_call_lock``
    # is held, and the reverse does not happen either.

    def __init__(self, lib: Any = None, *, missing_function_level: int = logging.WARNING) -> None:
        """``missing_function_level``: how loudly a function the driver lacks is logged (once
        each); a simulated machine that leaves facts unknown on purpose logs it at INFO."""
        self._lib: Any = lib
        self._missing_level = missing_function_level
        self._call_lock = threading.Lock()
        self._lock = threading.RLock()
        self._lost: set[int] = set()
        self._errors: dict[str, int] = {}
        self._missing_logged: set[str] = set()
        self._handles: dict[int, Any] = {}
        self._handle_gpu: dict[object, int] = {}
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
        """Shut NVML down; never raises."""
        lib = self._lib
        if lib is None or not self._initialized:
            return
        with self._lock:
            self._handles.clear()
            self._handle_gpu.clear()
            self._initialized = False
        try:
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

    def gpu_of(self, handle: object) -> int | None:
        """The index of the GPU whose handle (from :meth:`handle`) this is; None if unknown."""
        with self._lock:
            return self._handle_gpu.get(self._handle_key(handle))

    def count_error(self, function_name: str) -> None:
        """Count one NVML error of ``function_name`` (a call made outside :meth:`call`)."""
        with self._lock:
            self._errors[function_name] = self._errors.get(function_name, 0) + 1

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

    def call(
        self,
        function_name: str,
        *args: Any,
        gpu: int | None = None,
        absent: tuple[int, ...] = (),
        empty: tuple[int, ...] = (),
    ) -> Any:
        """Call ``lib.<function_name>(*args)``, translating NVML errors (module docstring).

        ``gpu`` names the GPU the call is about; when None it is inferred from a device
        handle among ``args`` (handles from :meth:`handle`). ``absent``: further NVML error
        codes that mean "no such thing" here (None, not counted), as NotSupported does.
        ``empty``: NVML error codes that mean "nothing to report" here (an empty tuple, not
        counted), as NotFound from ``nvmlDeviceGetProcessUtilization`` does.
        Returns the function's result, or None where the fact is absent.
        """
        return self._invoke(function_name, args, gpu, absent, empty)

    def has(self, name: str) -> bool:
        """Whether the NVML library in use has ``name`` (a function, constant or struct)."""
        return self._lib is not None and hasattr(self._lib, name)

    @property
    def missing_functions(self) -> frozenset[str]:
        """The NVML functions found missing from this driver so far (each logged once)."""
        with self._lock:
            return frozenset(self._missing_logged)

    def _invoke(
        self,
        function_name: str,
        args: Sequence[Any],
        gpu: int | None,
        absent: tuple[int, ...],
        empty: tuple[int, ...] = (),
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
            if code in empty:
                return ()
            self.count_error(function_name)
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
        log.log(
            self._missing_level,
            "NVML function %s is not available with this driver; its data is skipped",
            function_name,
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
        no longer lost (its handle is renewed)."""
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
            self.count_error("nvmlDeviceGetUUID")
            if exc.value == self.const("NVML_ERROR_GPU_IS_LOST"):
                self._mark_lost(index, "nvmlDeviceGetUUID")
            return False
        with self._lock:
            self._handles[index] = h
            self._handle_gpu[self._handle_key(h)] = index
            if was_lost:
                self._lost.discard(index)
        if was_lost:
            log.warning("GPU %d answers NVML again", index)
        return True
