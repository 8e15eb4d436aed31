"""Dynamic MIG in the ResourceSlices: every MIG device on a legal placement, the counters
that keep MIG devices, whole GPUs and GPU sets apart, the best-fit order, health taints, and
a churn of mixed claims through the scheduler's allocator that never over-commits a GPU.

The allocation bodies run against two backends (the ``allocator`` fixture, as
``tests/test_dra_draalloc.py``): the allocator model everywhere, and draalloc where
``$GPU_AGENT_K8S_BINARIES`` holds it, which skips saying why: it is Kubernetes v1.32, whose
``resource.k8s.io/v1beta1`` has no partitionable devices to allocate MIG devices through.
"""

from __future__ import annotations

import random
from itertools import combinations

import pytest
from k8s_binaries import missing_reason

from agent.dra.devices import parse_mig_slot_name, parse_set_name, profile_label
from agent.dra.migslots import COMPUTE_COUNTERS, gpu_counters
from agent.dra.occupancy import Occupancy
from agent.dra.slices import render_slices
from agent.hw.sim.mig_geometry import geometry_for
from tests.testbed.dra_allocator_model import AllocatorModel
from tests.testbed.dra_shipped_classes import CEL, CLASSES, mig_request
from tests.testbed.mig_support import mig_topology

D = "gpu.gpu-agent.io"


@pytest.fixture(params=("model", "draalloc"))
def allocator(request):
    if request.param == "draalloc":
        pytest.skip(missing_reason("draalloc") or "draalloc is Kubernetes v1.32: its resource.k8s.io/v1beta1 has"
                    " no partitionable devices, so no dynamic MIG device can be allocated through it")
    return request.param


def devices(slices):
    return [d for s in slices for d in s["spec"].get("devices", [])]


def counters_declared(slices):
    return {(cs["name"], c): int(v["value"]) for s in slices for cs in s["spec"].get("sharedCounters", ())
            for c, v in cs["counters"].items()}


def consumed(device):
    return {(u["counterSet"], c): int(v["value"]) for u in device.get("consumesCounters", ())
            for c, v in u["counters"].items()}


def attr(device, name):
    (value,) = device["attributes"][f"{D}/{name}"].values()
    return value


def test_every_published_mig_device_sits_on_a_legal_placement_and_counters_keep_it_apart_from_exactly_the_devices_it_overlaps():
    topology = mig_topology("dgx-h100")
    slices = render_slices(topology, node_name="node-1", dynamic_mig=True,
                           occupancy=_occupancy({"gpu-1-mig-3g40gb-0": (1,), "gpu-2": (2,)}))
    declared = counters_declared(slices)
    migs = [d for d in devices(slices) if attr(d, "type") == "mig"]
    assert migs
    geometry = geometry_for(topology.gpus[0].name)
    for d in migs:
        gpu, label, start = parse_mig_slot_name(d["name"])
        profile = next(p for p in geometry.profiles if profile_label(p.name) == label)
        size = attr(d, "placementSize")
        assert (start, size) in {(pl.start, pl.size) for pl in profile.placements}
        assert (attr(d, "profile"), attr(d, "parentIndex"), attr(d, "placementStart")) == (profile.name, gpu, start)
        assert all(key in declared for key in consumed(d))
    # counters only where two devices meet: two devices of a GPU whose memory slices overlap (the full GPU
    # overlaps them all) take more of some counter together than it is worth, two on disjoint slices never do
    full = {d["name"]: set(range(8)) for d in devices(slices) if attr(d, "type") == "gpu"}
    on = {d["name"]: set(range(attr(d, "placementStart"), attr(d, "placementStart") + attr(d, "placementSize")))
          for d in migs} | full
    gpu_of = {d["name"]: attr(d, "parentIndex") if attr(d, "type") == "mig" else attr(d, "index")
              for d in devices(slices) if d["name"] in on}
    pairs = [(a, b) for a in on for b in on if a < b and gpu_of[a] == gpu_of[b]]
    assert pairs and any(not (on[a] & on[b]) for a, b in pairs) and any(on[a] & on[b] for a, b in pairs)
    by_name = {d["name"]: d for d in devices(slices)}

    def apart(a: str, b: str) -> set:
        """The counters two devices together take more of than declared."""
        ca, cb = consumed(by_name[a]), consumed(by_name[b])
        return {k for k in ca.keys() & cb.keys() if ca[k] + cb[k] > declared[k]}

    for a, b in pairs:
        assert bool(apart(a, b)) == bool(on[a] & on[b]), (a, b)
    assert any(("gpus-0", f"gpu-{gpu_of[a]}") in apart(a, b) for a, b in pairs), "the GPU's counter keeps some apart"
    mig_counters = [k for k in declared if k[0].endswith("-counter-set")]
    assert len(mig_counters) < 8 * 8, "fewer counters than every memory slice of every GPU"
    # no placement on the GPU held whole; the held MIG device meets no device (its full GPU is withdrawn,
    # nothing on its slices is published), so it is left out: the scheduler would convert it for nothing
    assert not [d for d in migs if attr(d, "parentIndex") == 2]
    assert "gpu-1-mig-3g40gb-0" not in by_name and "gpu-1" not in by_name
    assert not [d for d in migs if attr(d, "parentIndex") == 1 and attr(d, "placementStart") < 4]


def test_the_full_gpu_takes_all_of_its_gpu_counter_and_a_set_meets_a_mig_device_on_it():
    slices = render_slices(mig_topology("dgx-h100"), node_name="node-1", dynamic_mig=True)
    declared = counters_declared(slices)
    by_name = {d["name"]: d for d in devices(slices)}
    # the full GPU, a set holding it and every MIG device on its GPU consume the GPU's counter alone: the full
    # GPU and the set all of it, a MIG device a weight (on an intact GPU one counter keeps them all apart)
    worth = declared[("gpus-0", "gpu-0")]
    assert consumed(by_name["gpu-0"]) == {("gpus-0", "gpu-0"): worth}
    sets = [d for d in by_name.values() if attr(d, "type") == "gpuset" and ("gpus-0", "gpu-0") in consumed(d)]
    migs = [d for d in by_name.values() if attr(d, "type") == "mig" and attr(d, "parentIndex") == 0]
    assert sets and migs
    assert consumed(sets[0])[("gpus-0", "gpu-0")] == worth
    for d in migs:
        assert set(consumed(d)) == {("gpus-0", "gpu-0")} and 0 < consumed(d)[("gpus-0", "gpu-0")] <= worth
    assert not [k for k in declared if k[0] == "gpu-0-counter-set"]


#: four A100s in MIG mode without instances (Ampere offers placements only where MIG is on): their
#: decoders and JPEG engines are counters of their own
A100_MIG_ON = """\
name: a100-mig-on
gpu_defaults: {model: NVIDIA A100-SXM4-40GB, mig_capable: true}
gpus:
  - {bus_id: "0000:07:00.0", numa_node: 0, mig: []}
  - {bus_id: "0000:0f:00.0", numa_node: 0, mig: []}
  - {bus_id: "0000:47:00.0", numa_node: 1, mig: []}
  - {bus_id: "0000:4e:00.0", numa_node: 1, mig: []}
"""


@pytest.mark.parametrize("machine, placements", [("dgx-h100", 1), ("dgx-h100", 2), ("dgx-h100", 3),
                                                 ("a100", 1), ("a100", 2), ("gb200-tray", 1)])
def test_a_group_of_devices_on_a_gpu_fits_the_counters_exactly_when_the_gpu_can_hold_it(machine, placements, tmp_path):
    """Every group of the devices published on a GPU (its MIG devices, the held ones among them, its full GPU,
    the sets holding it), over random layouts: it fits the declared counters, as the scheduler checks them, iff
    its memory slices are disjoint (the full GPU and a set take them all) and its engines fit the GPU (the
    A100's decoders and JPEG engine too). A counter is worth the same in every rendering: the publisher rewrites
    slices in place, so the scheduler may join the devices of one rendering to the counters of the one before."""
    if machine == "a100":
        (tmp_path / "a100.yaml").write_text(A100_MIG_ON)
        machine = str(tmp_path / "a100.yaml")
    topology = mig_topology(machine)
    geometry = geometry_for(topology.gpus[0].name)
    engines = {n: v for n, v in gpu_counters(geometry).items() if not n.startswith("memory-slice-")}
    profiles = [p.name for p in geometry.profiles] + ["gpu"]
    rng = random.Random(placements)
    one_counter = several = 0
    worth: dict[tuple[str, str], int] = {}
    for state in range(12):
        held: dict[str, tuple[int, ...]] = {}
        slices = render_slices(topology, node_name="node-1", dynamic_mig=True, mig_placements=placements)
        for step in range(rng.randrange(0, 30)):
            model = AllocatorModel(slices, CLASSES, CEL, allocated=[(D, "node-1", n) for n in held])
            got = model.allocate([_claim(f"c{step}", rng.choice(profiles))], "node-1")
            if got is not None:
                (((_, (_, _, name)),),) = got
                held[name] = (int(name.split("-")[1]),)
            slices = render_slices(topology, node_name="node-1", dynamic_mig=True, mig_placements=placements,
                                   occupancy=_occupancy(held, {d["name"] for d in devices(slices)}))
            for k, v in counters_declared(slices).items():
                assert worth.setdefault(k, v) == v, (k, v, worth[k])
        declared = counters_declared(slices)
        for gpu in range(topology.gpu_count):
            on = _on_gpu(devices(slices), gpu, geometry)
            if len(on) < 2:
                continue
            own = {k for k in declared if k == ("gpus-0", f"gpu-{gpu}") or k[0] == f"gpu-{gpu}-counter-set"}
            if max(len(own & on[n][2].keys()) for n in on) > 1:
                several += 1
            else:
                one_counter += 1
            names = sorted(on)
            sizes = range(2, len(names) + 1) if len(names) <= 12 else range(2, 5)
            for size in sizes:
                for group in combinations(names, size):
                    use: dict[tuple[str, str], int] = {}
                    for n in group:
                        for k, v in on[n][2].items():
                            if k in own:
                                use[k] = use.get(k, 0) + v
                    fits = all(v <= declared[k] for k, v in use.items())
                    slices_used = [s for n in group for s in on[n][0]]
                    legal = len(slices_used) == len(set(slices_used)) and all(
                        sum(on[n][1].get(e, 0) for n in group) <= cap for e, cap in engines.items())
                    assert fits == legal, (state, gpu, group, use, {k: declared[k] for k in own})
    # at one placement a profile (the default) no device consumes more than one counter of its GPU; with more,
    # the memory slice and size counters are met too
    assert one_counter and (several == 0 if placements == 1 else several > 0), (one_counter, several)


def _on_gpu(published, gpu, geometry):
    """name -> (memory slices, engines used, counters consumed) of the devices standing for GPU ``gpu``."""
    out = {}
    for d in published:
        if attr(d, "type") == "mig":
            if attr(d, "parentIndex") != gpu:
                continue
            profile = next(p for p in geometry.profiles if p.name == attr(d, "profile"))
            slots = range(attr(d, "placementStart"), attr(d, "placementStart") + attr(d, "placementSize"))
            engines = {n: int(getattr(profile, a)) for n, a in COMPUTE_COUNTERS}
        elif gpu in (parse_set_name(d["name"]) or ((attr(d, "index"),) if attr(d, "type") == "gpu" else ())):
            slots, engines = range(geometry.memory_slices), {}
        else:
            continue
        out[d["name"]] = (list(slots), engines, consumed(d))
    return out


def test_a_mig_claim_goes_to_the_gpu_already_cut_on_the_placement_that_keeps_a_3g_free():
    topology = mig_topology("dgx-h100")
    held = {"gpu-3-mig-1g10gb-6": (3,)}
    slices = render_slices(topology, node_name="node-1", dynamic_mig=True, occupancy=_occupancy(held))
    model = AllocatorModel(slices, CLASSES, CEL, allocated=[(D, "node-1", n) for n in held])
    (result,) = model.allocate([_claim("c", "1g.10gb")], "node-1")
    # on GPU 3, beside the 1g at slice 6: slices 4-5 keep 3g.40gb at 0 and 4g.40gb at 0 free
    assert result[0][1][2] in {"gpu-3-mig-1g10gb-4", "gpu-3-mig-1g10gb-5"}


def test_a_fault_on_a_gpu_taints_the_gpu_and_every_mig_device_on_it():
    topology = mig_topology("dgx-h100")
    held = {"gpu-4-mig-2g20gb-0": (4,)}
    slices = render_slices(topology, node_name="node-1", dynamic_mig=True, occupancy=_occupancy(held, in_pool=[
        "gpu-4-mig-3g40gb-4"]), unhealthy={4: "XID 79"})
    whole = render_slices(topology, node_name="node-1", dynamic_mig=True, unhealthy={4: "XID 79"})
    on_4 = [d for d in [*devices(slices), *devices(whole)] if d["name"] == "gpu-4" or d["name"].startswith("gpu-4-mig-")]
    assert {d["name"] for d in on_4} >= {"gpu-4", "gpu-4-mig-2g20gb-0", "gpu-4-mig-3g40gb-4"}
    assert all({"key": f"{D}/xid", "value": "79", "effect": "NoSchedule"} in d["taints"] for d in on_4)
    assert not any(d.get("taints") for d in devices(slices) if d["name"].startswith("gpu-5"))


def test_the_full_gpu_of_a_gpu_a_mig_device_is_cut_from_is_withdrawn_until_the_gpu_is_whole_again():
    topology = mig_topology("dgx-h100")
    held = {"gpu-3-mig-1g10gb-6": (3,)}
    withdrawn = f"{D}/withdrawn"
    at_once = {d["name"]: d for d in devices(render_slices(topology, node_name="node-1", dynamic_mig=True,
                                                            occupancy=_occupancy(held, in_pool=["gpu-3"])))}
    assert "gpu-3" not in at_once and "gpu-2" in at_once
    # the MIG device the claim holds meets nothing published now: left out (the scheduler would convert it for
    # nothing); what else GPU 3 offers is clear of its slice
    assert "gpu-3-mig-1g10gb-6" not in at_once and not _meeting("gpu-3-mig-1g10gb-6", at_once)
    assert any(n.startswith("gpu-3-mig-") for n in at_once)
    sets = [parse_set_name(n) for n, d in at_once.items() if attr(d, "type") == "gpuset"]
    assert sets and not [m for m in sets if 3 in m]

    def graced(expired):
        occupancy = Occupancy(dict(held), (), expired, (), ["gpu-3", "gpu-2"])
        return {d["name"]: d for d in devices(render_slices(topology, node_name="node-1", dynamic_mig=True,
                                                            occupancy=occupancy))}

    lagging = graced([])["gpu-3"]  # in the pool now: tainted for the grace, as a set leaving
    assert [t["key"] for t in lagging["taints"]] == [withdrawn]
    assert "gpu-3" not in graced(["gpu-3"])
    back = {d["name"] for d in devices(render_slices(topology, node_name="node-1", dynamic_mig=True,
                                                      occupancy=_occupancy({}, in_pool=["gpu-3-mig-1g10gb-6"])))}
    assert "gpu-3" in back


def test_dynamic_mig_needs_resource_k8s_io_v1():
    for version in ("v1beta2", "v1beta1"):
        slices = render_slices(mig_topology("dgx-h100"), node_name="node-1", api_version=version, dynamic_mig=True)
        assert not [d for d in devices(slices) if "-mig-" in d["name"]]


PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "gpu")


def test_a_churn_of_mixed_claims_never_over_commits_a_gpu_and_every_device_is_legal(allocator):
    topology = mig_topology("dgx-h100")
    geometry = geometry_for(topology.gpus[0].name)
    rng = random.Random(7)
    held: dict[str, tuple[int, ...]] = {}  # device -> GPUs, as prepared claims hold them
    in_pool: set[str] = set()
    served = left_out = 0
    slices: list = []
    for step in range(160):
        if step % 4 == 0:  # the agent re-publishes now and then: claims in between meet the counters alone
            slices = render_slices(topology, node_name="node-1", dynamic_mig=True,
                                   occupancy=_occupancy(held, in_pool))
            in_pool = {d["name"] for d in devices(slices)}
            # a device a claim holds stays, unless it meets no device published (then none needs its counters)
            assert not [n for n in held.keys() - in_pool if _meeting(n, in_pool)], "a held device withdrawn"
            left_out += len(held.keys() - in_pool)
        if held and rng.random() < 0.4:
            del held[rng.choice(sorted(held))]
            continue
        profile = rng.choice(PROFILES)
        model = AllocatorModel(slices, CLASSES, CEL, allocated=[(D, "node-1", n) for n in held])
        result = model.allocate([_claim(f"c{step}", profile)], "node-1")
        if result is None:
            continue
        (((_, (_, _, name)),),) = result
        held[name] = (int(name.split("-")[1]),)
        served += 1
        _check_layout(held, geometry)
    assert served > 50
    assert left_out, "held devices meeting nothing were left out"


def _meeting(name, published):
    """The devices of ``published`` that stand for some of the memory slices of MIG device ``name``."""
    gpu, label, start = parse_mig_slot_name(name)
    geometry = geometry_for(mig_topology("dgx-h100").gpus[0].name)

    def slices_of(n):
        parsed = parse_mig_slot_name(n)
        if parsed is None:
            members = parse_set_name(n) or (int(n.split("-")[1]),)
            return set(range(8)) if gpu in members else set()
        g, lab, st = parsed
        profile = next(p for p in geometry.profiles if profile_label(p.name) == lab)
        return set(range(st, st + next(pl.size for pl in profile.placements if pl.start == st))) if g == gpu else set()

    return [n for n in published if n != name and slices_of(n) & slices_of(name)]


def _check_layout(held, geometry):
    """No memory slice twice, no MIG device on a GPU held whole, no counter over its value."""
    slices_of: dict[int, set[int]] = {}
    whole: set[int] = set()
    compute: dict[int, int] = {}
    for name in held:
        parsed = parse_mig_slot_name(name)
        if parsed is None:
            whole.add(int(name.split("-")[1]))
            continue
        gpu, label, start = parsed
        profile = next(p for p in geometry.profiles if profile_label(p.name) == label)
        size = next(pl.size for pl in profile.placements if pl.start == start)
        mine = set(range(start, start + size))
        assert not mine & slices_of.get(gpu, set()), f"{name} overlaps another MIG device"
        slices_of.setdefault(gpu, set()).update(mine)
        compute[gpu] = compute.get(gpu, 0) + profile.multiprocessors
    assert not whole & set(slices_of), "a whole GPU and a MIG device on it"
    assert all(n <= 132 for n in compute.values())


def _claim(name, profile):
    request = ({"name": "gpu", "exactly": {"deviceClassName": D, "allocationMode": "ExactCount", "count": 1}}
               if profile == "gpu" else mig_request(profile))
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": {"requests": [request]}}}


def _occupancy(held, in_pool=()):
    return Occupancy(dict(held), (), None, (), sorted(in_pool))


def test_the_publisher_re_renders_the_mig_devices_at_prepare_around_the_one_a_claim_holds(tmp_path):
    from waiting import eventually

    from agent.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
    from agent.dra.publish_settings import PublishSettings
    from agent.dra.publisher import SlicePublisher
    from agent.dra.view import DraView
    from tests.testbed.apiserver_stub import ApiServerStub

    with ApiServerStub() as server:
        server.add_node("node-1")
        checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
        pub = SlicePublisher(server.api_client, DraView(mig_topology("dgx-h100")),
                             PublishSettings("node-1", D, dynamic_mig=True, withdrawal_grace_s=0,
                                             backoff_initial_s=0.05, backoff_max_s=0.2), prepared=checkpoint)
        pub.start()
        try:
            assert eventually(pub.ready, 30)
            first = {d["name"] for d in devices(server.slices())}
            assert "gpu-0-mig-1g10gb-6" in first and not any(n.startswith("gpu-3-mig-1g") for n in first)
            held = "gpu-3-mig-1g10gb-6"  # a claim holds a placement nobody chose: GPU 3 is now the cut one
            checkpoint.add(PreparedClaim("uid-1", "default", "c", (PreparedDevice("mig", "node-1", held, ("x",)),),
                                         str(tmp_path / "c.json")))
            assert server.wait_for(lambda s: "gpu-3-mig-1g10gb-4" in {d["name"] for d in devices(s)}, 10.0)
            # the held one meets nothing published any more: left out, nothing on its slice offered
            now = {d["name"] for d in devices(server.slices())}
            assert held not in now and not _meeting(held, now) and "gpu-3" not in now
            # the 1g published before stays (a claim the agent has not heard of may hold it)
            assert "gpu-0-mig-1g10gb-6" in {d["name"] for d in devices(server.slices())}
        finally:
            pub.stop()


def test_slices_previews_the_mig_devices_published_while_the_listed_ones_are_held(capsys):
    import yaml

    from agent import cli

    assert cli.main(["slices", "--simulate", "dgx-h100", "--dynamic-mig", "--node-name", "n",
                     "--in-use", "gpu-2-mig-3g40gb-0,gpu-5"]) == 0
    out = capsys.readouterr()
    names = [d["name"] for s in yaml.safe_load_all(out.out) for d in s["spec"].get("devices", ())]
    # the cut GPU first for 3g; the held one meets nothing published and is left out
    assert "gpu-2-mig-3g40gb-0" not in names and "gpu-2-mig-3g40gb-4" in names
    assert next(n for n in names if "-mig-3g40gb-" in n) == "gpu-2-mig-3g40gb-4"
    assert not [n for n in names if n.startswith("gpu-5-mig-")]
    assert "dynamic MIG: GPUs [0, 1, 2, 3, 4, 5, 6, 7] offer MIG placements" in out.err


def test_slices_refuses_overlapping_mig_devices_and_a_mig_name_without_dynamic_mig_in_one_line(capsys):
    from agent import cli

    assert cli.main(["slices", "--simulate", "dgx-h100", "--dynamic-mig", "--node-name", "n",
                     "--in-use", "gpu-0-mig-3g40gb-0,gpu-0-mig-2g20gb-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpu-topology-agent slices: error: --in-use: gpu-0-mig-2g20gb-2 and gpu-0-mig-3g40gb-0 overlap"
                   " on memory slice 2 of GPU 0"]
    assert cli.main(["slices", "--simulate", "dgx-h100", "--node-name", "n", "--in-use", "gpu-0-mig-3g40gb-0"]) == 2
    assert "(dynamic MIG devices need --dynamic-mig)" in capsys.readouterr().err


def test_allocate_explains_a_mig_placement_as_json(capsys):
    import json

    from agent import cli

    assert cli.main(["allocate", "--mig-profile", "3g.40gb", "--in-use", "gpu-0-mig-1g10gb-6",
                     "--simulate", "dgx-h100", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["device"], doc["gpu"], doc["placement"]) == ("gpu-0-mig-3g40gb-0", 0, {"start": 0, "size": 4})
    assert doc["lost"]["4g.40gb"] == 1 and "7g.80gb" not in doc["lost"]
    assert doc["runners_up"][0]["lost"]["7g.80gb"] == 1
    assert cli.main(["allocate", "--mig-profile", "5g.1gb", "--simulate", "dgx-h100"]) == 2


def test_a_profiles_second_placement_stays_clear_of_every_profiles_first_so_claims_between_renderings_fit(capsys):
    import yaml

    from agent import cli
    from agent.dra.devices import parse_mig_slot_name

    assert cli.main(["slices", "--simulate", "dgx-h100", "--dynamic-mig", "--node-name", "n",
                     "--in-use", "gpu-3-mig-1g10gb-6", "--mig-placements-per-profile", "2"]) == 0
    names = [d["name"] for s in yaml.safe_load_all(capsys.readouterr().out) for d in s["spec"].get("devices", ())]
    sizes = {"7g80gb": 8, "4g40gb": 4, "3g40gb": 4, "2g20gb": 2, "1g20gb": 2, "1g10gb": 1, "1g10gb-me": 1}
    by_profile: dict[str, list[tuple[int, set[int]]]] = {}
    for name in names:
        parsed = parse_mig_slot_name(name)
        if parsed is not None and name != "gpu-3-mig-1g10gb-6":  # the held one
            gpu, label, start = parsed
            by_profile.setdefault(label, []).append((gpu, set(range(start, start + sizes[label]))))
    firsts = {label: slots[0] for label, slots in by_profile.items()}
    assert firsts["1g10gb"][0] == 3  # best fit: the GPU already cut
    for label, slots in by_profile.items():
        assert len(slots) == 2, label
        gpu, taken = slots[1]
        clashes = [other for other, (g, s) in firsts.items() if g == gpu and s & taken]
        assert not clashes, f"{label}'s second placement overlaps the first of {clashes}"


@pytest.mark.parametrize("placements", [2, 3])
def test_the_placements_published_per_profile_follow_dra_mig_placements_per_profile(capsys, tmp_path, placements):
    import yaml

    from agent import cli

    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\ndra:\n  migPlacementsPerProfile: {placements}\n")
    assert cli.main(["slices", "--simulate", "dgx-h100", "--dynamic-mig", "--config", str(config)]) == 0
    names = [d["name"] for s in yaml.safe_load_all(capsys.readouterr().out) for d in s["spec"].get("devices", ())]
    per_profile: dict[str, list[str]] = {}
    for n in names:
        if (parsed := parse_mig_slot_name(n)) is not None:
            per_profile.setdefault(parsed[1], []).append(n)
    assert set(per_profile) == {profile_label(p) for p in ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb",
                                                           "4g.40gb", "7g.80gb")}
    # as many as asked where the free GPUs hold them (one 1g.10gb+me a GPU, but eight free GPUs)
    assert {len(v) for v in per_profile.values()} == {placements}
    # smallest profile first: a MIG claim's selectors run on every MIG device it walks
    first = [parse_mig_slot_name(n)[1] for n in names if parse_mig_slot_name(n) is not None][::placements]
    assert first[:3] == [profile_label("1g.10gb"), profile_label("1g.10gb+me"), profile_label("1g.20gb")]


@pytest.mark.parametrize("where, how", [
    ("flag", lambda tmp: ["--mig-placements-per-profile", "0"]),
    ("file", lambda tmp: ["--config", _write(tmp / "c.yaml", "version: v1\ndra: {migPlacementsPerProfile: many}\n")]),
])
def test_a_bad_mig_placements_per_profile_is_one_line_naming_it(capsys, tmp_path, where, how):
    from agent import cli

    assert cli.main(["slices", "--simulate", "dgx-h100", "--dynamic-mig", *how(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("migPlacementsPerProfile" in err[0] or "--mig-placements-per-profile" in err[0]), err
    assert "expected a whole number from 1 to 8" in err[0]


def test_the_publisher_publishes_as_many_placements_as_the_environment_says(tmp_path):
    from waiting import eventually

    from agent.config import load_config
    from agent.dra.publish_settings import PublishSettings
    from agent.dra.publisher import SlicePublisher
    from agent.dra.view import DraView
    from tests.testbed.apiserver_stub import ApiServerStub

    config = load_config(None, {"NODE_NAME": "node-1", "DRA_DYNAMIC_MIG": "on", "DRA_MIG_PLACEMENTS_PER_PROFILE": "2",
                                "DRA_DRIVER_NAME": D}, {})
    with ApiServerStub() as server:
        server.add_node("node-1")
        pub = SlicePublisher(server.api_client, DraView(mig_topology("dgx-h100"), True), PublishSettings.from_config(config))
        pub.start()
        try:
            assert eventually(pub.ready, 30)
            migs = [parse_mig_slot_name(d["name"]) for d in devices(server.slices()) if "-mig-" in d["name"]]
            assert len(migs) == 2 * len({label for _, label, _ in migs}) == 14, migs
        finally:
            pub.stop()


def test_a_held_mig_device_meeting_nothing_stays_published_where_the_devices_take_several_slices():
    topology = mig_topology("dgx-h100")
    held = {"gpu-1-mig-3g40gb-0": (1,)}

    def published(placements):
        slices = render_slices(topology, node_name="node-1", dynamic_mig=True, mig_placements=placements,
                               occupancy=_occupancy(held))
        return len([s for s in slices if s["spec"].get("devices")]), {d["name"] for d in devices(slices)}

    one, names = published(2)
    assert one == 1 and "gpu-1-mig-3g40gb-0" not in names and not _meeting("gpu-1-mig-3g40gb-0", names)
    # eight placements of seven profiles, the singles and the sets: more than 64 devices, two slices a view
    # may take from two publications: the held device keeps its counters in the pool
    several, names = published(8)
    assert several > 1 and "gpu-1-mig-3g40gb-0" in names


def _write(path, text):
    path.write_text(text)
    return str(path)
