"""The prepared-claims checkpoint: what NodePrepareResources answered, kept on disk.

After an agent restart, a repeated prepare of a claim answers from here (the kubelet retries
until it gets an answer for every claim) and an unprepare finds what to remove. One file per
claim, ``<plugins_dir>/<driver>/claims/<claim uid>.json``, so that a prepare or unprepare
costs one small write (or one unlink) however many claims the node holds. Each file is
written atomically (temp file, rename; ``fsync`` optional) and carries a checksum, so a
torn or hand-edited file is noticed: it is then set aside as
``<uid>.json.corrupt`` with one error logged, and that claim counts as not prepared (prepared
again, it is recomputed from the API server and gets the same answer). The directory is the
checkpoint's alone: the temp files of writes the agent was killed in are removed when it is
loaded (at start), said with their number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from agent.errors import shorten
from agent.files import remove_stale_temps, write_json_atomic
from agent.listeners import Listeners

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".json"


@dataclass(frozen=True)
class PreparedDevice:
    """One entry of a NodePrepareResourceResponse: models the DRA gRPC API's ``Device``
    (request names, pool, device name, CDI device IDs), as checkpointed."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    spec_path: str  # the CDI spec written for it
    #: how its devices are shared (agent.dra.claim_sharing.ClaimSharingState's JSON); None: not shared
    sharing: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["devices"] = [dict(asdict(d), cdi_ids=list(d.cdi_ids)) for d in self.devices]
        if self.sharing is None:
            del out["sharing"]  # the file of an unshared claim stays as earlier agents wrote it
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PreparedClaim":
        return cls(
            uid=str(data["uid"]),
            namespace=str(data["namespace"]),
            name=str(data["name"]),
            devices=tuple(
                PreparedDevice(str(d["request"]), str(d["pool"]), str(d["device"]), tuple(map(str, d["cdi_ids"])))
                for d in data["devices"]
            ),
            spec_path=str(data["spec_path"]),
            sharing=_sharing(data.get("sharing")),
        )


def _sharing(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError("sharing: expected an object")
    return value


def _checksum(claim: dict[str, Any]) -> str:
    text = json.dumps(claim, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


#: The longest claim UID taken (Kubernetes UIDs are 36-character UUIDs): it names the CDI
#: spec and the checkpoint file, which must stay under the file-name limit (255 bytes).
MAX_CLAIM_UID_CHARS = 128
_CLAIM_UID = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


def claim_uid_problem(uid: str) -> str:
    """Why ``uid`` cannot be a claim UID here ("" when it can): the one rule for a UID that
    names the claim's checkpoint file, its CDI spec and CDI devices (Kubernetes UIDs are
    UUIDs; no path separator, no hidden or parent name, nothing a CDI name refuses)."""
    if not uid:
        return "not a claim UID (empty)"
    if len(uid) > MAX_CLAIM_UID_CHARS:
        return f"not a claim UID (more than {MAX_CLAIM_UID_CHARS} characters)"
    if not _CLAIM_UID.match(uid):
        return "not a claim UID (expected letters, digits, '-', '_' or '.')"
    return ""


class Checkpoint:
    """The prepared claims by UID, mirrored to one file each under ``directory``.
    Thread-safe. ``fsync`` makes each write durable against a power loss before it counts.
    Listeners (:meth:`add_listener`) run after each claim recorded or forgotten."""

    def __init__(self, directory: str, *, fsync: bool = True) -> None:
        self.directory = directory
        self.fsync = fsync
        # Lock order: a leaf; listeners run after it is released.
        self._lock = threading.Lock()
        removed = remove_stale_temps(directory)
        if removed:
            log.info("checkpoint %s: removed %d temp file(s) of interrupted writes", directory, removed)
        self._claims: dict[str, PreparedClaim] = self._load()
        self._listeners = Listeners(log, "checkpoint")

    def path_of(self, uid: str) -> str:
        return os.path.join(self.directory, uid + SUFFIX)

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.error("checkpoint %s: cannot list (%s); starting with no prepared claims", self.directory, exc.strerror)
            return {}
        out: dict[str, PreparedClaim] = {}
        for name in names:
            if name.endswith(SUFFIX) and not name.startswith("."):
                claim = self._load_one(os.path.join(self.directory, name))
                if claim is not None:
                    out[claim.uid] = claim
        return out

    def _load_one(self, path: str) -> PreparedClaim | None:
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"expected an object with version {FORMAT_VERSION}")
            if doc.get("checksum") != _checksum(doc["claim"]):
                raise ValueError("checksum mismatch")
            claim = PreparedClaim.from_json(doc["claim"])
            if os.path.basename(path) != claim.uid + SUFFIX:
                raise ValueError(f"it holds claim uid {shorten(repr(claim.uid))}")
            return claim
        except OSError as exc:
            log.error("checkpoint %s: cannot read (%s); that claim counts as not prepared", path, exc.strerror)
            return None
        except (ValueError, KeyError, TypeError) as exc:
            aside = path + ".corrupt"
            log.error(
                "checkpoint %s is not a valid prepared-claim checkpoint (%s): moved to %s;"
                " that claim counts as not prepared", path, exc, aside,
            )
            try:
                os.replace(path, aside)
            except OSError:
                pass
            return None

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def add(self, claim: PreparedClaim) -> None:
        """Record ``claim`` (written before it counts; raises OSError when it cannot be,
        ValueError when its UID breaks :func:`claim_uid_problem`'s rule)."""
        if claim_uid_problem(claim.uid):
            raise ValueError(f"claim uid {shorten(repr(claim.uid))}: {claim_uid_problem(claim.uid)}")
        raw = claim.to_json()
        with self._lock:
            write_json_atomic(
                self.path_of(claim.uid),
                {"version": FORMAT_VERSION, "checksum": _checksum(raw), "claim": raw},
                fsync=self.fsync,
            )
            self._claims[claim.uid] = claim
        self._notify()

    def remove(self, uid: str) -> PreparedClaim | None:
        """Forget ``uid``; returns what was recorded (None when nothing was)."""
        with self._lock:
            claim = self._claims.get(uid)
            if claim is not None:
                try:
                    os.unlink(self.path_of(uid))
                except FileNotFoundError:
                    pass
                del self._claims[uid]
        if claim is not None:
            self._notify()
        return claim

    def add_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (outside the lock) after every claim recorded or forgotten."""
        self._listeners.add(callback)

    def _notify(self) -> None:
        self._listeners.notify()  # a listener that fails is logged: it never fails a prepare

    def devices(self) -> set[tuple[str, str]]:
        """(pool, device name) of every device of every prepared claim."""
        with self._lock:
            return {(d.pool, d.device) for c in self._claims.values() for d in c.devices}

    def __iter__(self) -> Iterator[PreparedClaim]:
        with self._lock:
            return iter(list(self._claims.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)
