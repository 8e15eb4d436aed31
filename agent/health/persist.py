"""What survives an agent restart within one boot: the standing faults and how far the
kernel log was read, in one small JSON file written whole (temp file + rename).

A file of another boot (``/proc/sys/kernel/random/boot_id`` differs) is a new boot: its
faults are gone (a reboot is the remedy of last resort and clears everything). A file that
cannot be read or parsed is said once and ignored: the kernel log read from its start
re-derives what it can.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field

from agent.health.faults import Fault, FaultClass

__all__ = ["SavedHealth", "StateFile", "read_boot_id"]

log = logging.getLogger(__name__)

_VERSION = 1


def read_boot_id(proc_root: str) -> str:
    """This boot's id (``<proc_root>/sys/kernel/random/boot_id``); "" when unreadable."""
    try:
        with open(os.path.join(proc_root, "sys/kernel/random/boot_id"), encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


@dataclass
class SavedHealth:
    """The faults standing and the kernel log's stream and last position handled."""

    faults: list[Fault] = field(default_factory=list)
    stream: str = ""
    position: int = -1


def _fault_json(f: Fault) -> dict[str, object]:
    return {"key": f.key, "class": f.cls.value, "gpus": list(f.gpus), "action": f.action, "detail": f.detail,
            "xid": f.xid, "since": f.since, "count": f.count}


def _fault_of(d: dict[str, object]) -> Fault:
    xid = d.get("xid")
    return Fault(
        key=str(d["key"]), cls=FaultClass(str(d["class"])), gpus=tuple(int(g) for g in d["gpus"]),  # type: ignore[attr-defined]
        action=str(d.get("action", "")), detail=str(d.get("detail", "")),
        xid=int(xid) if isinstance(xid, int) else None, since=float(d.get("since", 0.0)),  # type: ignore[arg-type]
        count=int(d.get("count", 1)),  # type: ignore[call-overload]
    )


class StateFile:
    """``path`` for boot ``boot_id``. Not thread-safe: the watcher's thread owns it."""

    def __init__(self, path: str, boot_id: str) -> None:
        self.path = path
        self.boot_id = boot_id
        self._said_write = False
        #: the file holds what this boot must not keep (another boot's, unreadable, foreign):
        #: the watcher writes its own at once (:meth:`load` sets it)
        self.outdated = False

    def load(self) -> SavedHealth:
        """What the last run of this boot saved; empty for another boot or no file."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            return SavedHealth()
        except (OSError, ValueError) as exc:
            log.warning("health state %s cannot be read (%s): starting from the kernel log alone", self.path, exc)
            return SavedHealth()
        try:
            if doc.get("boot_id", "") != self.boot_id:
                log.info("health state %s is of another boot: its faults are cleared by the reboot", self.path)
                self.outdated = True
                return SavedHealth()
            kernel_log = doc.get("kernel_log") or {}
            return SavedHealth([_fault_of(f) for f in doc.get("faults", [])],
                               str(kernel_log.get("stream", "")), int(kernel_log.get("position", -1)))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            log.warning("health state %s is not what this agent writes (%s): ignored", self.path, exc)
            return SavedHealth()

    def save(self, saved: SavedHealth) -> bool:
        """Write ``saved``; False (said once) when the file cannot be written."""
        doc = {"version": _VERSION, "boot_id": self.boot_id, "faults": [_fault_json(f) for f in saved.faults],
               "kernel_log": {"stream": saved.stream, "position": saved.position}}
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".health-state-", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(doc, fh)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            if not self._said_write:
                log.error("health state %s cannot be written (%s): a restart re-derives faults from the kernel"
                          " log alone", self.path, exc.strerror or exc)
                self._said_write = True
            return False
        self._said_write = False
        return True
