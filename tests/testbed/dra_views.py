"""What the scheduler can see of a node's pool while the agent re-publishes, and whether its
counters are right there; shared by ``test_dra_safety.py`` and ``test_dra_counters.py``; and a node's random history of
claims (:func:`node_history`), shared by ``test_dra_counters.py`` and ``test_dra_set_alone.py``.

A publication is written slice by slice as ``agent.dra.pool_writes`` plans it, and the
scheduler's ResourceSlice informer applies one watch's events in order, so it sees any prefix
of those writes (:func:`planned_views`). In a view, the allocator model's ``gather_pools``
(upstream ``GatherPools``) leaves out slices of older generations, skips an incomplete pool and
marks an invalid one (a device consuming a counter the pool does not declare);
:func:`miscounted` says what would let the scheduler hand a GPU out twice.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from hypothesis import strategies as st

from agent.dra.devices import parse_set_name
from agent.dra.pool_writes import plan_writes
from tests.testbed.dra_allocator_model import gather_pools
from tests.testbed.dra_publishers import Publisher, device_names, withdrawing

_WHOLE_GPU = re.compile(r"gpu-(\d+)")  # a whole GPU's device, and its counter


def stands_for(name: str) -> frozenset[int]:
    """The GPUs device ``name`` stands for, what the kubelet plugin prepares for it: a whole
    GPU's index, a set's members as its name says (none for a MIG device)."""
    found = _WHOLE_GPU.fullmatch(name)
    return frozenset([int(found.group(1))]) if found else frozenset(parse_set_name(name) or ())


def planned_views(stored: list[dict[str, Any]], new: list[dict[str, Any]],
                  known: int) -> tuple[int, list[list[dict[str, Any]]]]:
    """The pool generation of ``new`` and the pools the scheduler may see while it replaces
    ``stored`` (after each write and each delete, in order); ``known``: the highest generation
    the agent wrote. Sets the generation in ``new``, as the publisher does."""
    existing = {o["metadata"]["name"]: o for o in stored}
    plan = plan_writes(existing, new, known)
    now, out = dict(existing), []
    for w in plan.writes:
        now[w["metadata"]["name"]] = w
        out.append(sorted(now.values(), key=lambda o: o["metadata"]["name"]))
    for name in plan.deletes:
        del now[name]
        out.append(sorted(now.values(), key=lambda o: o["metadata"]["name"]))
    return plan.generation, out


def miscounted(view: list[dict[str, Any]], node: str) -> str | None:
    """What is wrong with the counters in ``view`` (None: nothing, or the pool is incomplete and
    the allocator skips it): an invalid pool, a device consuming the counter of a GPU it does
    not stand for, or two devices standing for one GPU without both consuming its counter."""
    pools = gather_pools(view, node)
    if not pools or pools[0].incomplete:
        return None
    if pools[0].invalid:
        return f"the scheduler sees the pool invalid: {pools[0].invalid}"
    newest = max(s["spec"]["pool"]["generation"] for s in view)  # older slices are left out
    standing: dict[int, list[tuple[str, bool]]] = {}
    for d in (d for s in view if s["spec"]["pool"]["generation"] == newest for d in s["spec"].get("devices", [])):
        gpus = stands_for(d["name"])
        consumed = {int(found.group(1)) for u in d.get("consumesCounters") or () for c in u["counters"]
                    if (found := _WHOLE_GPU.fullmatch(c))}
        if not consumed <= gpus:
            return f"{d['name']} consumes the counters of GPUs {sorted(consumed - gpus)}"
        for g in gpus:
            standing.setdefault(g, []).append((d["name"], g in consumed))
    for g, devices in sorted(standing.items()):
        if len(devices) > 1 and not all(c for _, c in devices):
            short = [n for n, c in devices if not c]
            return f"{', '.join(n for n, _ in devices)} stand for GPU {g}; {', '.join(short)} do(es) not consume its counter"
    return None


#: A node's history for :func:`node_history`: (operation, argument) steps.
HISTORY_STEPS = st.lists(st.tuples(st.sampled_from(["take", "take", "take", "end", "expire"]), st.integers(0, 63)),
                         min_size=1, max_size=14)


def node_history(publish: Publisher, topo: Any, node: str,
                 steps: Iterable[tuple[str, int]]) -> Iterator[tuple[dict[str, frozenset[int]], list[dict[str, Any]],
                                                                    list[dict[str, Any]]]]:
    """The occupancy changing as on a node, one step at a time: ``take`` (a claim takes a free
    device the scheduler sees, a set or a single GPU, the argument choosing which), ``end`` (a
    claim ends), ``expire`` (the withdrawal grace of what is tainted now runs out); after each,
    the agent re-renders from what it holds and what it published (``publish``, version 1.37).
    Yields (held devices -> GPUs, the publication before, the new one); the first publication
    is the empty node's."""
    stored = publish(topo, node, {}, (), "1.37")
    held: dict[str, frozenset[int]] = {}
    expired: list[str] = []
    for op, arg in steps:
        busy = {g for gpus in held.values() for g in gpus}
        free = [n for n in device_names(stored) if not stands_for(n) & busy and n not in withdrawing(stored)]
        if op == "take" and free:
            name = free[arg % len(free)]
            held[name] = stands_for(name)
        elif op == "end" and held:
            del held[sorted(held)[arg % len(held)]]
        elif op == "expire":
            expired = withdrawing(stored)
        new = publish(topo, node, held, device_names(stored), "1.37", expired=expired, tainted=withdrawing(stored))
        yield held, stored, new
        stored = new

