"""What the API server kept of a written ResourceSlice, read back from its answer.

An API server with a feature gate off drops that feature's fields on write without an error
(``dropDisabledFields`` in kubernetes ``pkg/registry/resource/resourceslice/strategy.go``;
a slice that already uses the feature keeps it on update): ``DRAPartitionableDevices`` drops
``sharedCounters`` and every device's ``consumesCounters``, ``DRADeviceTaints`` every
device's ``taints``. The publisher compares what it sent with what the server stored
(:func:`dropped_features`) and publishes without the feature from then on.

The server sets a taint's ``timeAdded`` when it is missing; :func:`same_content` ignores it,
and :func:`keep_taint_times` carries it over from the stored object so that a taint kept
across updates keeps the time it was added.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

__all__ = ["PARTITIONABLE_DEVICES", "DEVICE_TAINTS", "dropped_features", "keep_taint_times", "same_content"]

#: The features, named as the API server's feature gates.
PARTITIONABLE_DEVICES = "DRAPartitionableDevices"
DEVICE_TAINTS = "DRADeviceTaints"


def _devices(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(name, body) of each device; the body is ``basic`` in ``v1beta1``."""
    for d in spec.get("devices") or ():
        if isinstance(d, Mapping):
            body = d.get("basic")
            yield str(d.get("name")), body if isinstance(body, Mapping) else d


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def dropped_features(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> set[str]:
    """The features whose fields ``sent`` had and the ``stored`` answer lacks."""
    out: set[str] = set()
    sent_spec, stored_spec = _spec(sent), _spec(stored)
    if sent_spec.get("sharedCounters") and not stored_spec.get("sharedCounters"):
        out.add(PARTITIONABLE_DEVICES)
    kept = dict(_devices(stored_spec))
    for name, body in _devices(sent_spec):
        have = kept.get(name, {})
        if body.get("consumesCounters") and not have.get("consumesCounters"):
            out.add(PARTITIONABLE_DEVICES)
        if body.get("taints") and not have.get("taints"):
            out.add(DEVICE_TAINTS)
    return out


def _taint_key(taint: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return taint.get("key"), taint.get("value", ""), taint.get("effect")


def keep_taint_times(body: dict[str, Any], stored: Mapping[str, Any] | None) -> None:
    """Give each taint of ``body`` the ``timeAdded`` of the same taint (key, value, effect)
    on the same device of ``stored``, where it has one."""
    if stored is None:
        return
    times = {(name, _taint_key(t)): t["timeAdded"] for name, dev in _devices(_spec(stored))
             for t in dev.get("taints") or () if isinstance(t, Mapping) and t.get("timeAdded")}
    for name, dev in _devices(_spec(body)):
        for t in dev.get("taints") or ():
            when = times.get((name, _taint_key(t)))
            if when is not None and isinstance(t, dict):
                t["timeAdded"] = when


def _comparable(obj: Mapping[str, Any]) -> Any:
    """The spec without the pool generation and the server-set taint times."""
    spec = json.loads(json.dumps(_spec(obj)))
    spec.get("pool", {}).pop("generation", None)
    for _, dev in _devices(spec):
        for t in dev.get("taints") or ():
            if isinstance(t, dict):
                t.pop("timeAdded", None)
    return spec


def same_content(want: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    """Same content, whatever the pool generation, taint times and server-set metadata."""
    owners = (have.get("metadata") or {}).get("ownerReferences") or []
    return _comparable(want) == _comparable(have) and owners == (want["metadata"].get("ownerReferences") or [])
