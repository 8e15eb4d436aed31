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

**Write-ahead for dynamic MIG** (format 2): a claim whose devices are MIG instances cut at
prepare is recorded *before* the agent acts. Its file then says the claim's ``phase``
(``preparing``, ``prepared``, ``unpreparing``) and one :class:`MigRecord` per instance: the
intent (GPU, profile, placement) written before ``create_mig``, the result (GPU instance,
compute instance, UUID) after it; ``destroying`` written before ``destroy_mig``, the record
dropped after it. What a crash leaves is resolved from these records alone
(:mod:`agent.dra.mig_lifecycle`). Format 1 files (no MIG, always prepared) still load.
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
from agent.files import remove_file, remove_stale_temps, write_json_atomic
from agent.listeners import Listeners

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
#: the versions read: 1 is 2 without phases and MIG records
READ_VERSIONS = (1, 2)

#: A claim's phase: its MIG instances are being created (the prepare has not answered yet);
#: it is prepared (the answer is ``devices``); its MIG instances are being destroyed.
PREPARING, PREPARED, UNPREPARING = "preparing", "prepared", "unpreparing"
PHASES = (PREPARING, PREPARED, UNPREPARING)
#: A MIG record's state: about to be created (no result yet); created (``gi_id``, ``ci_id``,
#: ``uuid`` say which instance); about to be destroyed (the instance named).
CREATING, CREATED, DESTROYING = "creating", "created", "destroying"
MIG_STATES = (CREATING, CREATED, DESTROYING)
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
class MigRecord:
    """One MIG instance cut for a claim's device (dynamic MIG), as the write-ahead knows it:
    GPU ``gpu``, profile ``profile`` on memory slices ``start`` .. ``start + size - 1``; with
    ``state`` :data:`CREATED` or :data:`DESTROYING`, the instance (``gi_id``, ``ci_id``,
    ``uuid``) the agent made. An instance is the agent's only while a record names it."""

    device: str  # the DRA device name it serves
    gpu: int
    profile: str
    start: int
    size: int
    state: str = CREATING
    gi_id: int | None = None
    ci_id: int | None = None
    uuid: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MigRecord":
        state = str(data["state"])
        if state not in MIG_STATES:
            raise ValueError(f"MIG record state {shorten(repr(state))}, expected one of {', '.join(MIG_STATES)}")
        gi, ci = data.get("gi_id"), data.get("ci_id")
        record = cls(str(data["device"]), int(data["gpu"]), str(data["profile"]), int(data["start"]),
                     int(data["size"]), state, None if gi is None else int(gi), None if ci is None else int(ci),
                     str(data.get("uuid", "")))
        if state != CREATING and (record.gi_id is None or not record.uuid):
            raise ValueError(f"MIG record of device {shorten(repr(record.device))} is {state} without its instance")
        return record


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    spec_path: str  # the CDI spec written for it
    #: how its devices are shared (agent.dra.claim_sharing.ClaimSharingState's JSON); None: not shared
    sharing: dict[str, Any] | None = None
    phase: str = PREPARED
    mig: tuple[MigRecord, ...] = ()  # the MIG instances cut for it (dynamic MIG)

    @property
    def prepared(self) -> bool:
        """The prepare answered ``devices`` (a repeated prepare answers them again)."""
        return self.phase == PREPARED

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["devices"] = [dict(asdict(d), cdi_ids=list(d.cdi_ids)) for d in self.devices]
        if self.sharing is None:
            del out["sharing"]  # the file of an unshared claim stays as earlier agents wrote it
        out["mig"] = [asdict(m) for m in self.mig]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PreparedClaim":
        phase = str(data.get("phase", PREPARED))  # format 1: no phase, always prepared
        if phase not in PHASES:
            raise ValueError(f"phase {shorten(repr(phase))}, expected one of {', '.join(PHASES)}")
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
            phase=phase,
            mig=tuple(MigRecord.from_json(m) for m in data.get("mig", ())),
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
            if not isinstance(doc, dict) or doc.get("version") not in READ_VERSIONS:
                raise ValueError(f"expected an object with version {' or '.join(map(str, READ_VERSIONS))}")
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
        """Forget ``uid``; returns what was recorded (None when nothing was). OSError when
        its file cannot be removed (it is then still recorded)."""
        with self._lock:
            claim = self._claims.get(uid)
            if claim is not None:
                remove_file(self.path_of(uid))
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
