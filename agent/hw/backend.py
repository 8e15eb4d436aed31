"""The typed ``hw.Backend`` protocol: what the agent's layers need of the hardware backend.

:class:`agent.hw.nvml.NvmlBackend` (on the real ``pynvml`` or on the simulator's fake) is
the implementation; it subclasses :class:`Backend`, so mypy checks every signature here
against it. Consumers name this protocol, or a narrower one of their own that it satisfies
(the health watcher's ``EventSource``, the daemon's ``DaemonBackend``, the self-metrics'
``ErrorCounting``), never the concrete class.

========================  ==========================================================
who                       what they use
========================  ==========================================================
daemon, discovery         :meth:`init`, :meth:`shutdown`, :meth:`read_facts`
sampler (``sampling``)    :meth:`handle`, :meth:`call`, :meth:`const`, :attr:`lost_gpus`
health watcher            :meth:`wait_events`, :meth:`probe`, :attr:`lost_gpus`
self-metrics              :attr:`error_counts`
========================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.records import NodeFacts

__all__ = ["Backend", "HealthEvent"]


@dataclass(frozen=True)
class HealthEvent:
    """Something happened to a GPU: an XID, a double-bit ECC error, or it fell off the bus."""

    gpu_index: int
    kind: str  # "xid" | "ecc_dbe" | "lost"
    xid: int | None = None


class Backend(Protocol):
    """The hardware backend. Thread-safe; no method but :meth:`init` and :meth:`wait_events`
    blocks for long. A GPU that is lost makes its calls answer None, never raise."""

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        """Open the hardware library; an ``AgentError`` (exit 1) with one clear line if it
        cannot."""
        ...

    def shutdown(self) -> None:
        """Release what :meth:`init` and the event registration took; never raises."""
        ...

    # ------------------------------------------------------------------ discovery
    def read_facts(self, source: str = "nvml") -> NodeFacts:
        """The node as read; ``agent.topology`` builds the model from it."""
        ...

    def device_count(self) -> int:
        """The number of GPUs; an ``AgentError`` if the library cannot say."""
        ...

    # ------------------------------------------------------------------ telemetry calls
    def handle(self, index: int) -> Any:
        """The device handle of GPU ``index``; None if the GPU is lost."""
        ...

    def call(
        self,
        function_name: str,
        *args: Any,
        gpu: int | None = None,
        absent: tuple[int, ...] = (),
    ) -> Any:
        """The library function's result, or None where the fact is absent (not supported,
        missing from the driver, the GPU lost, or one of the ``absent`` error codes)."""
        ...

    def const(self, name: str, default: Any = ...) -> Any:
        """A constant or struct class of the library in use, by name; ``default`` if given
        and the library has none."""
        ...

    # ------------------------------------------------------------------ health
    @property
    def lost_gpus(self) -> frozenset[int]:
        """GPUs found lost on any call, until a successful :meth:`probe`."""
        ...

    @property
    def error_counts(self) -> dict[str, int]:
        """Library errors (not "not supported") by function name since start; a copy."""
        ...

    def probe(self, index: int) -> bool:
        """Whether GPU ``index`` answers normally now (a lost one that does is lost no more)."""
        ...

    def register_events(self) -> bool:
        """Register for health events on every GPU (idempotent); False without event
        support."""
        ...

    def wait_events(self, timeout_ms: int) -> Sequence[HealthEvent]:
        """Block up to ``timeout_ms`` for health events; empty on timeout."""
        ...
