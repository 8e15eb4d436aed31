"""The prepared-claims checkpoint: what NodePrepareResources answered, kept on disk.

After an agent restart, a repeated prepare of a claim answers from here (the kubelet retries
until it gets an answer for every claim) and an unprepare finds what to remove. The file is
``<plugins_dir>/<driver>/checkpoint.json``, rewritten atomically on every change, with a
checksum so that a torn or hand-edited file is noticed: it is then set aside as
``checkpoint.json.corrupt`` with one error logged, and the agent starts with no prepared
claims (a claim prepared again is recomputed from the API server and gets the same answer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from agent.dra.cdi import write_json_atomic

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PreparedDevice:
    """One entry of a NodePrepareResourceResponse."""

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

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["devices"] = [dict(asdict(d), cdi_ids=list(d.cdi_ids)) for d in self.devices]
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
        )


def _checksum(claims: list[dict[str, Any]]) -> str:
    text = json.dumps(claims, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class Checkpoint:
    """The prepared claims by UID, mirrored to ``path``. Thread-safe."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._claims: dict[str, PreparedClaim] = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.error("checkpoint %s: cannot read (%s); starting with no prepared claims", self.path, exc.strerror)
            return {}
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"expected an object with version {FORMAT_VERSION}")
            raw = doc["claims"]
            if doc.get("checksum") != _checksum(raw):
                raise ValueError("checksum mismatch")
            claims = [PreparedClaim.from_json(c) for c in raw]
        except (ValueError, KeyError, TypeError) as exc:
            aside = self.path + ".corrupt"
            log.error(
                "checkpoint %s is not a valid prepared-claims checkpoint (%s): moved to %s,"
                " starting with no prepared claims", self.path, exc, aside,
            )
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return {}
        return {c.uid: c for c in claims}

    def _save(self, claims: dict[str, PreparedClaim]) -> None:
        """Write ``claims``, then make them the state (a failed write changes nothing)."""
        raw = [c.to_json() for c in sorted(claims.values(), key=lambda c: c.uid)]
        write_json_atomic(self.path, {"version": FORMAT_VERSION, "checksum": _checksum(raw), "claims": raw})
        self._claims = claims

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def add(self, claim: PreparedClaim) -> None:
        with self._lock:
            self._save({**self._claims, claim.uid: claim})

    def remove(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            claim = self._claims.get(uid)
            if claim is not None:
                self._save({k: v for k, v in self._claims.items() if k != uid})
            return claim

    def __iter__(self) -> Iterator[PreparedClaim]:
        with self._lock:
            return iter(list(self._claims.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)
