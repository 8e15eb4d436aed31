"""How a re-publication of the node's pool is written: under which pool generation, and in
what order, so that the scheduler's allocator never sees the pool incomplete or invalid where
that can be avoided (it skips such a pool: ``allocator_incubating.go``).

**In place.** A re-publication that moves no device from one slice to another (the device
slice of a node of up to 64 devices after a prepare, or the single GPUs' and the sets' slices
of a larger one) rewrites the changed slices under the same generation: any view the
scheduler can have mixes whole slices of two publications, each device once, so the pool is
never incomplete. The counter slice declares only the counters devices consume
(:mod:`agent.dra.counters`), so a view joining the new device slice to the old counter slice
could lack a counter (invalid): a counter slice that must declare a counter the stored one
lacks is first written widened by what the stored one declares, then the device slices (the
single GPUs' slice before the sets' slices, where they have slices of their own), then the
counter slice as rendered where that narrows it. Each view is then valid: the scheduler's
informer applies one watch's events in order, so it sees the writes' prefixes.

**A new generation** in every slice otherwise (a slice added or gone, a device moving between
slices, slices of mixed generations stored): the scheduler treats the pool as incomplete from
the first write to the last, and never mixes the two publications.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from agent.dra.counters import counters_of, widened
from agent.dra.devices import parse_set_name
from agent.dra.readback import same_content

__all__ = ["WritePlan", "plan_writes"]


@dataclass(frozen=True)
class WritePlan:
    """The pool generation of the publication, the slices to create or update in order, and
    the names of the slices to delete after them."""

    generation: int
    writes: list[dict[str, Any]]
    deletes: list[str]


def _generation(obj: Mapping[str, Any]) -> Any:
    return ((obj.get("spec") or {}).get("pool") or {}).get("generation", 0)


def plan_writes(existing: Mapping[str, Mapping[str, Any]], want: list[dict[str, Any]], known: int) -> WritePlan:
    """How to turn the stored slices ``existing`` (by name) into ``want`` (rendered, in
    publication order); ``known``: the highest generation this agent wrote. Sets the generation
    in every ``want``."""
    seen = max([_generation(o) for o in existing.values()] + [known])
    names = {w["metadata"]["name"] for w in want}
    changed = [w for w in want if w["metadata"]["name"] not in existing
               or not same_content(w, existing[w["metadata"]["name"]])]
    deletes = sorted(set(existing) - names)
    if not changed and not deletes:
        return WritePlan(seen, [], [])
    in_place = ({_generation(o) for o in existing.values()} == {seen} and names == set(existing)
                and _stays_in_its_slice(existing, want))
    generation = seen if in_place else seen + 1
    for w in want:
        w["spec"]["pool"]["generation"] = generation
    return WritePlan(generation, _in_place_order(changed, existing) if in_place else want, deletes)


def _in_place_order(changed: list[dict[str, Any]], existing: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The changed slices in an order where every prefix is a valid pool (module docstring)."""
    first: list[dict[str, Any]] = []
    devices: list[dict[str, Any]] = []
    last: list[dict[str, Any]] = []
    for w in changed:
        if "sharedCounters" not in w["spec"]:
            devices.append(w)
            continue
        wide = widened(w, existing.get(w["metadata"]["name"]))
        first += [wide] if wide is not None else []
        last += [w] if wide is None or counters_of(wide["spec"]) != counters_of(w["spec"]) else []
    devices.sort(key=_holds_sets)  # stable: the single GPUs' slice first
    return first + devices + last


def _holds_sets(slice_obj: Mapping[str, Any]) -> bool:
    return any(parse_set_name(str(d.get("name"))) is not None for d in slice_obj["spec"].get("devices") or ())


def _stays_in_its_slice(existing: Mapping[str, Mapping[str, Any]], want: list[dict[str, Any]]) -> bool:
    """Whether every device name of ``want`` that ``existing`` has is in the same slice there."""
    where = {d.get("name"): name for name, o in existing.items()
             for d in (o.get("spec") or {}).get("devices") or () if isinstance(d, dict)}
    return all(where.get(d["name"], w["metadata"]["name"]) == w["metadata"]["name"]
               for w in want for d in w["spec"].get("devices") or ())
