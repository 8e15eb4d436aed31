"""The counters of a node's pool (partitionable devices, KEP-4815): which counters each device
consumes and which the counter slice declares.

**Layout.** One counter per GPU (``gpu-<index>``, value 1) in counter sets of at most 32
(``gpus-<n>`` holds GPUs 32n..32n+31), declared in a slice of their own (``sharedCounters``,
no devices). A device consumes the counters of GPUs it stands for, so two devices consuming
the same counter are never allocated together: a set blocks its members and every
overlapping set, a single blocks every set that contains it.

**Only where two devices meet.** Each time the scheduler reserves a device that consumes any
counter, it compares every counter its pool declares (``checkAvailableCounters``,
``allocator_incubating.go``), for every candidate of every claim on every Filter; a counter
only matters for a GPU that two published devices stand for. So where the sets and the single
GPUs share one slice (up to 64 devices), a device consumes a GPU's counter only while another
device of the same rendering stands for that GPU too (:func:`meeting_gpus`), and the counter
slice declares only the counters some device consumes (:func:`declared_counter_sets`; one
counter where none is: a counter set may not be empty). A held set whose members nothing else
stands for then consumes nothing, and a busy node declares the counters of its free GPUs.
Above one device slice (the sets' slices, then the singles' slice) the slices are written one
after the other, so a view may join the singles of one publication to the sets of the one
before: there every set consumes all its members' counters, and a single GPU its own while a set
of its publication or of the one before holds it; the singles' slice is written before the
sets' (:mod:`agent.dra.pool_writes`). Any view then has the singles of publication N + 1 and
sets of N or N + 1, or the singles and the sets of N: each set's members' singles consume.

**Why that is safe.** The scheduler counts an allocated device's counters by looking the device
up in the slices it sees *now*. Within one device slice, any two devices standing for a GPU
both consume its counter, so of the devices the scheduler sees, no two that share a GPU are
allocated together, whatever each consumed when it was allocated. A device it no longer sees
counts for nothing under either layout: that is the withdrawal rule's business
(:mod:`agent.dra.withdrawal`), unchanged.

**Why writes are ordered.** A view that joins a device slice to a counter slice lacking one of
the counters it consumes makes the pool invalid (``validateDeviceCounterConsumption``: the
allocator skips it), never unsafe: the devices' own consumption decides who excludes whom. To
keep the pool usable the publisher widens the counter slice first when the devices will consume
a counter it lacks (:func:`widened`), writes the devices, then narrows it.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping

__all__ = [
    "MAX_COUNTERS_PER_SET", "MAX_COUNTER_SETS_PER_SLICE", "consumes_counters", "counter_set_name",
    "counters_of", "declared_counter_sets", "meeting_gpus", "widened",
]

MAX_COUNTERS_PER_SET = 32  # ResourceSliceMaxCountersPerCounterSet
MAX_COUNTER_SETS_PER_SLICE = 8  # ResourceSliceMaxCounterSets

#: A counter as the slices name it: (counter set, counter).
Counter = tuple[str, str]


def counter_set_name(gpu_index: int) -> str:
    """The counter set holding GPU ``gpu_index``'s counter (32 counters a set)."""
    return f"gpus-{gpu_index // MAX_COUNTERS_PER_SET}"


def meeting_gpus(holdings: Iterable[Collection[int]]) -> set[int]:
    """The GPUs that two or more of ``holdings`` (each device's GPUs) stand for."""
    seen: set[int] = set()
    meet: set[int] = set()
    for gpus in holdings:
        for g in gpus:
            (meet if g in seen else seen).add(g)
    return meet


def consumes_counters(gpus: Iterable[int], weights: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    """A device's ``consumesCounters`` for the GPU indices ``gpus``, all of each GPU's counter
    (``weights``: its value where not 1, a GPU offering dynamic MIG: its memory slices times
    :data:`agent.dra.mig_counters.SCALE`)."""
    uses: dict[str, dict[str, Any]] = {}
    for i in gpus:
        uses.setdefault(counter_set_name(i), {})[f"gpu-{i}"] = {"value": str((weights or {}).get(i, 1))}
    return [{"counterSet": name, "counters": c} for name, c in uses.items()]


def declared_counter_sets(gpus: Iterable[int], weights: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    """``sharedCounters`` declaring the counters of the GPU indices ``gpus`` (at least one; at
    most 8 sets, 256 GPUs, four times the most a node may have), each worth 1 or its ``weights``."""
    sets: dict[str, dict[str, Any]] = {}
    for i in sorted(set(gpus)):
        sets.setdefault(counter_set_name(i), {})[f"gpu-{i}"] = {"value": str((weights or {}).get(i, 1))}
    if not sets:
        raise ValueError("a counter slice declares at least one counter")
    if len(sets) > MAX_COUNTER_SETS_PER_SLICE:
        raise ValueError(f"{len(set(gpus))} GPUs need more than {MAX_COUNTER_SETS_PER_SLICE} counter sets")
    return [{"name": name, "counters": counters} for name, counters in sets.items()]


def counters_of(spec: Mapping[str, Any]) -> set[Counter]:
    """The counters a slice ``spec`` declares (``sharedCounters``) or its devices consume."""
    out = {(cs.get("name"), c) for cs in spec.get("sharedCounters") or () for c in cs.get("counters") or {}}
    for d in spec.get("devices") or ():
        body = d.get("basic", d) if isinstance(d, Mapping) else {}
        out |= {(u.get("counterSet"), c) for u in body.get("consumesCounters") or () for c in u.get("counters") or {}}
    return out


def widened(counter_slice: Mapping[str, Any], stored: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``counter_slice`` (to be written) declaring also what the ``stored`` counter slice
    declares: the form to write before the device slices when they consume a counter the stored
    one lacks (None when nothing is stored or the stored one declares all of them)."""
    want, have = counters_of(counter_slice["spec"]), counters_of((stored or {}).get("spec") or {})
    if stored is None or want <= have:
        return None
    sets: dict[str, dict[str, Any]] = {}
    for cs in [*((stored.get("spec") or {}).get("sharedCounters") or ()), *counter_slice["spec"]["sharedCounters"]]:
        sets.setdefault(cs["name"], {}).update(cs.get("counters") or {})
    return {**counter_slice, "spec": {**counter_slice["spec"], "sharedCounters": [
        {"name": name, "counters": dict(sorted(c.items(), key=lambda kv: _natural(kv[0])))}
        for name, c in sorted(sets.items(), key=lambda kv: _natural(kv[0]))]}}


def _natural(name: str) -> tuple[int, str]:
    """``gpu-2`` before ``gpu-10``."""
    return len(name), name
