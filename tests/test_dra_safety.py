"""Issue 25's safety property: no GPU is ever allocated to two claims, whatever the order of
scheduling, preparing, unpreparing and re-publishing.

The world (one node, ``dgx-h100``): the scheduler is the allocator model
(``dra_allocator_model.py``) over the slices published *now*, with every claim it has
allocated and not yet deallocated as its allocated state (upstream's ``AllocatedDevices``:
device IDs; an allocated device's counters are found by looking the device up in the
published slices, ``checkAvailableCounters``); the agent learns of a claim only when the
kubelet prepares it (after the pod is bound) and forgets it at unprepare; it re-renders from
what it knows, and what it renders reaches the API server at a later ``publish`` step (so
any number of claims can be allocated between a prepare and the re-publish: every lag). A
claim is deallocated only after it was unprepared (the pod is gone first).

Events, drawn by hypothesis: ``schedule k`` (a pod of k GPUs: ``[one set of k -> k singles]``,
a single GPU for k = 1), ``prepare i``, ``unprepare i``, ``deallocate i``, ``publish`` (the
agent re-renders from what it knows and writes it slice by slice, as its publisher plans the
writes; they reach the scheduler at once, or, where the scheduler's view lags the agent's
writes, at a later ``land`` (the rest of the next publication) or ``land_write`` (its next
slice write)), ``expire`` (the grace of the withdrawal taints runs out, see below).
Checked after every event: the GPUs of the claims whose pods may run (allocated or prepared,
not unprepared) are disjoint (a device stands for the GPUs its name says, as the kubelet
plugin prepares it); the pool the scheduler sees is never invalid; and in it every device
consumes only counters of GPUs it stands for and two devices standing for one GPU both consume
its counter (``dra_views.miscounted``; the agent declares a GPU's counter only where two devices
meet, ``agent.dra.counters``).

**The two-step withdrawal** (:mod:`agent.dra.gpusets`): a published set one of whose GPUs is
held through another device is first published with the taint ``<driver>/withdrawn``
(``NoSchedule``: the allocator model gives it to no claim, ``taintPreventsAllocation``, and still
counts its counters for a claim it holds), and leaves at a publication after its grace ran out.
The grace is an event, ``expire``, that ends the grace of every withdrawal taint whose first
write the scheduler has seen (``land``) and for which every claim allocated from an older view
has been prepared (or unprepared, or deallocated). That is the **bounded-lag assumption**: the
grace outlasts the scheduler's slice-view lag plus the time from allocation to
NodePrepareResources. Under it RACE (below) no longer hands a GPU out twice; where the API
server keeps no taints (or the grace is 0) the agent withdraws at once and RACE stays a strict
xfail; :func:`test_the_grace_must_outlast_the_lag_the_check_catches_one_that_does_not` shows
that an expiry ignoring the assumption is caught.

**What the agent guarantees anyway** (:func:`first_prepared_twice`): ``prepare i`` goes through
the agent's own ``ClaimPreparer`` (in-process, with its checkpoint in a temporary directory and
the claim as the scheduler allocated it): a claim is refused while another prepared claim
holds one of its GPUs (the pod does not start; the kubelet retries it later), so no GPU is
ever *prepared* for two claims, whatever the scheduler allocated, whatever the lag;
:func:`test_the_race_ends_in_a_refused_prepare_not_a_shared_gpu` shows RACE reaching the
preparer where sets are withdrawn at once.

What publishes (``Agent``): the agent's own rendering and rule (:func:`the_agents_rendering`,
with the grace; :func:`the_agent_without_taints`, at once), and a toy
of issue 25's design that does withdraw sets (the few best sets per size whose GPUs are all
free), under a rule: ``keep_what_a_claim_may_hold`` (the stub of the rule issue 25 asks for:
a set stays published while a prepared claim holds it or while all its GPUs are free, since
then an allocated claim the agent has not heard of may hold it; it goes at once when one of its GPUs
is held by a prepared claim through another device: the scheduler cannot have allocated both)
and ``withdraw_at_once`` (deliberately unsafe: publish the rendering as it is), which
:func:`test_the_check_catches_a_rule_that_withdraws_a_held_set` shows the property catches.
"""

from __future__ import annotations

import copy
import itertools
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st

from agent.config import Config
from agent.discovery import load_topology
from agent.dra.checkpoint import Checkpoint
from agent.dra.devices import parse_set_name
from agent.dra.prepare import ClaimPreparer, ClaimRef
from agent.dra.slices import render_slices
from agent.dra.view import DraView
from tests.testbed.dra_allocator_model import AllocatorModel
from tests.testbed.dra_publishers import (
    agent_publisher,
    device_names,
    set_names,
    single_gpus,
    withdrawing,
)
from tests.testbed.dra_views import miscounted, planned_views, stands_for

DRIVER = "gpu.gpu-agent.io"
NODE = "node-1"
GPU_EXPR = "gpu"
SET_EXPR = "gpuset"
CLASSES = [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expr}}]}}
           for name, expr in ((DRIVER, GPU_EXPR), (f"gpuset.{DRIVER}", SET_EXPR))]


def _type(d: Any) -> Any:
    return d.attributes.get(DRIVER, {}).get("type")


CEL = {GPU_EXPR: lambda d: d.driver == DRIVER and _type(d) == "gpu",
       SET_EXPR: lambda d: d.driver == DRIVER and _type(d) == "gpuset",
       **{f"count{k}": (lambda d, k=k: d.attributes[DRIVER].get("gpuCount") == k) for k in (2, 4, 8)}}
TOPO = load_topology("dgx-h100")


def toy_slices() -> list[dict[str, Any]]:
    """The agent's counter slice and single GPUs, with the toy's candidate sets (every pair,
    four quads, the eight) in place of the agent's sets, each consuming its members' counters
    as the singles consume them, named by its members as the agent names sets."""
    out = copy.deepcopy(render_slices(TOPO, node_name=NODE))
    devices = [d for s in out for d in s["spec"].get("devices", ())]
    counter = {d["attributes"][f"{DRIVER}/index"]["int"]: d["consumesCounters"][0] for d in devices
               if d["attributes"][f"{DRIVER}/type"]["string"] == "gpu"}
    candidates = [*itertools.combinations(range(8), 2), (0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 4, 5), (2, 3, 6, 7),
                  tuple(range(8))]
    sets = [{"name": "gpuset-%d-m%x" % (len(m), sum(1 << i for i in m)),
             "attributes": {f"{DRIVER}/type": {"string": "gpuset"}, f"{DRIVER}/gpuCount": {"int": len(m)}},
             "consumesCounters": [{"counterSet": counter[m[0]]["counterSet"],
                                   "counters": {c: v for i in m for c, v in counter[i]["counters"].items()}}]}
            for m in candidates]
    body = [s for s in out if "devices" in s["spec"]]
    for s in body:
        s["spec"]["devices"] = [d for d in s["spec"]["devices"] if d["attributes"][f"{DRIVER}/type"]["string"] == "gpu"]
    body[-1]["spec"]["devices"] += sets
    assert len(body[-1]["spec"]["devices"]) <= 64
    return out


FULL = toy_slices()


def pod_claim(name: str, k: int) -> dict[str, Any]:
    singles = {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": k}
    request: dict[str, Any] = {"name": "gpus", "exactly": singles}
    if k > 1:
        request = {"name": "gpus", "firstAvailable": [
            {"name": "set", "deviceClassName": f"gpuset.{DRIVER}", "allocationMode": "ExactCount", "count": 1,
             "selectors": [{"cel": {"expression": f"count{k}"}}]},
            {"name": "singles", **singles}]}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [request], "constraints": []}}}


def members(slices: list[dict[str, Any]]) -> dict[str, frozenset[int]]:
    """Device name -> the GPUs it stands for (``dra_views.stands_for``)."""
    return {d["name"]: stands_for(d["name"]) for s in slices for d in s["spec"].get("devices", [])
            if stands_for(d["name"])}


# ----------------------------------------------------------------------- what publishes
Render = Callable[[dict[str, frozenset[int]], list[str], "frozenset[str] | None"], list[dict[str, Any]]]
Rule = Callable[[list[dict[str, Any]], list[dict[str, Any]], frozenset[str], frozenset[int]], list[dict[str, Any]]]
PUBLISH = agent_publisher()


def the_agents_rendering(held: dict[str, frozenset[int]], published: list[str],
                         expired: frozenset[str] | None, tainted: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """What the agent publishes (``tests/testbed/dra_publishers.py``: ``render_slices`` with the
    devices its prepared claims hold, the sets it published before and those whose
    withdrawal grace ran out; its own rule decides what stays), against a 1.37 API server
    (where it publishes sets)."""
    return PUBLISH(TOPO, NODE, held, published, "1.37", expired=expired, tainted=tainted)


def the_agent_without_taints(held: dict[str, frozenset[int]], published: list[str],
                             expired: frozenset[str] | None, tainted: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The agent where the API server keeps no taints (or the grace is 0): a set that must go
    goes at once, the rule of before the grace."""
    return PUBLISH(TOPO, NODE, held, published, "1.37", expired=None)


def few_best_free_sets(held: dict[str, frozenset[int]], published: list[str], expired: frozenset[str] | None,
                       tainted: frozenset[str] = frozenset(), few: int = 2) -> list[dict[str, Any]]:
    in_use = frozenset(g for gpus in held.values() for g in gpus)
    """A toy of issue 25's design that withdraws sets: every single GPU, and per size the first
    ``few`` candidate sets (:func:`toy_slices`) whose GPUs are all free; every other set withdrawn."""
    free: dict[int, list[str]] = {}
    for name, gpus in members(FULL).items():
        if name.startswith("gpuset-") and not gpus & in_use:
            free.setdefault(len(gpus), []).append(name)
    keep = {name for names in free.values() for name in names[:few]}
    return _only(FULL, lambda d: d["name"] in keep or not d["name"].startswith("gpuset-"))


def _only(slices: list[dict[str, Any]], wanted: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    out = copy.deepcopy(slices)
    for s in out:
        if "devices" in s["spec"]:
            s["spec"]["devices"] = [d for d in s["spec"]["devices"] if wanted(d)]
    return out


def withdraw_at_once(published: list[dict[str, Any]], rendered: list[dict[str, Any]], held: frozenset[str],
                     in_use: frozenset[int]) -> list[dict[str, Any]]:
    """Deliberately unsafe: what was rendered replaces what was published."""
    return rendered


def keep_what_a_claim_may_hold(published: list[dict[str, Any]], rendered: list[dict[str, Any]],
                               held: frozenset[str], in_use: frozenset[int]) -> list[dict[str, Any]]:
    """The rendering, plus every device published before that a claim may hold: one a prepared
    claim holds (``held``), or one whose GPUs are all free (an allocated claim the agent has
    not heard of may hold it). Placed in the slice it was in (the slices are the full
    rendering's, so its counters are there)."""
    was = members(published)
    keep = {name for name, gpus in was.items() if name in held or not gpus & in_use}
    names = {d["name"] for s in rendered for d in s["spec"].get("devices", [])} | keep
    return _only(FULL, lambda d: d["name"] in names)


@dataclass
class Agent:
    render: Render
    rule: Rule | None = None


# ----------------------------------------------------------------------- the world
@dataclass
class Claim:
    devices: tuple[str, ...]
    gpus: frozenset[int]
    meaning: dict[str, frozenset[int]]
    view: int  # the last publication the scheduler saw whole when it allocated it
    state: str = "allocated"  # -> prepared -> unprepared (then deallocated: gone)


class _Healthy:
    def is_healthy(self, index: int) -> bool:
        return True


class Kubelet:
    """The node's side of ``prepare`` and ``unprepare``: the agent's ``ClaimPreparer`` over
    a checkpoint in a temporary directory, reading each claim as the scheduler allocated it."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="dra-safety")
        config = Config(mode="dra", node_name=NODE, plugins_dir=self.root, cdi_dir=f"{self.root}/cdi")
        self.objects: dict[str, dict[str, Any]] = {}
        self.preparer = ClaimPreparer(DraView(TOPO), config, _Healthy(), self, Checkpoint(f"{self.root}/claims", fsync=False),
                                      node_name=NODE)
        self.refused: list[str] = []

    def get(self, namespace: str, name: str) -> dict[str, Any]:  # the claim reader
        return self.objects[name]

    @staticmethod
    def ref(n: int) -> ClaimRef:
        return ClaimRef("default", f"uid-{n}", f"c{n}")

    def prepare(self, n: int, claim: Claim) -> bool:
        self.objects[f"c{n}"] = {"metadata": {"uid": f"uid-{n}"}, "status": {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d} for d in claim.devices]}}}}
        error = self.preparer.prepare(self.ref(n)).error
        if error:
            self.refused.append(error)
        return not error

    def unprepare(self, n: int) -> None:
        assert self.preparer.unprepare(self.ref(n)) == ""

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class World:
    """``published`` is what the scheduler sees; ``written`` what the agent wrote last. A
    publication is written slice by slice as the agent's publisher plans it
    (``agent.dra.pool_writes``: in place under the pool's generation where no device moves, the
    counter slice widened before the devices and narrowed after; else a new generation); the
    scheduler may see the pool after any of those writes. With ``lagging_view`` the writes
    reach it only at ``land`` (the rest of the next publication) or ``land_write`` (its next
    write) events, in order: its informer may still show an older pool when it allocates.
    ``seen``: the last publication the scheduler saw whole. ``tainted_since``: each set the
    agent's last write carries the withdrawal taint on -> the first publication of that
    unbroken run; ``expired``: those whose grace ran out (an ``expire`` event)."""

    agent: Agent
    lagging_view: bool = False
    published: list[dict[str, Any]] = field(default_factory=list)
    written: list[dict[str, Any]] = field(default_factory=list)
    pending: list[tuple[list[dict[str, Any]], int | None]] = field(default_factory=list)  # (view, publication)
    claims: dict[int, Claim] = field(default_factory=dict)
    in_use: frozenset[int] = frozenset()
    held: frozenset[str] = frozenset()
    generation: int = 1  # publications
    pool_generation: int = 1
    seen: int = 1
    serial: int = 0
    tainted_since: dict[str, int] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)
    kubelet: Kubelet | None = None  # prepare through the agent's preparer (it may refuse)
    _model: AllocatorModel | None = None

    def __post_init__(self) -> None:
        self.published = self.written = self.agent.render({}, [], frozenset())

    def publish(self) -> None:
        held = {d: gpus for c in self.claims.values() if c.state == "prepared" for d, gpus in c.meaning.items()}
        rendered = self.agent.render(held, device_names(self.written), frozenset(self.expired),
                                     frozenset(withdrawing(self.written)))
        new = self.agent.rule(self.written, rendered, self.held, self.in_use) if self.agent.rule else rendered
        self.generation += 1
        self.pool_generation, views = planned_views(self.written, new, self.pool_generation)
        self.pending += [(view, None) for view in views]  # the pool after each write
        self.pending.append((new, self.generation))
        self.written = new
        tainted = set(withdrawing(new))
        self.tainted_since = {name: self.tainted_since.get(name, self.generation) for name in tainted}
        self.expired &= tainted  # a set no longer tainted starts afresh when it is tainted again
        if not self.lagging_view:
            self.land()

    def view(self) -> int:
        return self.seen

    def expire(self) -> None:
        """The grace of a withdrawal taint runs out, under the bounded-lag assumption: only once
        the scheduler sees the write that first carried it, and every claim allocated from an
        older view is prepared (or unprepared, or gone)."""
        waiting = [c.view for c in self.claims.values() if c.state == "allocated"]
        self.expired |= {name for name, since in self.tainted_since.items()
                         if self.view() >= since and all(view >= since for view in waiting)}

    def land(self) -> None:
        """The rest of the next publication reaches the scheduler."""
        while self.pending and self.land_write() is None:
            pass

    def land_write(self) -> int | None:
        """The next write reaches the scheduler; the publication it completes, if any."""
        if not self.pending:
            return None
        (self.published, done), self._model = self.pending.pop(0), None
        self.seen = done if done is not None else self.seen
        return done

    def schedule(self, k: int) -> None:
        if self._model is None:
            self._model = AllocatorModel(self.published, CLASSES, CEL)
        self._model.allocated = {(DRIVER, NODE, d) for c in self.claims.values() for d in c.devices}
        self.serial += 1
        got = self._model.allocate([pod_claim(f"c{self.serial}", k)], NODE)
        if got is None:
            return
        meaning = members(self.published)
        devices = tuple(dev[2] for _, dev in got[0])
        gpus = frozenset(g for d in devices for g in meaning[d])
        self.claims[self.serial] = Claim(devices, gpus, {d: meaning[d] for d in devices}, self.view())

    def _pick(self, state: str, i: int) -> int | None:
        ids = sorted(n for n, c in self.claims.items() if c.state == state)
        return ids[i % len(ids)] if ids else None

    def step(self, op: str, arg: int) -> None:
        if op == "schedule":
            self.schedule(arg)
        elif op == "publish":
            self.publish()
        elif op == "land":
            self.land()
        elif op == "land_write":
            self.land_write()
        elif op == "expire":
            self.expire()
        elif op == "prepare" and (n := self._pick("allocated", arg)) is not None:
            if self.kubelet is not None and not self.kubelet.prepare(n, self.claims[n]):
                return  # refused: the pod does not start, the kubelet retries later
            self.claims[n].state = "prepared"
            self.in_use |= self.claims[n].gpus
            self.held |= set(self.claims[n].devices)
        elif op == "unprepare" and (n := self._pick("prepared", arg)) is not None:
            if self.kubelet is not None:
                self.kubelet.unprepare(n)
            self.claims[n].state = "unprepared"
            self.in_use -= self.claims[n].gpus
            self.held = frozenset(d for c in self.claims.values() if c.state == "prepared" for d in c.devices)
        elif op == "deallocate" and (n := self._pick("unprepared", arg)) is not None:
            del self.claims[n]

    def violation(self) -> str | None:
        running = [(n, c) for n, c in self.claims.items() if c.state != "unprepared"]
        for i, (a, ca) in enumerate(running):
            for b, cb in running[i + 1:]:
                if ca.gpus & cb.gpus:
                    return f"GPUs {sorted(ca.gpus & cb.gpus)} allocated to claims c{a} {ca.devices} and c{b} {cb.devices}"
        return miscounted(self.published, NODE)  # an invalid pool too: never the agent's writes

    def prepared_twice(self) -> str | None:
        """The agent's guarantee: the GPUs of the prepared claims are disjoint."""
        prepared = [(n, c) for n, c in self.claims.items() if c.state == "prepared"]
        for i, (a, ca) in enumerate(prepared):
            for b, cb in prepared[i + 1:]:
                if ca.gpus & cb.gpus:
                    return f"GPUs {sorted(ca.gpus & cb.gpus)} prepared for claims c{a} {ca.devices} and c{b} {cb.devices}"
        return None


OPS = st.lists(st.one_of(
    st.tuples(st.just("schedule"), st.sampled_from([1, 1, 2, 2, 4, 8])),
    st.tuples(st.sampled_from(["prepare", "unprepare", "deallocate", "publish", "expire"]), st.integers(0, 7)),
), min_size=1, max_size=40)
LAGGING_OPS = st.lists(st.one_of(
    st.tuples(st.just("schedule"), st.sampled_from([1, 1, 2, 2, 4, 8])),
    st.tuples(st.sampled_from(["prepare", "unprepare", "deallocate", "publish", "land", "land_write", "expire"]),
              st.integers(0, 7)),
), min_size=1, max_size=40)


def first_prepared_twice(agent: Agent, ops: list[tuple[str, int]]) -> tuple[str | None, World]:
    """The first time a GPU is prepared for two claims (None: never), the scheduler's view
    lagging the agent's writes, every prepare through the agent's preparer; and the world."""
    world = World(agent, lagging_view=True, kubelet=Kubelet())
    try:
        for i, (op, arg) in enumerate(ops):
            world.step(op, arg)
            problem = world.prepared_twice()
            if problem:
                return f"after event {i} ({op} {arg}): {problem}", world
        return None, world
    finally:
        world.kubelet.close()  # type: ignore[union-attr]


def first_violation(agent: Agent, ops: list[tuple[str, int]], lagging_view: bool = False) -> str | None:
    world = World(agent, lagging_view)
    for i, (op, arg) in enumerate(ops):
        world.step(op, arg)
        problem = world.violation()
        if problem:
            return f"after event {i} ({op} {arg}): {problem}"
    return None


AGENTS = {
    "the agent's rendering and rule": Agent(the_agents_rendering),
    "the agent, the API server keeping no taints": Agent(the_agent_without_taints),
    "few best free sets, kept while a claim may hold them": Agent(few_best_free_sets, keep_what_a_claim_may_hold),
}


#: A rule that keeps only the sets a prepared claim holds fails here (found by mutating the
#: rule; 60 random examples missed it 3 times in 4), so it is always tried.
KEEP_ONLY_HELD = [("schedule", 1), ("schedule", 1), ("schedule", 2), ("prepare", 0), ("publish", 0), ("schedule", 1)]


#: A single GPU is allocated while it consumes no counter (no published set holds its GPU),
#: then, still allocated and unknown to the agent, its GPU is in a set published again (found
#: by hypothesis's ``find``); the sets scheduled after must count the single's counter.
BARE_SINGLE = [("schedule", 1), ("schedule", 2), ("prepare", 0), ("prepare", 0), ("publish", 0), ("expire", 0),
               ("publish", 0), ("schedule", 1),
               ("unprepare", 0), ("publish", 0), ("schedule", 8), ("schedule", 4), ("schedule", 2), ("schedule", 2)]


@pytest.mark.parametrize("name", sorted(AGENTS))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
@example(ops=KEEP_ONLY_HELD)
@example(ops=BARE_SINGLE)
def test_no_gpu_is_ever_allocated_to_two_claims(name: str, ops: list[tuple[str, int]]) -> None:
    assert first_violation(AGENTS[name], ops) is None


#: A claim holds GPU 0 (the agent withdraws the pair (0, 1): a member is held through another
#: device); the claim ends before that write reaches the scheduler, which allocates the pair
#: from the pool it still sees; then the write lands, the pair's counters are no longer
#: consumed, and GPU 0 is handed out again.
RACE = [("schedule", 1), ("prepare", 0), ("publish", 0), ("unprepare", 0), ("deallocate", 0), ("schedule", 2),
        ("land", 0), ("schedule", 1)]


#: RACE for a single GPU: a claim holds the pair (0, 1) and the agent withdraws the singles of
#: GPUs 0 and 1 (held through the pair); the claim ends before that write reaches the scheduler,
#: which hands GPU 0 out as a single from the pool it still sees; the write lands, the single's
#: counter is no longer consumed, and the pair is handed out again over it. Withdrawn at once,
#: the singles fail here (found by mutating the rule; 60 random examples missed it).
RACE_SINGLE = [("schedule", 2), ("prepare", 0), ("publish", 0), ("unprepare", 0), ("deallocate", 0),
               ("publish", 0), ("schedule", 1), ("land", 0), ("schedule", 2), ("schedule", 2), ("schedule", 2),
               ("schedule", 2)]


#: A pair held through its set until its singles are withdrawn (the counter slice narrows: the
#: pair alone stands for its GPUs), then freed (it widens again), each write landing on its own.
NARROW_AND_WIDEN = [("schedule", 2), ("prepare", 0), ("publish", 0), ("land", 0), ("expire", 0), ("publish", 0),
                    ("land_write", 0), ("land_write", 0), ("unprepare", 0), ("publish", 0), ("land_write", 0),
                    ("land_write", 0)]


def test_every_write_of_a_counter_slice_narrowing_and_widening_leaves_the_pool_valid() -> None:
    """The counter slice declares only the counters two devices share: each write the agent's
    publisher plans reaches the scheduler on its own here, and after each the pool is valid and
    counts right (a counter slice narrowed before the devices, or widened after them, leaves a
    device consuming a counter the pool lacks: the allocator skips the pool)."""
    world = World(AGENTS["the agent's rendering and rule"], lagging_view=True)
    declared = []
    for i, (op, arg) in enumerate(NARROW_AND_WIDEN):
        world.step(op, arg)
        assert world.violation() is None, (i, op, world.violation())
        declared.append(len({c for s in world.published for cs in s["spec"].get("sharedCounters", ())
                             for c in cs["counters"]}))
    assert declared[0] == 8 and min(declared) == 6 and declared[-1] == 8, declared  # narrowed, then widened


_AT_ONCE = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "issue 25, found here: a withdrawal decided at once while a member GPU is held (safe then) can "
    "land after that claim ended and the scheduler allocated the set from the pool it still saw (its "
    "ResourceSlice and ResourceClaim informers are not ordered): the set's counters then go "
    "uncounted (RACE). The agent's rule where the API server keeps no taints (or the grace is 0), "
    "and the toy's"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "the agent's rendering and rule" else [_AT_ONCE])
                                  for n in sorted(AGENTS)])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=LAGGING_OPS)
@example(ops=RACE)
@example(ops=RACE_SINGLE)
@example(ops=NARROW_AND_WIDEN)
@example(ops=[*RACE, ("prepare", 0), ("publish", 0), ("expire", 0), ("publish", 0), ("land", 0), ("land", 0),
              ("schedule", 1), ("schedule", 2)])
def test_no_gpu_is_allocated_twice_when_the_schedulers_view_lags_the_agents_writes(
        name: str, ops: list[tuple[str, int]]) -> None:
    """Under any lag the scheduler's view has, as long as the grace outlasts it (the ``expire``
    event's assumption), with the agent's two-step withdrawal; today's rule fails (RACE)."""
    assert first_violation(AGENTS[name], ops, lagging_view=True) is None


def test_the_race_meets_a_tainted_set_whose_counters_still_count() -> None:
    """RACE with the grace: the sets the agent withdraws at the first write (those holding the
    claimed GPU) are published tainted; the scheduler allocates the pair from the older view it
    still has, then sees the taint and still counts the pair's counters, so its GPUs go to no
    second claim. A tainted set leaves only once the grace ran out (not while a claim allocated
    from an older view is unprepared) and the set is still due; the pair, now held, stays."""
    world = World(AGENTS["the agent's rendering and rule"], lagging_view=True)
    for op, arg in RACE[:3]:
        world.step(op, arg)
    (pair,) = [n for n in world.tainted_since if n.startswith("gpuset-2-")]  # the only pair holding the GPU
    for op, arg in RACE[3:]:
        world.step(op, arg)
        assert world.violation() is None, (op, arg)
    (c2, c3) = world.claims.values()
    assert pair in withdrawing(world.published) and c2.devices == (pair,) and not c3.gpus & c2.gpus
    world.step("expire", 0)
    assert not world.expired, "a claim allocated from a view older than the taint is not prepared yet"
    for op in ("prepare", "prepare", "publish", "land", "expire"):
        world.step(op, 0)
    due = set(world.tainted_since)
    assert due and pair not in due and world.expired == due  # the larger sets holding c2's or c3's GPUs
    world.step("publish", 0)
    world.step("land", 0)
    assert not due & set(set_names(world.published)) and pair in set_names(world.published)
    assert world.violation() is None


def test_race_single_meets_a_tainted_single_whose_counter_still_counts() -> None:
    """RACE_SINGLE with the grace: the singles of the pair's GPUs are published tainted, not
    withdrawn, at the first write; the scheduler hands GPU 0 out as a single from the older view,
    and once it sees the tainted single that single's counter still counts for that claim, so
    the pair (or any set holding GPU 0) goes to no second claim. With the pair's claim gone,
    the singles are ordinary devices again."""
    world = World(AGENTS["the agent's rendering and rule"], lagging_view=True)
    for op, arg in RACE_SINGLE[:3]:
        world.step(op, arg)
    assert {"gpu-0", "gpu-1"} <= set(world.tainted_since)  # the pair's GPUs' singles, tainted
    for op, arg in RACE_SINGLE[3:]:
        world.step(op, arg)
        assert world.violation() is None, (op, arg)
    assert {"gpu-0", "gpu-1"} <= set(withdrawing(world.published))  # what the scheduler saw: tainted, counted
    holders = [c.devices for c in world.claims.values()]
    assert ("gpu-0",) in holders and ("gpuset-2-m3",) not in holders
    for op in ("prepare",) * 5 + ("publish", "land", "land"):
        world.step(op, 0)
    assert not {"gpu-0", "gpu-1"} & set(withdrawing(world.published))
    assert {"gpu-0", "gpu-1"} <= set(device_names(world.published)) and world.violation() is None


@pytest.mark.parametrize("name", sorted(AGENTS))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=LAGGING_OPS)
@example(ops=[*RACE, ("prepare", 0), ("prepare", 1)])
def test_no_gpu_is_ever_prepared_for_two_claims_even_when_the_schedulers_view_lags(
        name: str, ops: list[tuple[str, int]]) -> None:
    """What the agent guarantees under any lag: NodePrepareResources refuses a claim whose GPU
    another prepared claim holds, so at worst a pod fails to start (and is retried)."""
    assert first_prepared_twice(AGENTS[name], ops)[0] is None


def test_the_race_ends_in_a_refused_prepare_not_a_shared_gpu() -> None:
    """Where sets go at once (the API server keeps no taints), RACE does hand GPU 0 to two
    claims at the scheduler (the xfail above); preparing both, the agent serves the first and
    refuses the second, naming the claim that holds GPU 0."""
    agent = AGENTS["the agent, the API server keeping no taints"]
    assert "allocated to claims" in (first_violation(agent, RACE, lagging_view=True) or "")
    problem, world = first_prepared_twice(agent, [*RACE, ("prepare", 0), ("prepare", 0)])
    assert problem is None
    assert [c.state for c in world.claims.values()] == ["prepared", "allocated"], world.claims
    assert world.kubelet is not None and len(world.kubelet.refused) == 1
    first, second = world.claims
    assert f"ResourceClaim default/c{second} " in world.kubelet.refused[0]
    assert f"is held by ResourceClaim default/c{first} (uid uid-{first})" in world.kubelet.refused[0]


def test_the_check_catches_a_rule_that_withdraws_a_held_set() -> None:
    """The same property, with sets withdrawn as soon as the rendering drops them: a prepared
    claim's set is withdrawn, its GPUs' counters are no longer consumed, and the scheduler
    hands them out again. Hypothesis finds such an interleaving (so the test above can fail)."""
    unsafe = Agent(few_best_free_sets, withdraw_at_once)
    ops = find(OPS, lambda ops: first_violation(unsafe, ops) is not None,
               settings=settings(max_examples=2000, deadline=None, database=None,
                                 phases=[Phase.generate, Phase.shrink]))  # 400 missed it about 1 run in 20
    problem = first_violation(unsafe, ops)
    assert problem and "allocated to claims" in problem, (ops, problem)
    # the shortest such story (the shrinker does not always reach it, so it is stated here): a
    # set allocated and prepared, a re-publish that withdraws it, then a single of one of its
    # GPUs allocated again; the agent's rule keeps the set and refuses it
    shortest = [("schedule", 2), ("prepare", 0), ("publish", 0), ("schedule", 1)]
    assert "GPUs [0] allocated to claims c1 ('gpuset-2-m3',) and c2 ('gpu-0',)" in (first_violation(unsafe, shortest) or "")
    assert first_violation(AGENTS["the agent's rendering and rule"], shortest) is None


@pytest.mark.parametrize(("in_use", "server"), [("0,3", "1.37"), ("1,2,5", "1.36"), ("", "1.37"),
                                                ("gpuset-2-mc,5", "1.37")])
def test_the_publisher_the_benches_replay_is_what_slices_in_use_prints(in_use: str, server: str) -> None:
    """``tests/testbed/dra_publishers.py``'s agent publisher (what ``bench_dra_scheduler.py`` and
    ``quality_dra.py`` measure and this module checks) renders what users preview with
    ``gpu-topology-agent slices --in-use LIST --server-version V``: nothing published before
    (the grace on: a GPU held through a set has no single device)."""
    argv = [sys.executable, "-m", "agent", "slices", "--simulate", "dgx-h100", "--node-name", NODE,
            "--server-version", server, *(["--in-use", in_use] if in_use else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    held = {n: tuple(sorted(parse_set_name(n))) for n in in_use.split(",") if
            n.startswith("gpuset-")} | single_gpus([int(i) for i in in_use.split(",") if i.isdigit()])
    assert list(yaml.safe_load_all(proc.stdout)) == PUBLISH(TOPO, NODE, held, (), server, expired=())
    if "gpuset-2-mc" in in_use:
        assert {"gpu-2", "gpu-3"}.isdisjoint(d["name"] for s in yaml.safe_load_all(proc.stdout)
                                             for d in s["spec"].get("devices", []))


def _consumes(slices: list[dict[str, Any]], name: str) -> bool | None:
    for s in slices:
        for d in s["spec"].get("devices", []):
            if d["name"] == name:
                return bool(d.get("consumesCounters"))
    return None


def test_a_single_allocated_without_a_counter_is_counted_when_its_counter_comes_back() -> None:
    """A single GPU consumes its counter only while a published set holds its GPU. BARE_SINGLE
    reaches the case that rule adds: a single allocated while it consumed nothing, its GPU
    then in a published set again while the claim is still allocated; the scheduler (model)
    finds the single's counter in the slices it sees now, so no set holding it is given."""
    world = World(AGENTS["the agent's rendering and rule"])
    bare: dict[int, str] = {}
    counted: list[tuple[int, str]] = []
    for op, arg in BARE_SINGLE:
        before = set(world.claims)
        world.step(op, arg)
        for n in set(world.claims) - before:
            for d in world.claims[n].devices:
                if d.startswith("gpu-") and _consumes(world.published, d) is False:
                    bare[n] = d
        counted += [(n, d) for n, d in bare.items()
                    if n in world.claims and world.claims[n].state == "allocated" and _consumes(world.published, d)]
        assert world.violation() is None, (op, arg)
    assert counted, "the sequence no longer reaches a bare single whose counter comes back"
    n, device = counted[0]
    later = [c for m, c in world.claims.items() if m > n and any(d.startswith("gpuset-") for d in c.devices)]
    assert later and all(world.claims[n].gpus.isdisjoint(c.gpus) for c in later), device


class _HastyWorld(World):
    """A grace that does not outlast the scheduler's lag: ``expire`` ends every withdrawal
    taint's grace at once, whatever the scheduler has seen."""

    def expire(self) -> None:
        self.expired |= set(self.tainted_since)


#: The pair is tainted (W1) and removed (W2) while GPU 0's claim still holds it; the claim
#: ends; the scheduler, which has seen neither write, allocates the pair, then sees W1 and W2.
HASTY = [("schedule", 1), ("prepare", 0), ("publish", 0), ("expire", 0), ("publish", 0), ("unprepare", 0),
         ("deallocate", 0), ("schedule", 2), ("land", 0), ("land", 0), ("schedule", 1)]


def test_the_grace_must_outlast_the_lag_the_check_catches_one_that_does_not() -> None:
    """The ``expire`` event's assumption matters: ending the grace before the scheduler saw
    the taint hands GPU 0 to two claims (as RACE does without the taint)."""
    def run(world: World) -> str | None:
        for op, arg in HASTY:
            world.step(op, arg)
            if world.violation():
                return world.violation()
        return None

    agent = AGENTS["the agent's rendering and rule"]
    assert "allocated to claims" in (run(_HastyWorld(agent, lagging_view=True)) or "")
    assert run(World(agent, lagging_view=True)) is None
