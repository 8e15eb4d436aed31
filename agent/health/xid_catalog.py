"""What an XID means and what to do about it: NVIDIA's XID catalog as data
(``xid_catalog.csv``, ``xid_nvlink_decode.csv`` beside this module; their header names the
source and version) plus the configured overrides.

:meth:`XidCatalog.rule` answers ``(FaultClass, action)`` for an XID and the text of its line.
Order: an override (``health.xids``) > the catalog's row (XIDs 144-150 decoded by subcode and
error status, XID 154 by the recovery action it names) > the generic rule for an XID outside
the table: :data:`UNKNOWN_CLASS` (an application XID: an Event and a metric, a fault only when
it repeats), said once per XID.
"""

from __future__ import annotations

import csv
import logging
import re
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Mapping

from agent.health.faults import FaultClass

__all__ = ["OVERRIDE_CHOICES", "XidCatalog", "XidRule", "catalog_version", "recovery_action_rule"]

log = logging.getLogger(__name__)

UNKNOWN_CLASS = FaultClass.APPLICATION
UNKNOWN_ACTION = "Unknown XID: see NVIDIA's XID catalog; set its class with health.xids."

#: ``health.xids`` values -> (class, action)
OVERRIDE_CHOICES: Mapping[str, tuple[FaultClass, str]] = {
    "ignore": (FaultClass.INFORMATIONAL, "None."),
    "application": (FaultClass.APPLICATION, "Restart the application."),
    "reset": (FaultClass.GPU_RESET_REQUIRED, "Reset the GPU."),
    "reboot": (FaultClass.NODE_REBOOT_REQUIRED, "Reboot the node."),
    "memory": (FaultClass.MEMORY_ERROR, "Reset the GPU."),
    "nvlink": (FaultClass.NVLINK_DOWN, "Reset the GPU; check the NVLink connections if it repeats."),
    "support": (FaultClass.CONTACT_SUPPORT, "Contact your support organization."),
}

#: NVIDIA's immediate-action buckets of the NVLink decode -> (class, action)
_BUCKETS: Mapping[str, tuple[FaultClass, str]] = {
    "RESET_GPU": (FaultClass.GPU_RESET_REQUIRED, "Reset the GPU (NVLink error)."),
    "XID_154_EVAL": (FaultClass.APPLICATION, "Follow XID 154 if one came with it; else restart the application."),
    "IGNORE": (FaultClass.INFORMATIONAL, "None."),
}
_SEVERITY = {"IGNORE": 0, "XID_154_EVAL": 1, "RESET_GPU": 2}

#: NVML's GPU recovery actions (nvmlDeviceGpuRecoveryAction_t), as XID 154 names them
_RECOVERY: Mapping[int, tuple[FaultClass, str]] = {
    1: (FaultClass.GPU_RESET_REQUIRED, "Reset the GPU (the driver requires it)."),
    2: (FaultClass.NODE_REBOOT_REQUIRED, "Reboot the node (the driver requires it)."),
    3: (FaultClass.NVLINK_DOWN, "Drain the GPU's peer-to-peer work (the driver requires it)."),
    4: (FaultClass.GPU_RESET_REQUIRED, "Drain the GPU's work, then reset it (the driver requires it)."),
}
_RECOVERY_TO = re.compile(r"\bto (0x[0-9a-fA-F]+|\d+)")
_REGISTERS = re.compile(r"\((0x[0-9a-fA-F]+)\s+(0x[0-9a-fA-F]+)")


@dataclass(frozen=True)
class XidRule:
    """What one XID calls for."""

    cls: FaultClass
    action: str
    mnemonic: str = ""
    known: bool = True  # in the catalog (or overridden)


def recovery_action_rule(action: int) -> XidRule | None:
    """The rule for an NVML GPU recovery action (XID 154's, or NVML's field); None for
    ``0`` (none needed) and values NVML does not define."""
    found = _RECOVERY.get(action)
    return XidRule(found[0], found[1], "GPU_RECOVERY_ACTION_CHANGED") if found else None


def recovery_action_of(text: str) -> int | None:
    """The action an XID 154 line changes to (``...from 0x0 (None) to 0x2 (Node Reboot
    Required)`` -> 2); None when the text names none."""
    m = _RECOVERY_TO.search(text)
    return int(m.group(1), 0) if m else None


def _rows(name: str) -> list[dict[str, str]]:
    text = resources.files("agent.health").joinpath(name).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


def catalog_version() -> str:
    """The catalog's version, from its header (``Catalog version: 2026-07-14``)."""
    text = resources.files("agent.health").joinpath("xid_catalog.csv").read_text(encoding="utf-8")
    m = re.search(r"Catalog version: ([^.\s]+)", text)
    return m.group(1) if m else "unknown"


@dataclass(frozen=True)
class _NvlinkRow:
    subcodes: tuple[str, ...]
    statuses: tuple[int, ...]  # () = any
    bucket: str
    fatal_bucket: str


def _statuses(text: str) -> tuple[int, ...]:
    return tuple(int(s, 16) for s in text.split("/") if s.strip()) if text else ()


class XidCatalog:
    """The shipped table with ``overrides`` (XID -> a key of :data:`OVERRIDE_CHOICES`) on
    top. Thread-safe."""

    def __init__(self, overrides: Mapping[int, str] | None = None) -> None:
        self._table: dict[int, XidRule] = {}
        self._special: dict[int, str] = {}  # XID -> "decode" (144-150) | "recovery" (154)
        for row in _rows("xid_catalog.csv"):
            xid, cls = int(row["xid"]), row["class"]
            if cls in ("decode", "recovery"):
                self._special[xid] = cls
                cls = FaultClass.INFORMATIONAL.value
            self._table[xid] = XidRule(FaultClass(cls), row["action"], row["mnemonic"])
        self._nvlink: dict[int, list[_NvlinkRow]] = {}
        for row in _rows("xid_nvlink_decode.csv"):
            self._nvlink.setdefault(int(row["xid"]), []).append(_NvlinkRow(
                tuple(s.strip() for s in row["subcodes"].split("/")), _statuses(row["error_status"]),
                row["immediate"], row["fatal_action"],
            ))
        self._overrides = {int(x): OVERRIDE_CHOICES[v] for x, v in (overrides or {}).items()}
        self._lock = threading.Lock()
        self._said_unknown: set[int] = set()
        self._said_undecoded: set[int] = set()

    def rule(self, xid: int, text: str = "") -> XidRule:
        """What XID ``xid`` (its line's text after the number: NVLink subcodes, XID 154's
        action) calls for."""
        override = self._overrides.get(xid)
        if override is not None:
            return XidRule(override[0], override[1], self._table.get(xid, XidRule(UNKNOWN_CLASS, "")).mnemonic)
        row = self._table.get(xid)
        if row is None:
            self._say_once(self._said_unknown, xid, "XID %d is not in the XID catalog (version %s): treated as an"
                           " application XID (an Event and a metric; a fault only when it repeats)",
                           xid, catalog_version())
            return XidRule(UNKNOWN_CLASS, UNKNOWN_ACTION, known=False)
        special = self._special.get(xid)
        if special == "decode":
            return self._decode_nvlink(xid, text, row)
        if special == "recovery":
            action = recovery_action_of(text)
            found = recovery_action_rule(action) if action is not None else None
            return found if found is not None else XidRule(FaultClass.INFORMATIONAL, "None.", row.mnemonic)
        return row

    def _decode_nvlink(self, xid: int, text: str, row: XidRule) -> XidRule:
        words = set(re.split(r"[\s,]+", text))
        fatal = bool(words & {"Fatal", "fatal"})
        m = _REGISTERS.search(text)
        status = int(m.group(2), 16) if m else None
        best: str | None = None
        for r in self._nvlink.get(xid, ()):
            if not words & set(r.subcodes) or status is None:
                continue
            if r.statuses and not any(s == status or (s and status & s) for s in r.statuses):
                continue
            bucket = r.fatal_bucket if fatal and r.fatal_bucket else r.bucket
            if best is None or _SEVERITY.get(bucket, 0) > _SEVERITY.get(best, 0):
                best = bucket
        if best is None or best not in _BUCKETS:
            self._say_once(self._said_undecoded, xid, "XID %d: subcode and error status not in the catalog's"
                           " decode table (said once): %s when the line says Fatal, else informational",
                           xid, FaultClass.GPU_RESET_REQUIRED.value)
            best = "RESET_GPU" if fatal else "IGNORE"
        cls, action = _BUCKETS[best]
        return XidRule(cls, action, row.mnemonic)

    def _say_once(self, said: set[int], xid: int, message: str, *args: object) -> None:
        with self._lock:
            if xid in said:
                return
            said.add(xid)
        log.warning(message, *args)
