"""GPU sets as partitionable devices (agent.dra.gpusets, agent.dra.slices): the rendered v1
slices pass the API server's rules, and the scheduler's allocator (tests/testbed/dra_allocator_model.py)
gives a set claim the device plugin's choice and keeps overlapping claims apart."""

from __future__ import annotations

import copy
import random

import pytest
import yaml
from dra_api_validation import default_claim, validate_claim, validate_slice

from agent.cli import main
from agent.discovery import load_topology
from agent.dra.devices import parse_set_name, set_name
from agent.dra.gpusets import (
    SETS_PER_SIZE,
    SetPolicy,
    set_sizes,
)
from agent.dra.slices import MAX_DEVICES_WITH_COUNTERS, Occupancy, render_slices
from agent.dra.withdrawal import sets_to_keep
from agent.hw.sim.machines import BUILTIN_MACHINES
from agent.topology.allocator import AllocationEngine
from tests.testbed.allocation_support import best_set, synthetic_islands_topology
from tests.testbed.dra_allocator_model import AllocatorModel, gather_pools
from tests.testbed.dra_shipped_classes import (
    BY_NAME,
    CEL,
    CLASSES_FILE,
    GPU_CLASS,
    check_expressions,
    count_expr,
)

D = "gpu.gpu-agent.io"
NODE = "node-1"
TEMPLATES_FILE = CLASSES_FILE.parent / "examples" / "gpuset-claim-templates.yaml"
CLASSES = BY_NAME
SET_CLASSES = {n: c for n, c in CLASSES.items() if n == f"gpuset.{D}" or n.startswith("set-of-")}


# loaded once at collection (each load builds the simulated machine), read by the parameters
BUILTIN_TOPOLOGIES = {m: load_topology(m) for m in BUILTIN_MACHINES}
MACHINES_WITH_SETS = [m for m, t in BUILTIN_TOPOLOGIES.items() if set_sizes(t)
                      and not any(g.mig_enabled for g in t.gpus)]


def test_the_set_tests_below_run_on_several_built_in_machines():
    # they are parametrized by MACHINES_WITH_SETS: were it empty, pytest would skip them all
    assert len(MACHINES_WITH_SETS) >= 3, MACHINES_WITH_SETS


def published_sets(slices, k):
    """The members of the set devices of ``k`` GPUs in ``slices``, in publication order."""
    return [parse_set_name(d["name"]) for s in slices for d in s["spec"].get("devices", [])
            if d["name"].startswith(f"gpuset-{k}-")]


def set_request(k, name="gpus"):
    return {"name": name, "exactly": {"deviceClassName": f"gpuset.{D}", "count": 1,
                                      "selectors": [{"cel": {"expression": count_expr(k)}}]}}


def singles_request(k, name="gpus"):
    return {"name": name, "exactly": {"deviceClassName": D, "count": k}}


def prioritized(k, name="gpus"):
    return {"name": name, "firstAvailable": [
        {"name": "set", "deviceClassName": f"gpuset.{D}", "selectors": [{"cel": {"expression": count_expr(k)}}]},
        {"name": "singles", "deviceClassName": D, "count": k}]}


def claim(name, *requests):
    obj = default_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                         "metadata": {"name": name, "namespace": "default"},
                         "spec": {"devices": {"requests": list(requests)}}})
    assert validate_claim(obj) == []
    return obj


class Node:
    """A node's v1 slices and the scheduler's allocator over them, with claims kept allocated."""

    def __init__(self, topology, slices=None):
        self.topology = topology
        self.slices = slices if slices is not None else render_slices(topology, node_name=NODE)
        self.devices = {d["name"]: d for s in self.slices for d in s["spec"].get("devices", [])}
        self.allocated: list[tuple[str, str, str]] = []

    def allocate(self, *claims, leak=True):
        model = AllocatorModel(self.slices, [GPU_CLASS, *SET_CLASSES.values()], CEL, self.allocated,
                               leak_rejected_counters=leak)
        got = model.allocate(list(claims), NODE)
        if got is not None:
            self.allocated += [dev for result in got for _, dev in result]
        return got

    def gpus(self, result):
        """The GPU indices a claim's result holds (a set's members, a single's index)."""
        out = []
        for _, (_, _, name) in result:
            attrs = self.devices[name]["attributes"]
            if attrs[f"{D}/type"]["string"] == "gpuset":
                out += parse_set_name(name)
            else:
                out.append(attrs[f"{D}/index"]["int"])
        return sorted(out)


TOPOLOGIES = [*BUILTIN_TOPOLOGIES.items(), *((f"synthetic-{8 * i}", synthetic_islands_topology(i, 8)) for i in (2, 4, 8))]


@pytest.mark.parametrize("name,topology", TOPOLOGIES, ids=[n for n, _ in TOPOLOGIES])
def test_every_rendered_slice_passes_the_api_rules_and_forms_one_valid_pool(name, topology):
    for unhealthy in ((), (1,)):
        objs = render_slices(topology, node_name=NODE, unhealthy=unhealthy)
        for obj in objs:
            assert validate_slice(obj) == [], (name, obj["metadata"]["name"])
            devices = obj["spec"].get("devices", [])
            if any("consumesCounters" in d for d in devices):
                assert len(devices) <= MAX_DEVICES_WITH_COUNTERS
        names = [o["metadata"]["name"] for o in objs]
        assert names == sorted(names) and len(set(names)) == len(names)
        assert {o["spec"]["pool"]["resourceSliceCount"] for o in objs} == {len(objs)}
        (pool,) = gather_pools(objs, NODE)
        assert not pool.invalid and not pool.incomplete
        # publication order: sets first, largest size first (best first within a size), then singles;
        # in one device slice the first single GPU leads (a one-GPU claim takes it at once)
        order = [d.view.attributes[D] for d in pool.devices]
        sets = [a["gpuCount"] for a in order if a["type"] == "gpuset"]
        assert sets == sorted(sets, reverse=True)
        assert all(set(a) == {"type", "gpuCount", "healthy"} for a in order if a["type"] == "gpuset")
        lead = 1 if sum(1 for o in objs if "devices" in o["spec"]) == 1 else 0
        assert all(a["type"] != "gpuset" for a in order[:lead])
        assert all(a["type"] == "gpuset" for a in order[lead : lead + len(sets)])


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_a_set_claim_gets_the_device_plugins_choice_on_an_empty_node(machine):
    topology = load_topology(machine)
    engine = AllocationEngine(topology)
    for k in set_sizes(topology):
        node = Node(topology)
        (result,) = node.allocate(claim("c", set_request(k)))
        assert node.gpus(result) == best_set(engine, list(range(topology.gpu_count)), [], k), (machine, k)


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_a_second_claim_cannot_get_any_gpu_of_an_allocated_set(machine):
    topology = load_topology(machine)
    for k in set_sizes(topology):
        node = Node(topology)
        (first,) = node.allocate(claim("a", set_request(k)))
        held = set(node.gpus(first))
        rest = topology.gpu_count - k
        while True:  # sets of every size, then singles, until nothing is left
            got = next((r for size in [*set_sizes(topology), 1] for r in
                        [node.allocate(claim("b", set_request(size) if size > 1 else singles_request(1)))]
                        if r is not None), None)
            if got is None:
                break
            gpus = set(node.gpus(got[0]))
            assert not gpus & held, (machine, k, sorted(held), sorted(gpus))
            held |= gpus
            rest -= len(gpus)
        assert rest == 0


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_a_single_allocated_first_changes_which_set_comes_next(machine):
    topology = load_topology(machine)
    node = Node(topology)
    empty_best = {k: node.gpus(Node(topology).allocate(claim("c", set_request(k)))[0]) for k in set_sizes(topology)}
    (single,) = node.allocate(claim("s", singles_request(1)))
    (gpu,) = node.gpus(single)
    for k in set_sizes(topology):
        if k == topology.gpu_count:
            assert node.allocate(claim("c", set_request(k))) is None  # the whole node is not free
            continue
        (got,) = _with(node, claim("c", set_request(k)))
        members = node.gpus(got)
        assert gpu not in members
        published = published_sets(node.slices, k)
        assert tuple(members) == next(s for s in published if gpu not in s)
        if gpu in empty_best[k]:
            assert members != empty_best[k]


def _with(node, c):
    """Allocate ``c`` over ``node`` without keeping it."""
    kept = list(node.allocated)
    try:
        return node.allocate(c)
    finally:
        node.allocated = kept


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_a_prioritized_list_falls_back_to_singles_when_no_set_is_free(machine):
    topology = load_topology(machine)
    for k in set_sizes(topology):
        node = Node(topology)
        (got,) = _with(node, claim("c", prioritized(k)))
        assert [req for req, _ in got] == ["gpus/set"]
        # one single out of every set of size k (those sets stay busy), k GPUs still free
        busy: set[int] = set()
        for members in published_sets(node.slices, k):
            if not busy & set(members):
                busy.add(members[-1])
        if topology.gpu_count - len(busy) < k:
            continue
        node.allocated += [(D, NODE, f"gpu-{g}") for g in busy]
        (got,) = node.allocate(claim("c", prioritized(k)))
        assert [req for req, _ in got] == ["gpus/singles"] * k
        assert not set(node.gpus(got)) & busy


def tainted(slices, names, effect="NoSchedule"):
    """``slices`` with a taint on the devices ``names``."""
    out = copy.deepcopy(slices)
    for s in out:
        for d in s["spec"].get("devices", []):
            if d["name"] in names:
                d["taints"] = [{"key": f"{D}/xid", "value": "79", "effect": effect}]
    return out


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_a_tainted_set_is_never_allocated(machine):
    topology = load_topology(machine)
    for k in set_sizes(topology):
        names = [set_name(m) for m in published_sets(render_slices(topology, node_name=NODE), k)]
        for effect in ("NoSchedule", "NoExecute"):
            node = Node(topology, tainted(render_slices(topology, node_name=NODE), {names[0]}, effect))
            for _ in range(len(names)):
                got = node.allocate(claim("c", set_request(k)))
                if got is None:
                    break
                assert got[0][0][1][2] != names[0]
            everything = Node(topology, tainted(render_slices(topology, node_name=NODE), set(names), effect))
            assert everything.allocate(claim("c", set_request(k))) is None


def test_sets_are_left_out_of_older_api_versions_and_the_slices_command_says_so(capsys):
    for version in ("v1beta2", "v1beta1"):
        assert main(["slices", "--simulate", "dgx-h100", "--node-name", NODE, "--api-version", version]) == 0
        out = capsys.readouterr()
        docs = list(yaml.safe_load_all(out.out))
        assert docs == render_slices(load_topology("dgx-h100"), node_name=NODE, api_version=version)
        assert "gpuset" not in out.out and "sharedCounters" not in out.out
        assert f"resource.k8s.io/{version} has no partitionable devices" in out.err


def test_the_slices_command_renders_exactly_what_is_published_in_v1(capsys):
    assert main(["slices", "--simulate", "dgx2", "--node-name", NODE, "--api-version", "v1"]) == 0
    out = capsys.readouterr()
    docs = list(yaml.safe_load_all(out.out))
    assert docs == render_slices(load_topology("dgx2"), node_name=NODE, api_version="v1")
    assert "sharedCounters" in docs[0]["spec"]
    assert "DRAPartitionableDevices" in out.err and "single GPUs only" in out.err


@pytest.mark.parametrize("machine,sizes,counts", [
    ("dgx1-v100", [2, 4, 8], [4, 2, 1]),  # per size, the device plugin's disjoint choices, at most 4
    ("dgx-h100", [2, 4, 8], [4, 2, 1]),
    ("pcie-4gpu", [2, 4], [2, 1]),
    ("dgx2", [2, 4, 8, 16], [4, 4, 2, 1]),
])
def test_sizes_and_how_many_sets_each_machine_publishes(machine, sizes, counts):
    slices = render_slices(load_topology(machine), node_name=NODE)
    assert set_sizes(load_topology(machine)) == sizes
    assert [len(published_sets(slices, k)) for k in sizes] == counts


@pytest.mark.parametrize("islands", [2, 4, 8])
def test_large_synthetic_nodes_publish_a_few_sets_a_size(islands):
    topology = synthetic_islands_topology(islands, 8)
    slices = render_slices(topology, node_name=NODE)
    sizes = set_sizes(topology)
    for k in sizes:
        sets = published_sets(slices, k)
        assert 1 <= len(sets) <= SETS_PER_SIZE and len(set(sets)) == len(sets)
    # no more sets in all than the disjoint choices per size, at most 4 a size, would be
    assert sum(len(published_sets(slices, k)) for k in sizes) <= sum(min(SETS_PER_SIZE, 8 * islands // k)
                                                                      for k in sizes)
    if islands == 8:  # 64 GPUs: 64 singles and 16 sets, in two device slices
        assert len(slices) == 3 and sum(len(s["spec"].get("devices", [])) for s in slices) == 64 + 16


@pytest.mark.parametrize("machine,held", [("dgx-h100", [1]), ("dgx-h100", [0, 5, 6]), ("dgx1-v100", [0, 2, 4]),
                                          ("dgx2", [0, 1, 2, 9]), ("pcie-pairs", [3])])
def test_the_first_set_of_each_size_is_what_allocate_available_gives_on_the_free_gpus(machine, held, capsys):
    topology = load_topology(machine)
    free = [i for i in range(topology.gpu_count) if i not in held]
    assert main(["slices", "--simulate", machine, "--node-name", NODE, "--in-use", ",".join(map(str, held))]) == 0
    slices = list(yaml.safe_load_all(capsys.readouterr().out))
    for k in set_sizes(topology):
        sets = published_sets(slices, k)
        if k > len(free):
            assert sets == []
            continue
        chosen = allocate_available(machine, free, k, capsys)
        assert sets[0] == chosen, (machine, held, k)
        # the next ones: the policy's choice on the free GPUs less a set or GPU a claim may have
        # taken first, or its next disjoint choices
        policy = SetPolicy(topology)
        taken = [(policy.choose(free, 1), *(policy.choose(free, j) for j in set_sizes(topology) if j <= len(free)))]
        conditional = {policy.choose([g for g in free if g not in t], k) for t in taken[0]
                       if len(free) - len(t) >= k}
        assert set(sets[1:]) <= conditional | set(policy.sequence(free, k, SETS_PER_SIZE)), (machine, held, k)


def allocate_available(machine, free, k, capsys):
    """``allocate --available FREE --size k``: the device plugin's choice, ascending indices."""
    assert main(["allocate", "--simulate", machine, "--size", str(k), "--available", ",".join(map(str, free))]) == 0
    out = capsys.readouterr().out
    return tuple(sorted(int(i) for i in out.split("indices")[1].split("\n")[0].strip(" []").split(",")))


@pytest.mark.parametrize("machine,held", [("dgx-h100", []), ("dgx2", []), ("dgx-h100", [1]),
                                          ("dgx1-v100", [0, 2, 4]), ("pcie-pairs", [3])])
def test_after_a_claim_the_agent_has_not_heard_of_the_next_first_fit_is_allocate_available_on_the_rest(
        machine, held, capsys):
    """The scheduler allocates before the agent re-renders: a claim took the first single GPU or
    the first set of its size; the next claim's first free set of each size is then the device
    plugin's choice on the GPUs left (where the sets a size may have allow it: not on every
    occupancy, e.g. dgx1-v100 empty, a pair after a set of 4)."""
    topology = load_topology(machine)
    free = [i for i in range(topology.gpu_count) if i not in held]
    assert main(["slices", "--simulate", machine, "--node-name", NODE, "--in-use", ",".join(map(str, held))]) == 0
    slices = list(yaml.safe_load_all(capsys.readouterr().out))
    singles = [d["attributes"][f"{D}/index"]["int"] for s in slices for d in s["spec"].get("devices", [])
               if d["attributes"][f"{D}/type"]["string"] == "gpu"]
    sizes = set_sizes(topology)
    firsts = [(singles[0],), *(published_sets(slices, j)[0] for j in sizes if j <= len(free))]
    checked = 0
    for taken in firsts:
        left = [g for g in free if g not in taken]
        for k in (k for k in sizes if k <= len(left)):
            first_fit = next(s for s in published_sets(slices, k) if set(s).isdisjoint(taken))
            assert first_fit == allocate_available(machine, left, k, capsys), (machine, held, taken, k)
            checked += 1
    assert checked >= 3


def test_a_published_set_stays_until_a_member_is_held_through_another_device():
    published = ["gpuset-2-m3", "gpuset-2-mc", "gpuset-4-mf", "gpuset-8-mff", "gpuset-4-0"]
    # nothing held: every set of ours stays (a claim the agent has not heard of may hold any)
    assert [s.name for s in sets_to_keep(published, {})] == sorted(published[:4])
    # GPU 0 held by a single: every set with GPU 0 may go; the held set itself stays
    assert [s.name for s in sets_to_keep(published, {"gpu-0": (0,)})] == ["gpuset-2-mc"]
    assert [s.name for s in sets_to_keep(published, {"gpuset-4-mf": (0, 1, 2, 3)})] == ["gpuset-4-mf"]
    # rendered: the held set stays published though its GPUs are not free, the others follow
    topology = load_topology("dgx-h100")
    occupancy = Occupancy({"gpuset-4-mf": (0, 1, 2, 3)}, published)
    names = [d["name"] for s in render_slices(topology, node_name=NODE, occupancy=occupancy)
             for d in s["spec"].get("devices", [])]
    assert "gpuset-4-mf" in names and "gpuset-2-m3" not in names and "gpuset-8-mff" not in names
    assert names.index("gpuset-4-mf0") < names.index("gpuset-4-mf")  # the free set first


def test_a_set_tainted_for_withdrawal_stays_tainted_once_free_unless_chosen_again_then_goes_after_its_grace():
    """A due set (a member held through another device) is published tainted; once its GPUs are
    free again it stays tainted while the policy does not choose it (what a lagging claim finds
    is what withdrawing at once leaves), until its grace runs out; chosen again, it is an
    ordinary set."""
    topology = load_topology("dgx-h100")

    def render(held, published, expired=(), tainted=()):
        slices = render_slices(topology, node_name=NODE, occupancy=Occupancy(held, published, expired, tainted))
        devices = {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}
        return devices, {n for n, d in devices.items()
                         if any(t["key"] == f"{D}/withdrawn" for t in d.get("taints") or ())}

    empty, _ = render({}, [])
    published = [n for n in empty if n.startswith("gpuset-")]
    cases = 0
    for name in published:
        members = parse_set_name(name)
        other = {f"gpu-{g}": (g,) for g in range(8) if g not in members}
        for device, gpus in other.items():
            devices, withdrawn = render({f"gpu-{members[0]}": (members[0],)}, published)
            assert name in withdrawn  # held through another device: tainted, still published
            chosen, _ = render({device: gpus}, [])  # what the policy publishes with its GPUs free
            if name in chosen:
                continue
            cases += 1
            devices, withdrawn = render({device: gpus}, published, (), [name])
            assert name in devices and name in withdrawn  # free, not chosen: stays tainted
            # ... and unhealthy: no shipped class selects it, so no allocator reserves its counters
            assert devices[name]["attributes"][f"{D}/healthy"] == {"bool": False}
            devices, _ = render({device: gpus}, published, [name], [name])
            assert name not in devices  # its grace ran out
            break
    assert cases >= 2  # on dgx-h100, two of the empty node's sets are free but not chosen with one GPU held
    # chosen again (nothing held, the empty node's choices): an ordinary set
    devices, withdrawn = render({}, published, (), published)
    assert set(published) <= set(devices) and not withdrawn & set(published)
    assert all(devices[n]["attributes"][f"{D}/healthy"] == {"bool": True} for n in published)


def test_every_expression_of_the_shipped_classes_has_its_predicate_in_the_tests():
    assert check_expressions() == []


def _devices(slices):
    return [d for s in slices for d in s["spec"].get("devices", [])]


def test_a_gpu_held_through_a_set_says_so_and_the_gpu_class_skips_it_before_any_counter_is_compared():
    """GPUs 0-3 held through their set, 4-7 held one by one: no GPU is free. A one-GPU claim
    fails either way (the set's counters block 0-3); the shipped class refuses 0-3 by
    ``heldBySet`` before the allocator compares counters for them, where a class without that
    clause compares every counter the node declares for each."""
    topology = load_topology("dgx-h100")
    held = {"gpuset-4-mf": (0, 1, 2, 3), **{f"gpu-{g}": (g,) for g in range(4, 8)}}
    slices = render_slices(topology, node_name=NODE, occupancy=Occupancy(held, ["gpuset-4-mf"]))
    marks = {d["name"]: d["attributes"][f"{D}/heldBySet"] for d in _devices(slices) if d["name"].startswith("gpu-")}
    assert marks == {f"gpu-{g}": {"bool": g < 4} for g in range(8)}
    allocated = [(D, NODE, name) for name in held]
    plain = 'device.driver == "gpu.gpu-agent.io" && device.attributes["gpu.gpu-agent.io"].type == "gpu"'
    old_class = {**GPU_CLASS, "spec": {"selectors": [{"cel": {"expression": plain}}]}}
    cel = {**CEL, plain: lambda d: d.driver == D and d.attributes[D]["type"] == "gpu"}
    work = {}
    for label, cls in (("shipped", GPU_CLASS), ("without heldBySet", old_class)):
        model = AllocatorModel(slices, [cls], cel, allocated)
        assert model.allocate([claim("one", singles_request(1))], NODE) is None
        work[label] = model.work.counter_checks
    # the node declares the counters of GPUs 0-3 only, where the set and its singles meet
    declared = [c for s in slices for cs in s["spec"].get("sharedCounters", []) for c in cs["counters"]]
    assert declared == [f"gpu-{g}" for g in range(4)]
    assert work == {"shipped": 0, "without heldBySet": 4 * len(declared)}
    # freed: the marks go with the claim, and the GPU class selects the GPUs again
    slices = render_slices(topology, node_name=NODE, occupancy=Occupancy({}, ["gpuset-4-mf"]))
    assert all(d["attributes"][f"{D}/heldBySet"] == {"bool": False} for d in _devices(slices)
               if d["name"].startswith("gpu-"))
    (result,) = Node(topology, slices).allocate(claim("one", singles_request(1)))
    assert len(result) == 1
    # without sets (single GPUs only) the attribute is left out: the class's has() takes it as false
    singles_only = render_slices(topology, node_name=NODE, with_sets=False)
    assert all(f"{D}/heldBySet" not in d["attributes"] for d in _devices(singles_only))


def test_a_single_gpu_held_through_a_set_goes_in_two_steps_and_one_already_out_stays_out():
    topology = load_topology("dgx-h100")
    held = {"gpuset-4-mf": (0, 1, 2, 3)}
    everything = [d["name"] for d in _devices(render_slices(topology, node_name=NODE))]
    singles = [n for n in everything if n.startswith("gpu-")]
    sets = [n for n in everything if n.startswith("gpuset-")]

    def render(expired=(), published_singles=tuple(singles), **kwargs):
        occupancy = Occupancy(held, sets, expired, (), published_singles)
        found = {d["name"]: d for d in _devices(render_slices(topology, node_name=NODE, occupancy=occupancy, **kwargs))}
        return {n: bool(found[n].get("taints")) for n in found if n.startswith("gpu-")}

    members = {f"gpu-{g}" for g in range(4)}
    first = render()  # published now: tainted (the grace starts)
    assert set(first) == set(singles) and {n for n, t in first.items() if t} == members
    later = render(expired=["gpu-0", "gpu-1"])  # their grace ran out: out; the others still tainted
    assert set(later) == set(singles) - {"gpu-0", "gpu-1"} and {n for n, t in later.items() if t} == {"gpu-2", "gpu-3"}
    out = render(published_singles=[n for n in singles if n not in members])  # out already: stays out
    assert set(out) == set(singles) - members and not any(out.values())
    # no grace (None), the pool's singles unknown, or no taints kept: every single stays published
    assert set(render(expired=None)) == set(singles)
    assert set(render(published_singles=None)) == set(singles)
    assert set(render(published_singles=(), taint_effect=None)) == set(singles)


def test_sets_being_withdrawn_come_after_the_single_gpus_so_a_claim_that_finds_a_gpu_never_walks_them():
    topology = load_topology("dgx-h100")
    empty = [d["name"] for d in _devices(render_slices(topology, node_name=NODE))]
    published = [n for n in empty if n.startswith("gpuset-")]
    held = {"gpu-0": (0,)}
    slices = render_slices(topology, node_name=NODE, occupancy=Occupancy(held, published, (), ()))
    devices = _devices(slices)
    tainted = [i for i, d in enumerate(devices) if d.get("taints")]
    singles = [i for i, d in enumerate(devices) if d["name"].startswith("gpu-")]
    assert tainted and min(tainted) > max(singles)  # every set with GPU 0 is due, and last
    assert tainted == list(range(len(devices) - len(tainted), len(devices)))
    model = AllocatorModel(slices, [GPU_CLASS], CEL, [(D, NODE, "gpu-0")])
    (result,) = model.allocate([claim("one", singles_request(1))], NODE)
    assert result == [("gpus", (D, NODE, devices[0]["name"]))] and devices[0]["name"] == "gpu-1"
    assert model.work.cel_evaluations == 1  # the first single GPU leads: the claim walks nothing else
    # taken by a claim the agent has not heard of, the next claim walks the sets, then the next single
    model = AllocatorModel(slices, [GPU_CLASS], CEL, [(D, NODE, "gpu-0"), (D, NODE, "gpu-1")])
    (result,) = model.allocate([claim("one", singles_request(1))], NODE)
    assert result == [("gpus", (D, NODE, devices[1 + untainted(devices)]["name"]))]
    assert model.work.cel_evaluations == untainted(devices) + 1


def untainted(devices):
    return sum(1 for d in devices if d["name"].startswith("gpuset-") and not d.get("taints"))


def test_set_names_say_their_members():
    assert [set_name(m) for m in [(0, 1), (4, 5), (0, 1, 2, 3), tuple(range(64))]] == [
        "gpuset-2-m3", "gpuset-2-m30", "gpuset-4-mf", "gpuset-64-mffffffffffffffff"]
    assert all(parse_set_name(set_name(m)) == m for m in [(0, 1), (3, 17, 40, 63)])
    assert [parse_set_name(n) for n in ["gpuset-4-0", "gpuset-3-mf", "gpuset-4-m0f", "gpu-3", "gpuset-2-mg"]] == [
        None] * 5


def test_sets_published_before_a_gpu_went_unhealthy_stay_tainted():
    topology = load_topology("dgx-h100")

    def sets(**kw):
        return {d["name"]: d for s in render_slices(topology, node_name=NODE, **kw)
                for d in s["spec"].get("devices", []) if d["name"].startswith("gpuset-")}

    names = sets()
    sick = sets(unhealthy={2: "XID 79"}, occupancy=Occupancy(published=list(names)))
    assert set(names) <= set(sick)
    holding = {n for n in names if 2 in parse_set_name(n)}
    assert len(holding) == 4  # two pairs (sets of a size may overlap), a quad, the eight
    for n, d in sick.items():
        assert d.get("taints") == ([{"key": f"{D}/xid", "value": "79", "effect": "NoSchedule"}] if n in holding else None)
    gone = sets(unhealthy={2: "XID 79"}, taint_effect=None, keep={"gpuset-4-mf"},
                occupancy=Occupancy(published=list(names)))
    assert set(names) - set(gone) == holding - {"gpuset-4-mf"}
    assert not any("taints" in d for d in gone.values())


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_sets_tainted_for_an_unhealthy_gpu_are_never_allocated_and_a_claim_gets_the_next_set(machine):
    topology = load_topology(machine)
    bad = topology.gpu_count // 2
    node = Node(topology, render_slices(topology, node_name=NODE, unhealthy={bad: "XID 79"}))
    for k in set_sizes(topology):
        free = [i for i in range(topology.gpu_count) if i != bad]
        got = _with(node, claim("c", set_request(k)))
        if k > len(free):
            assert got is None
            continue
        # the best set without the unhealthy GPU, as on a node without that GPU
        assert [d for _, d in got[0]] == [(D, NODE, set_name(SetPolicy(topology).choose(free, k)))], (machine, k)
        assert bad not in node.gpus(got[0])
    assert _with(node, claim("c", singles_request(topology.gpu_count))) is None
    assert bad not in node.gpus(_with(node, claim("c", singles_request(topology.gpu_count - 1)))[0])


def template_claim(name):
    """The shipped example ResourceClaimTemplate ``name``'s claim, as the API server stores it."""
    (template,) = [t for t in yaml.safe_load_all(TEMPLATES_FILE.read_text()) if t["metadata"]["name"] == name]
    return claim(name, *template["spec"]["spec"]["devices"]["requests"]) | {
        "spec": {"devices": dict(template["spec"]["spec"]["devices"])}}


def test_the_shipped_set_templates_are_valid_claims_and_get_the_best_free_set_of_4():
    templates = [t["metadata"]["name"] for t in yaml.safe_load_all(TEMPLATES_FILE.read_text())]
    assert templates == ["best-set-of-4", "set-of-4-or-one-numa-node-or-any", "set-of-4-or-any"]
    topology = load_topology("dgx-h100")
    best = best_set(AllocationEngine(topology), list(range(8)), [], 4)
    for name in templates:
        c = default_claim(template_claim(name))
        assert validate_claim(c) == [], name
        node = Node(topology)
        (got,) = node.allocate(c)
        assert node.gpus(got) == best and [req for req, _ in got] in (["gpus"], ["gpus/set"]), name


def test_a_pod_asking_for_the_extended_resource_set_of_4_gets_one_set_device_of_4():
    # the scheduler turns `gpu.gpu-agent.io/set-of-4: 1` into a claim for one device of the
    # class naming that extended resource (KEP-5004)
    (cls,) = [c for c in SET_CLASSES.values() if c["spec"].get("extendedResourceName") == f"{D}/set-of-4"]
    topology = load_topology("dgx-h100")
    node = Node(topology)
    (got,) = node.allocate(claim("pod-extended-resources", {
        "name": "container-0-request-0", "exactly": {"deviceClassName": cls["metadata"]["name"], "count": 1}}))
    assert node.gpus(got) == best_set(AllocationEngine(topology), list(range(8)), [], 4)


def test_the_prioritized_template_falls_back_tier_by_tier_and_v0_36_2_leaks_the_middle_tier():
    topology = load_topology("dgx2")  # 16 GPUs, NUMA nodes of 8; sets of 4 inside a NUMA node
    numa = {g.index: g.numa_node for g in topology.gpus}
    nodes = sorted(set(numa.values()))
    # 5 busy GPUs on each NUMA node: 3 free on each, no set of 4 and no NUMA node with 4 free
    busy = [g for n in nodes for g in [i for i in range(16) if numa[i] == n][:5]]
    node = Node(topology)
    node.allocated = [(D, NODE, f"gpu-{g}") for g in busy]
    c = default_claim(template_claim("set-of-4-or-one-numa-node-or-any"))
    (got,) = _with_leak(node, c, leak=False)  # kubernetes#140431 (the fix)
    assert [req for req, _ in got] == ["gpus/any"] * 4 and not set(node.gpus(got)) & set(busy)
    assert _with_leak(node, c, leak=True) is None  # v0.36.2: kubernetes#140436
    (got,) = _with_leak(node, default_claim(template_claim("set-of-4-or-any")), leak=True)
    assert [req for req, _ in got] == ["gpus/any"] * 4
    # a NUMA node with 4 free GPUs: then a set of 4 is free, and the first tier takes it
    node.allocated = node.allocated[:-1]
    (got,) = _with_leak(node, c, leak=True)
    assert [req for req, _ in got] == ["gpus/set"]


def _with_leak(node, c, leak):
    kept = list(node.allocated)
    try:
        return node.allocate(c, leak=leak)
    finally:
        node.allocated = kept


@pytest.mark.parametrize("machine", ["dgx-h100", "dgx2"])
def test_a_tainted_set_never_holds_counters_in_a_search_so_v0_36_2_schedules_what_the_fix_does(machine):
    # kubernetes#140436: v0.36.2 keeps the counters of a device its taint rejected. The set
    # classes select healthy sets only, so a tainted set is never reserved: with one GPU
    # unhealthy, every [set -> singles] claim the fixed allocator schedules, v0.36.2 does too.
    topology = load_topology(machine)
    n, rng = topology.gpu_count, random.Random(2026)
    before = [d["name"] for s in render_slices(topology, node_name=NODE) for d in s["spec"].get("devices", [])]
    node = Node(topology, render_slices(topology, node_name=NODE, unhealthy={2: "XID 79"},
                                        occupancy=Occupancy(published=before)))
    unhealthy_sets = {d["name"] for d in node.devices.values() if "taints" in d and d["name"].startswith("gpuset-")}
    assert unhealthy_sets and all(not node.devices[s]["attributes"][f"{D}/healthy"]["bool"] for s in unhealthy_sets)
    tried = 0
    for _ in range(60):
        for k in (2, 4):
            busy = rng.sample([i for i in range(n) if i != 2], rng.randint(0, n - 1 - k))
            node.allocated = [(D, NODE, f"gpu-{b}") for b in busy]
            fixed = _with_leak(node, claim("c", prioritized(k)), leak=False)
            leaky = _with_leak(node, claim("c", prioritized(k)), leak=True)
            assert fixed is not None  # k healthy GPUs are free
            assert leaky == fixed
            assert 2 not in node.gpus(fixed[0]) and not set(node.gpus(fixed[0])) & set(busy)
            tried += 1
    assert tried == 120


@pytest.mark.parametrize("flags,says", [
    (["--in-use", "8"], "--in-use: '8' is none of this machine's GPUs (indices 0-7"),
    (["--in-use", "0,,1"], "--in-use: empty item in '0,,1'"),
    (["--in-use", "GPU-nope"], "--in-use: 'GPU-nope' is none of this machine's GPUs"),
    (["--in-use", "gpuset-4-0"], "--in-use: 'gpuset-4-0' is none of this machine's GPUs"),
    (["--in-use", "1,gpuset-2-m3"], "--in-use: GPU 1 is held twice (gpu-1, gpuset-2-m3)"),
    (["--server-version", "1.x"], "--server-version '1.x': expected a Kubernetes version such as 1.36 or 1.37"),
    (["--server-version", ""], "--server-version '': expected a Kubernetes version"),
])
def test_slices_refuses_a_bad_in_use_list_or_server_version_with_exit_2_and_one_line(flags, says, capsys):
    assert main(["slices", "--simulate", "dgx-h100", "--node-name", NODE, *flags]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and says in out.err


@pytest.mark.parametrize("command,twice,says", [
    ("allocate --size 1 --available", "1,2,1", "available: device ID '{uuid}' given twice"),
    ("slices --in-use", "1,2,1", "--in-use: device 'gpu-1' given twice"),
    ("allocate --size 1 --available", "{uuid},1", "available: device ID '{uuid}' given twice ('{uuid}', '1')"),
    ("slices --in-use", "{uuid},1", "--in-use: device 'gpu-1' given twice ('{uuid}', '1')"),
    ("slices --in-use", "gpu-1,2,1", "--in-use: device 'gpu-1' given twice ('gpu-1', '1')"),
])
def test_slices_in_use_refuses_a_device_given_twice_as_allocate_available_does(command, twice, says, capsys):
    uuid = load_topology("dgx-h100").gpus[1].uuid
    argv = [*command.split(), twice.format(uuid=uuid), "--simulate", "dgx-h100", "--node-name", NODE][
        :None if command.startswith("slices") else -2]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [f"gpu-topology-agent {argv[0]}: error: {says.format(uuid=uuid)}"], out.err


def test_slices_in_use_takes_indices_uuids_and_device_names_alike(capsys):
    topology = load_topology("dgx-h100")
    outputs = []
    for held in ("2,3", f"{topology.gpus[2].uuid},gpu-3", "gpuset-2-mc"):
        assert main(["slices", "--simulate", "dgx-h100", "--node-name", NODE, "--in-use", held]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert [d["name"] for s in yaml.safe_load_all(outputs[0]) for d in s["spec"].get("devices", [])
            if not d["name"].startswith("gpuset-")][0] == "gpu-0"
    def names(text: str) -> set[str]:
        return {d["name"] for s in yaml.safe_load_all(text) for d in s["spec"].get("devices", [])}

    # a held set stays published; GPUs 2 and 3 held as singles withdraw it
    assert "gpuset-2-mc" in names(outputs[2]) and "gpuset-2-mc" not in names(outputs[0])
    assert main(["slices", "--simulate", "dgx-h100", "--node-name", NODE, "--server-version", "1.36"]) == 0
    out = capsys.readouterr()
    assert "gpuset" not in out.out and "sharedCounters" not in out.out
    assert "GPU sets not published: dra.gpuSets is auto and the API server is Kubernetes 1.36" in out.err
