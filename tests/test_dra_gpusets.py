"""GPU sets as partitionable devices (agent.dra.gpusets, agent.dra.slices): the rendered v1
slices pass the API server's rules, and the scheduler's allocator (tests/dra_allocator_model.py)
gives a set claim the device plugin's choice and keeps overlapping claims apart."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import yaml
from allocation_support import best_set, explain, synthetic_islands_topology
from dra_allocator_model import AllocatorModel, gather_pools
from dra_api_validation import default_claim, validate_claim, validate_slice

from agent.cli import main
from agent.discovery import load_topology
from agent.dra.gpusets import gpu_sets, set_sizes
from agent.dra.slices import MAX_DEVICES_WITH_COUNTERS, render_slices
from agent.hw.sim.machines import BUILTIN_MACHINES
from agent.topology.allocator import AllocationEngine

D = "gpu.gpu-agent.io"
NODE = "node-1"
CLASSES_FILE = Path(__file__).resolve().parents[1] / "daemonset" / "dra" / "deviceclass.yaml"
TEMPLATES_FILE = CLASSES_FILE.parent / "examples" / "gpuset-claim-templates.yaml"
CLASSES = {c["metadata"]["name"]: c for c in yaml.safe_load_all(CLASSES_FILE.read_text())}
GPU_CLASS = CLASSES[D]
SET_CLASSES = {n: c for n, c in CLASSES.items() if n == f"gpuset.{D}" or n.startswith("set-of-")}
SET_CLASS = SET_CLASSES[f"gpuset.{D}"]


def count_expr(k):
    return f'device.attributes["{D}"].gpuCount == {k}'


def expression(device_class):
    (selector,) = device_class["spec"]["selectors"]
    return selector["cel"]["expression"]


def is_set(d, k=None):
    """The shipped set classes: healthy GPU sets (of ``k`` GPUs)."""
    return (d.driver == D and d.attributes[D]["type"] == "gpuset" and d.attributes[D]["healthy"]
            and k in (None, d.attributes[D]["gpuCount"]))


# the CEL of the shipped classes and of the tests' and templates' selectors, as predicates
CEL = {expression(GPU_CLASS): lambda d: d.driver == D and d.attributes[D]["type"] == "gpu",
       expression(SET_CLASS): is_set,
       **{expression(SET_CLASSES[f"set-of-{k}.{D}"]): (lambda d, k=k: is_set(d, k)) for k in (2, 4, 8)},
       **{count_expr(k): (lambda d, k=k: d.attributes[D]["gpuCount"] == k) for k in range(2, 65)}}

MACHINES_WITH_SETS = [m for m in BUILTIN_MACHINES if gpu_sets(load_topology(m))
                      and not any(g.mig_enabled for g in load_topology(m).gpus)]


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
                out += [g for g in range(self.topology.gpu_count) if f"gpu-{g}" in self._members(name)]
            else:
                out.append(attrs[f"{D}/index"]["int"])
        return sorted(out)

    def _members(self, name):
        uses = self.devices[name]["consumesCounters"]
        return {c for u in uses for c in u["counters"]}


def topologies():
    out = [(m, load_topology(m)) for m in BUILTIN_MACHINES]
    out += [(f"synthetic-{8 * i}", synthetic_islands_topology(i, 8)) for i in (2, 4, 8)]
    return out


@pytest.mark.parametrize("name,topology", topologies(), ids=[n for n, _ in topologies()])
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
        # publication order: singles first, then sets by size, best first
        order = [d.view.attributes[D] for d in pool.devices]
        sets = [(a["gpuCount"], a["rank"]) for a in order if a["type"] == "gpuset"]
        assert sets == sorted(sets)
        assert all(a["type"] != "gpuset" for a in order[: len(order) - len(sets)])


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
        published = [s.members for s in gpu_sets(topology)[k]]
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
        for s in gpu_sets(topology)[k]:
            if not busy & set(s.members):
                busy.add(s.members[-1])
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
        names = [s.name for s in gpu_sets(topology)[k]]
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
    ("dgx1-v100", [2, 4, 8], [28, 70, 1]),  # 8 GPUs: every set of every size
    ("dgx-h100", [2, 4, 8], [28, 70, 1]),
    ("pcie-4gpu", [2, 4], [6, 1]),
    ("dgx2", [2, 4, 8, 16], [120, 140, 2, 1]),  # pairs: all; quads: inside a NUMA node; halves
])
def test_sizes_and_how_many_sets_each_machine_publishes(machine, sizes, counts):
    sets = gpu_sets(load_topology(machine))
    assert list(sets) == sizes == set_sizes(load_topology(machine))
    assert [len(v) for v in sets.values()] == counts


def test_large_synthetic_nodes_stay_publishable():
    for islands, sets_published in ((2, 263), (4, 526), (8, 804)):
        topology = synthetic_islands_topology(islands, 8)
        assert sum(len(v) for v in gpu_sets(topology).values()) == sets_published
        # 16-GPU sets are unions of two whole NVLink islands, never a straddling mix
        island_of = {g: g // 8 for g in range(topology.gpu_count)}
        for s in gpu_sets(topology).get(16, []):
            assert len({island_of[g] for g in s.members}) == 2


def test_ranks_are_best_first_by_the_device_plugins_criteria():
    topology = load_topology("pcie-pairs")  # NVLink pairs {0,1} {2,3} on NUMA 0, {4,5} {6,7} on 1
    engine = AllocationEngine(topology)
    for k, sets in gpu_sets(topology).items():
        keys = []
        for s in sets:
            c = explain(engine, list(range(8)), list(s.members), k, runners_up=0).chosen
            keys.append((-c.gpuallocator_score, -c.score, c.numa_nodes, c.cut))
        assert keys[1:] == sorted(keys[1:]) and keys[0] == min(keys)  # rank 0: the device plugin's choice
    assert [s.members for s in gpu_sets(topology)[2][:4]] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_set_names_stay_with_their_gpus_while_a_member_is_unhealthy():
    topology = load_topology("dgx-h100")

    def sets(**kw):
        return {d["name"]: d for s in render_slices(topology, node_name=NODE, **kw)
                for d in s["spec"].get("devices", []) if d["name"].startswith("gpuset-")}

    names, sick = sets(), sets(unhealthy={2: "XID 79"})
    assert set(sick) == set(names)
    holding = {n for n, d in names.items() if "gpu-2" in d["consumesCounters"][0]["counters"]}
    assert len(holding) == 7 + 35 + 1
    for n, d in sick.items():
        assert d["consumesCounters"] == names[n]["consumesCounters"]
        assert d.get("taints") == ([{"key": f"{D}/xid", "value": "79", "effect": "NoSchedule"}] if n in holding else None)
    gone = sets(unhealthy={2: "XID 79"}, taint_effect=None, keep={"gpuset-4-3"})
    assert set(names) - set(gone) == holding - {"gpuset-4-3"}
    assert not any("taints" in d for d in gone.values())


@pytest.mark.parametrize("machine", MACHINES_WITH_SETS)
def test_sets_tainted_for_an_unhealthy_gpu_are_never_allocated_and_a_claim_gets_the_next_set(machine):
    topology = load_topology(machine)
    bad = topology.gpu_count // 2
    node = Node(topology, render_slices(topology, node_name=NODE, unhealthy={bad: "XID 79"}))
    for k in set_sizes(topology):
        healthy = [s for s in gpu_sets(topology)[k] if bad not in s.members]
        got = _with(node, claim("c", set_request(k)))
        if not healthy:
            assert got is None
            continue
        # the best set without the unhealthy GPU, as on a node without that GPU
        assert [d for _, d in got[0]] == [(D, NODE, healthy[0].name)], (machine, k)
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
    node = Node(topology, render_slices(topology, node_name=NODE, unhealthy={2: "XID 79"}))
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
