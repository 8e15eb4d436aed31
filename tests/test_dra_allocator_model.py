"""The allocator model (tests/testbed/dra_allocator_model.py) and the API rules (dra_api_validation.py)
keep the upstream semantics their docstrings name: checked here on small hand-made pools."""

from __future__ import annotations

import pytest
from dra_api_validation import default_claim, validate_claim, validate_slice

from tests.testbed.dra_allocator_model import (
    AllocationError,
    AllocatorModel,
    NotModelled,
    gather_pools,
)

D = "x.example.com"
CLASS = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "x"},
         "spec": {"selectors": [{"cel": {"expression": "x"}}]}}
CEL = {"x": lambda d: d.driver == D,
       "big": lambda d: d.attributes[D].get("size", 0) >= 2,
       "one": lambda d: d.attributes[D].get("size", 0) == 1}


def dev(name, counters=(), taints=(), **attrs):
    d = {"name": name, "attributes": {k: {"int": v} for k, v in attrs.items()}}
    if counters:
        d["consumesCounters"] = [{"counterSet": "cs", "counters": {c: {"value": "1"} for c in counters}}]
    if taints:
        d["taints"] = list(taints)
    return d


def slice_(name, devices=None, counters=None, pool="p", driver=D, count=1, generation=1):
    spec = {"driver": driver, "nodeName": "n", "pool": {"name": pool, "generation": generation,
                                                         "resourceSliceCount": count}}
    if counters is not None:
        spec["sharedCounters"] = [{"name": "cs", "counters": {c: {"value": "1"} for c in counters}}]
    else:
        spec["devices"] = devices
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


def claim(name, *requests, constraints=()):
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
           "spec": {"devices": {"requests": list(requests), "constraints": list(constraints)}}}
    return default_claim(obj)


def exactly(name, count=1, selectors=(), tolerations=()):
    body = {"deviceClassName": "x", "count": count}
    if selectors:
        body["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if tolerations:
        body["tolerations"] = list(tolerations)
    return {"name": name, "exactly": body}


def first_available(name, *subs):
    return {"name": name, "firstAvailable": [{"name": n, "deviceClassName": "x", "count": c,
                                              "selectors": [{"cel": {"expression": s}} for s in sel]}
                                             for n, c, sel in subs]}


def names(result):
    return [(req, dev_id[2]) for req, dev_id in result]


def allocate(slices, *claims, allocated=(), leak=True):
    model = AllocatorModel(slices, [CLASS], CEL, allocated, leak_rejected_counters=leak)
    got = model.allocate(list(claims), "n")
    return None if got is None else [names(r) for r in got]


def test_slices_are_walked_by_name_and_pools_by_driver_then_name():
    slices = [slice_("b", [dev("b0")], pool="p2"), slice_("z", [dev("z0")], pool="p1", count=2),
              slice_("a", [dev("a0")], pool="p1", count=2)]
    assert [d.id[2] for p in gather_pools(slices, "n") for d in p.devices] == ["a0", "z0", "b0"]
    assert allocate(slices, claim("c", exactly("r", 2))) == [[("r", "a0"), ("r", "z0")]]


def test_an_incomplete_pool_and_an_older_generation_are_not_allocated_from():
    slices = [slice_("a", [dev("a0")], pool="p1", count=2), slice_("b", [dev("b0")], pool="p2", generation=1),
              slice_("c", [dev("c0")], pool="p2", generation=2)]
    assert allocate(slices, claim("c", exactly("r", 1))) == [[("r", "c0")]]
    assert allocate(slices, claim("c", exactly("r", 2))) is None


def test_counters_block_overlapping_devices_and_count_what_was_allocated_before():
    slices = [slice_("0", counters=["g0", "g1"], count=2),
              slice_("1", [dev("pair", ["g0", "g1"], size=2), dev("g0", ["g0"], size=1), dev("g1", ["g1"], size=1)],
                     count=2)]
    assert allocate(slices, claim("c", exactly("r", 2))) == [[("r", "g0"), ("r", "g1")]]
    assert allocate(slices, claim("a", exactly("r", 1, ["big"])), claim("b", exactly("r", 1))) is None
    assert allocate(slices, claim("c", exactly("r", 1, ["big"])), allocated=[(D, "p", "g1")]) is None
    assert allocate(slices, claim("c", exactly("r", 1)), allocated=[(D, "p", "g1")]) == [[("r", "g0")]]


def test_a_device_consuming_a_missing_counter_makes_the_pool_invalid():
    slices = [slice_("0", counters=["g0"], count=2), slice_("1", [dev("d", ["nope"])], count=2)]
    with pytest.raises(AllocationError, match="invalid resource pools"):
        allocate(slices, claim("c", exactly("r", 1)))


def test_depth_first_search_backtracks_over_a_constraint_across_requests():
    slices = [slice_("s", [dev("a", numa=0), dev("b", numa=1), dev("c", numa=1)])]
    got = allocate(slices, claim("c", exactly("r1"), exactly("r2"),
                                 constraints=[{"matchAttribute": f"{D}/numa"}]))
    assert got == [[("r1", "b"), ("r2", "c")]]


def test_first_available_tries_subrequests_in_order_and_names_the_one_taken():
    slices = [slice_("0", counters=["g0", "g1"], count=2),
              slice_("1", [dev("pair", ["g0", "g1"], size=2), dev("g0", ["g0"], size=1), dev("g1", ["g1"], size=1)],
                     count=2)]
    req = first_available("gpus", ("set", 1, ["big"]), ("singles", 2, ["one"]))
    assert allocate(slices, claim("c", req)) == [[("gpus/set", "pair")]]
    assert allocate(slices, claim("c", req), allocated=[(D, "p", "pair")]) is None  # counters gone
    got = allocate(slices, claim("s", exactly("r", 1, ["one"])), claim("c", req))
    assert got is None  # g0 taken: no pair, and only one single left


NO_SCHEDULE = {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}


@pytest.mark.parametrize("taint,tolerations,allocatable", [
    (NO_SCHEDULE, [], False),
    ({**NO_SCHEDULE, "effect": "NoExecute"}, [], False),
    ({**NO_SCHEDULE, "effect": "None"}, [], True),
    (NO_SCHEDULE, [{"key": "gpu.example.com/xid", "value": "79"}], True),
    (NO_SCHEDULE, [{"key": "gpu.example.com/xid", "value": "48"}], False),
    (NO_SCHEDULE, [{"operator": "Exists"}], True),
    (NO_SCHEDULE, [{"operator": "Exists", "effect": "NoExecute"}], False),
])
def test_taints_follow_toleratestaint(taint, tolerations, allocatable):
    slices = [slice_("s", [dev("d", taints=[taint])])]
    got = allocate(slices, claim("c", exactly("r", 1, tolerations=tolerations)))
    assert (got is not None) == allocatable


def test_a_rejected_tainted_device_keeps_its_counters_as_v0_36_does():
    # the tainted pair comes first: its check reserves g0 and g1, the taint rejects it and,
    # in v0.36.2, the counters stay reserved for the rest of the search (kubernetes#140436)
    slices = [slice_("0", counters=["g0", "g1"], count=2),
              slice_("1", [dev("pair", ["g0", "g1"], [NO_SCHEDULE], size=2), dev("g0", ["g0"], size=1)], count=2)]
    assert allocate(slices, claim("c", exactly("r", 1)), leak=True) is None
    assert allocate(slices, claim("c", exactly("r", 1)), leak=False) == [[("r", "g0")]]


def test_more_than_32_devices_in_a_claim_is_an_error():
    slices = [slice_("s", [dev(f"d{i}") for i in range(40)])]
    with pytest.raises(AllocationError, match="exceeds the claim limit of 32"):
        allocate(slices, claim("c", exactly("r", 33)))


def test_all_mode_takes_every_selectable_device():
    slices = [slice_("s", [dev("a", size=1), dev("b", size=2), dev("c", size=2)])]
    req = {"name": "r", "exactly": {"deviceClassName": "x", "allocationMode": "All",
                                    "selectors": [{"cel": {"expression": "big"}}]}}
    assert allocate(slices, claim("c", req)) == [[("r", "b"), ("r", "c")]]


def test_a_cel_expression_without_a_predicate_is_refused():
    slices = [slice_("s", [dev("a")])]
    with pytest.raises(NotModelled, match="no predicate"):
        allocate(slices, claim("c", exactly("r", 1, ["device.attributes['x'].y == 1"])))


def test_slice_validation_names_each_broken_limit():
    devices = [dev(f"d{i}", ["g0"]) for i in range(65)]
    errs = validate_slice(slice_("s", devices))
    assert "spec.devices: must have at most 64 items" in errs
    assert validate_slice(slice_("s", [dev(f"d{i}") for i in range(65)])) == []
    assert "spec.devices: must have at most 128 items" in validate_slice(slice_("s", [dev(f"d{i}") for i in range(129)]))
    many = slice_("c", counters=[f"c{i}" for i in range(33)])
    assert "spec.sharedCounters[0].counters: must have at most 32 counters" in validate_slice(many)
    many["spec"]["sharedCounters"] *= 9
    assert "spec.sharedCounters: must have at most 8 items" in validate_slice(many)
    two = dev("d", ["g0"])
    two["consumesCounters"] *= 3
    assert "spec.devices[0].consumesCounters: must have at most 2 items" in validate_slice(slice_("s", [two]))
    both = slice_("s", [dev("d")])
    both["spec"]["sharedCounters"] = []
    assert "spec: only one of `sharedCounters` or `devices` is allowed" in validate_slice(both)
    assert any("DNS label" in e for e in validate_slice(slice_("s", [dev("Bad_Name")])))


def test_claim_defaulting_and_validation():
    c = claim("c", {"name": "r", "exactly": {"deviceClassName": "x"}})
    assert c["spec"]["devices"]["requests"][0]["exactly"] == {"deviceClassName": "x", "allocationMode": "ExactCount",
                                                              "count": 1}
    assert validate_claim(c) == []
    bad = claim("c", first_available("r", *[(f"s{i}", 1, []) for i in range(9)]),
                constraints=[{"matchAttribute": f"{D}/numa", "requests": ["nope"]}])
    errs = validate_claim(bad)
    assert "spec.devices.requests[0].firstAvailable: must have at most 8 items" in errs
    assert "spec.devices.constraints[0].requests: 'nope' is not a request" in errs


# ------------------------------------------------------------------ work counted per Filter
def node_slices(node, pool=None, sets=True):
    """A node as the agent publishes it: a counter slice (``c0``, ``c1``), then g0, g1 and, with
    ``sets``, the set s01 consuming both (2 + 1 + 1 = 4 counter look-ups); or two plain
    devices in one slice."""
    pool = pool or node
    if not sets:
        s = slice_(f"{node}-1", [dev("g0", size=1), dev("g1", size=1)], pool=pool)
        s["spec"]["nodeName"] = node
        return [s]
    out = [slice_(f"{node}-0", counters=("c0", "c1"), pool=pool, count=2),
           slice_(f"{node}-1", [dev("g0", ("c0",), size=1), dev("g1", ("c1",), size=1),
                                dev("s01", ("c0", "c1"), size=2)], pool=pool, count=2)]
    for s in out:
        s["spec"]["nodeName"] = node
    return out


def gathered(slices, node, version):
    from tests.testbed.dra_allocator_model import Work
    work = Work()
    pools = gather_pools(slices, node, version=version, work=work)
    return pools, work


def test_gathering_work_on_1_37_is_the_nodes_own_pool():
    cluster = node_slices("n0") + node_slices("n1") + node_slices("n2")
    pools, w = gathered(cluster, "n0", "1.37")
    assert [(p.name, len(p.devices), p.incomplete) for p in pools] == [("n0", 3, False)]
    assert (w.pools, w.slices_converted, w.devices_converted, w.consumptions_validated, w.slices_scanned) == (1, 2, 3, 4, 0)


def test_gathering_work_on_1_36_takes_every_nodes_pool_through_check_slices_in_pool():
    # n0's Filter sees its device slice and all three counter slices (slicesShared); n1's and
    # n2's pools hold one slice of two: checkSlicesInPool walks the 6 slices for each and
    # buildPool converts their device slice (3 devices, 4 look-ups each)
    cluster = node_slices("n0") + node_slices("n1") + node_slices("n2")
    pools, w = gathered(cluster, "n0", "1.36")
    assert [(p.name, len(p.devices), len(p.others), p.incomplete) for p in pools] == [
        ("n0", 3, 0, False), ("n1", 0, 3, False), ("n2", 0, 3, False)]
    assert (w.pools, w.slices_converted, w.devices_converted, w.consumptions_validated, w.slices_scanned) == (3, 6, 9, 12, 12)


def test_single_devices_cost_the_same_on_both_versions():
    cluster = node_slices("n0", sets=False) + node_slices("n1", sets=False)
    for version in ("1.36", "1.37"):
        _, w = gathered(cluster, "n0", version)
        assert (w.pools, w.slices_converted, w.devices_converted, w.consumptions_validated, w.slices_scanned) == (1, 1, 2, 0, 0)


def test_cluster_gather_adds_up_to_gathering_the_whole_cluster():
    from tests.testbed.dra_allocator_model import ClusterGather
    nodes = {"n0": node_slices("n0"), "n1": node_slices("n1", sets=False), "n2": node_slices("n2"),
             "n3": node_slices("n3")}
    cluster = [s for v in nodes.values() for s in v]
    for version in ("1.36", "1.37"):
        shortcut = ClusterGather(version)
        for node, objs in nodes.items():
            shortcut.set_node(node, node_slices(node, sets=False))  # replaced below: re-publishing
            shortcut.set_node(node, objs)
        for node in nodes:
            assert shortcut.filter_work(node) == gathered(cluster, node, version)[1], (version, node)
        # n2 and n3 publish alike: one node standing for two gives n2's Filter the same counts
        twins = ClusterGather(version)
        for node in ("n0", "n1", "n2"):
            twins.set_node(node, nodes[node], copies=2 if node == "n2" else 1)
        assert twins.filter_work("n2") == gathered(cluster, "n2", version)[1], version


def test_an_allocated_device_of_another_nodes_pool_still_counts_for_its_counters():
    # 1.36: n1's devices reach n0's Filter only as counter consumers; a claim there is unaffected
    cluster = node_slices("n0") + node_slices("n1")
    model = AllocatorModel(cluster, [CLASS], CEL, allocated=[(D, "n1", "s01")], version="1.36")
    assert names(model.allocate([claim("c", exactly("r", selectors=["big"]))], "n0")[0]) == [("r", "s01")]


def test_search_work_counts_cel_evaluations_and_counter_checks():
    # class "x" then the request's "big": g0 and g1 run both (x matches, big does not), s01
    # both and is reserved: 6 evaluations, 2 counters compared (the pool has c0 and c1)
    model = AllocatorModel(node_slices("n0"), [CLASS], CEL, version="1.37")
    assert names(model.allocate([claim("c", exactly("r", selectors=["big"]))], "n0")[0]) == [("r", "s01")]
    assert (model.work.cel_evaluations, model.work.counter_checks, model.work.devices_converted) == (6, 2, 3)
    # with g0 allocated, s01 is refused on its counters (c0 used): still 2 checks counted;
    # then nothing else is big: unschedulable
    model.allocated = {(D, "n0", "g0")}
    assert model.allocate([claim("c", exactly("r", selectors=["big"]))], "n0") is None
    assert (model.work.cel_evaluations, model.work.counter_checks) == (4, 2)  # g0 in use: skipped unevaluated
    # a prioritized list ["set": big and one (nothing is both) -> "single": one]: "set" runs
    # x, big on g0 and g1 (2 + 2) and x, big, one on s01 (3), then fails; "single" runs x, one
    # on g0 (2), which it takes: 9 (the cache is per device and subrequest, so nothing is shared)
    model.allocated = set()
    got = model.allocate([claim("c", first_available("r", ("set", 1, ["big", "one"]), ("single", 1, ["one"])))], "n0")
    assert names(got[0]) == [("r/single", "g0")]
    assert model.work.cel_evaluations == 2 + 2 + 3 + 2
