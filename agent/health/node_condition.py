"""The ``GPUHealthy`` Node condition as a pure function of the health state: standing faults,
whether the agent can watch, and the node's GPUs (for their names in the message).

- ``False`` while a fatal fault stands (:attr:`FaultClass.fatal`): the reason is the most
  severe class among them (:class:`FaultClass` is listed most severe first), the message names
  each fault's GPUs (index, PCI bus ID, UUID), what was seen and the recommended action;
- else ``Unknown`` while the agent cannot watch (reason: the :class:`Watching` value);
- else ``True`` (reason :data:`HEALTHY_REASON`).

A known fault outranks "cannot watch": a remediator should act on a GPU that fell off the bus
even when NVML is gone since. The message is at most :data:`MAX_MESSAGE_BYTES` (UTF-8), cut
with a ``… and N more`` tail (NVSentinel capped its messages at 1 KiB after users saw
38,000-character ones). The message never counts repeats, so a storm of one fault does not
change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from agent.health.faults import Fault, FaultClass, Watching
from agent.records import Gpu

__all__ = ["HEALTHY_REASON", "MAX_MESSAGE_BYTES", "ConditionState", "derive_condition", "gpu_names",
           "cap_message"]

HEALTHY_REASON = "GPUsHealthy"
MAX_MESSAGE_BYTES = 1024
_SEVERITY = {cls: rank for rank, cls in enumerate(FaultClass)}
_WATCHING_WORDS = {
    Watching.NVML_UNAVAILABLE: "NVML is unavailable",
    Watching.WATCHER_FAILED: "the health watcher failed",
}


@dataclass(frozen=True)
class ConditionState:
    """What the condition says: ``status`` ``True`` | ``False`` | ``Unknown``."""

    status: str
    reason: str
    message: str


def gpu_names(indices: Iterable[int], gpus: Mapping[int, Gpu]) -> str:
    """``GPU 3 (00000000:3B:00.0, GPU-…)`` for each index, comma-separated; a GPU the
    topology does not hold is named by its index only."""
    out = []
    for index in indices:
        gpu = gpus.get(index)
        ids = [x for x in ((gpu.pci_bus_id, gpu.uuid) if gpu is not None else ()) if x]
        out.append(f"GPU {index} ({', '.join(ids)})" if ids else f"GPU {index}")
    return ", ".join(out)


def sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text.endswith((".", "!", "?")) else text + "."


def describe_fault(fault: Fault, gpus: Mapping[int, Gpu]) -> str:
    """One fault as the message names it: ``<GPUs>: <detail>. <action>``."""
    where = gpu_names(fault.gpus, gpus) if fault.gpus else "node"
    action = f" {sentence(fault.action)}" if fault.action else ""
    return f"{where}: {sentence(fault.detail)}{action}"


def cap_message(parts: list[str], limit: int = MAX_MESSAGE_BYTES, sep: str = "; ") -> str:
    """``parts`` joined with ``sep``, at most ``limit`` UTF-8 bytes: the parts that fit, then
    ``… and N more`` for the rest (a first part longer than the limit is cut itself)."""
    whole = sep.join(parts)
    if len(whole.encode()) <= limit:
        return whole
    kept: list[str] = []
    for i, part in enumerate(parts):
        tail = f"{sep}… and {len(parts) - i - 1} more" if i < len(parts) - 1 else ""
        candidate = sep.join([*kept, part]) + tail
        if len(candidate.encode()) > limit:
            break
        kept.append(part)
    if not kept:
        tail = f" … and {len(parts) - 1} more" if len(parts) > 1 else " …"
        room = limit - len(tail.encode())
        return parts[0].encode()[:room].decode(errors="ignore") + tail
    return sep.join(kept) + f"{sep}… and {len(parts) - len(kept)} more"


def derive_condition(faults: Iterable[Fault], watching: Watching, gpus: Mapping[int, Gpu]) -> ConditionState:
    """The condition for these standing ``faults`` (see the module)."""
    fatal = sorted((f for f in faults if f.cls.fatal), key=lambda f: (_SEVERITY[f.cls], f.gpus, f.since, f.key))
    if fatal:
        return ConditionState("False", fatal[0].cls.value, cap_message([describe_fault(f, gpus) for f in fatal]))
    if watching != Watching.YES:
        words = _WATCHING_WORDS.get(watching, watching.value)
        return ConditionState("Unknown", watching.value,
                              f"The agent cannot watch the GPUs ({words}): their health is not known.")
    return ConditionState("True", HEALTHY_REASON, f"All {len(gpus)} GPUs are healthy.")
