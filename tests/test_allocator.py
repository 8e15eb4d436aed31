"""AllocationEngine behaviour: GPU sets, explanations, replicas and MIG.

Topologies are built here from the model (no hardware, no other package needed). Requests
go through the device plugin's edge (``allocation_support``: a resource's device table checks
them and maps them to ranks); the edge's messages for bad requests are tested through the
socket and the CLI (test_deviceplugin.py, test_allocator_cli.py).
"""

from __future__ import annotations

import threading

import pytest

from agent.errors import AllocationError
from agent.topology.allocator import CRITERIA, AllocationEngine
from agent.topology.model import Gpu, Link, MigDevice, PcieLevel, Topology
from tests.testbed.allocation_support import best_set, explain, shared, synthetic_islands_topology

pytestmark = pytest.mark.usefixtures("impl")  # every test on both engines (conftest.py)


def nvswitch_node(n: int = 8, per_numa: int = 4, nvlinks: int = 18) -> Topology:
    """Every pair NVLinked through NVSwitch; PCIe NODE within a socket, SYS across."""
    gpus = [Gpu(i, f"GPU-{i:02d}", "H100", numa_node=i // per_numa) for i in range(n)]
    links = [
        Link(
            a, b, nvlinks, PcieLevel.NODE if a // per_numa == b // per_numa else PcieLevel.SYS, True
        )
        for a in range(n)
        for b in range(a + 1, n)
    ]
    return Topology.build(gpus, links)


def pcie_pairs_node() -> Topology:
    """8 GPUs in NVLink-bridged pairs (0-1, 2-3, ...), two per PCIe switch, two sockets."""
    gpus = [Gpu(i, f"GPU-{i}", "A100", numa_node=i // 4) for i in range(8)]
    links = []
    for a in range(8):
        for b in range(a + 1, 8):
            if a // 4 != b // 4:
                level = PcieLevel.SYS
            elif a // 2 == b // 2:
                level = PcieLevel.PIX
            else:
                level = PcieLevel.NODE
            links.append(Link(a, b, 4 if a // 2 == b // 2 else 0, level))
    return Topology.build(gpus, links)


# ---------------------------------------------------------------------------- GPU sets
def test_pairs_node_gives_a_size_two_request_an_nvlinked_pair(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    assert best_set(allocator, list(range(8)), [], 2) == [0, 1]


def test_broken_pairs_are_used_up_before_intact_ones(impl):
    # 0 and 3 are taken: 1 and 2 have lost their partners, so a size-1 request takes one of
    # them (best fit) rather than breaking an intact pair
    allocator = AllocationEngine(pcie_pairs_node())
    assert best_set(allocator, [1, 2, 4, 5, 6, 7], [], 1) in ([1], [2])


def test_size_four_on_nvswitch_node_stays_on_one_numa_node(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = best_set(allocator, [0, 1, 2, 4, 5, 6, 7], [], 4)
    assert got == [4, 5, 6, 7]


def test_fewer_numa_nodes_breaks_a_tie_on_score(impl):
    # all pairs score the same, so criteria 1-2 tie; criterion 3 keeps the pair on one node
    gpus = [Gpu(i, f"GPU-{i}", "x", numa_node=[0, 1, 1, 0][i]) for i in range(4)]
    links = [Link(a, b, 0, PcieLevel.SYS) for a in range(4) for b in range(a + 1, 4)]
    allocator = AllocationEngine(Topology.build(gpus, links))
    assert best_set(allocator, [0, 1, 3], [], 2) == [0, 3]


def test_unknown_numa_node_counts_as_one_node_of_its_own(impl):
    gpus = [
        Gpu(0, "a", "x", numa_node=None),
        Gpu(1, "b", "x", numa_node=0),
        Gpu(2, "c", "x", numa_node=None),
    ]
    links = [Link(a, b, 0, PcieLevel.SYS) for a in range(3) for b in range(a + 1, 3)]
    allocator = AllocationEngine(Topology.build(gpus, links))
    assert best_set(allocator, [0, 1, 2], [], 2) == [0, 2]


def test_must_include_is_always_in_the_answer(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = best_set(allocator, list(range(8)), [3, 4], 3)
    assert {3, 4} <= set(got) and len(got) == 3


def test_result_is_sorted_and_does_not_depend_on_input_order(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    assert (
        best_set(allocator, [7, 6, 5, 4], [], 2) == best_set(allocator, [4, 5, 6, 7], [], 2) == [4, 5]
    )


def test_explain_names_the_winner_and_why_each_runner_up_lost(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    explanation = explain(allocator, list(range(8)), [], 2, runners_up=3)
    assert explanation.chosen.indices == (0, 1)
    assert explanation.exact and explanation.implementation == impl
    assert [c.indices for c, _ in explanation.runners_up] == [(2, 3), (4, 5), (6, 7)]
    # the other intact pairs score the same and leave the same split: they lose on indices
    assert [CRITERIA[i] for _, i in explanation.runners_up] == ["lowest indices"] * 3
    text = "\n".join(explanation.lines())
    assert "chosen [0, 1]" in text and "lost on lowest indices" in text


def test_explain_reports_the_gpuallocator_criterion_as_the_separator_when_it_decides(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    explanation = explain(allocator, [0, 1, 2, 3], [], 2, runners_up=10)
    separators = {c.indices: i for c, i in explanation.runners_up}
    assert separators[(0, 2)] == 0  # breaks both pairs: worse split of the rest
    assert (
        explanation.chosen.gpuallocator_score
        > dict((c.indices, c.gpuallocator_score) for c, _ in explanation.runners_up)[(0, 2)]
    )


def test_best_score_for_size_is_the_best_set_score_on_the_node(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    assert allocator.best_score_for_size(1) == 0
    assert allocator.best_score_for_size(2) == 450  # NV4 + PIX
    with pytest.raises(AllocationError):
        allocator.best_score_for_size(9)


def test_sixty_four_gpu_node_keeps_requests_inside_one_nvswitch_island(impl):
    allocator = AllocationEngine(synthetic_islands_topology())
    everyone = list(range(64))
    assert best_set(allocator, everyone, [], 8) == list(range(8))
    got = best_set(allocator, everyone, [20], 4)
    assert 20 in got and {g // 8 for g in got} == {2}
    explanation = explain(allocator, everyone, [], 2)
    assert not explanation.exact


def test_large_node_with_at_most_sixteen_available_is_exact(impl):
    allocator = AllocationEngine(synthetic_islands_topology())
    available = [5, 6, 7, 8, 9, 40, 41, 42]
    assert best_set(allocator, available, [], 3) in ([5, 6, 7], [40, 41, 42])
    assert explain(allocator, available, [], 3).exact


def test_concurrent_callers_get_the_same_answers(impl):
    allocator = AllocationEngine(nvswitch_node(12, 6, 6))
    expected = {k: best_set(allocator, list(range(12)), [], k) for k in (2, 3, 4)}
    errors: list[object] = []

    def worker(k: int) -> None:
        for _ in range(5):
            if best_set(allocator, list(range(12)), [], k) != expected[k]:
                errors.append(k)

    allocator = AllocationEngine(nvswitch_node(12, 6, 6))  # cold tables, filled concurrently
    threads = [threading.Thread(target=worker, args=(k,)) for k in (2, 3, 4, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_concurrent_replica_and_explain_callers_share_one_engine(impl):
    pairs = [(f"GPU-{g}::{r}", g) for g in range(12) for r in range(4)]
    every = [d for d, _ in pairs]
    reference = AllocationEngine(nvswitch_node(12, 6, 6))
    expected = {k: shared(reference, pairs, every, [], k) for k in (3, 5)}
    chosen = explain(reference, list(range(12)), [], 5).chosen.indices
    allocator = AllocationEngine(nvswitch_node(12, 6, 6))  # cold tables, filled concurrently
    errors: list[object] = []

    def worker(k: int) -> None:
        for _ in range(5):
            if shared(allocator, pairs, every, [], k) != expected[k]:
                errors.append(k)
            if explain(allocator, list(range(12)), [], 5).chosen.indices != chosen:
                errors.append("explain")

    threads = [threading.Thread(target=worker, args=(k,)) for k in (3, 5, 3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---------------------------------------------------------------------------- replicas
def replicas_of(counts: dict[int, int]) -> list[tuple[str, int]]:
    """A time-sliced resource: ``counts[g]`` replicas ``GPU-<g>::0``, ``::1``, ... of GPU g."""
    return [(f"GPU-{g}::{r}", g) for g, count in counts.items() for r in range(count)]


def ids(free: dict[int, list[int]]) -> list[str]:
    return [f"GPU-{g}::{r}" for g, reps in free.items() for r in reps]


def test_distributed_replicas_land_on_distinct_least_loaded_gpus(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    # 4 replicas per GPU; GPUs 0 and 1 have 3 allocated already, the others none
    free = {0: [3], 1: [3], **{g: [0, 1, 2, 3] for g in range(2, 8)}}
    got = shared(allocator, replicas_of(dict.fromkeys(range(8), 4)), ids(free), [], 2)
    assert got == ["GPU-2::0", "GPU-3::0"]  # an NVLinked pair among the least loaded


def test_distributed_replicas_wrap_around_when_more_than_the_gpus_are_asked(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    devices = replicas_of({0: 3, 1: 3})
    got = shared(allocator, devices, [d for d, _ in devices], [], 5)
    assert got == ["GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-1::0", "GPU-1::1"]


def test_packed_replicas_prefer_the_busier_gpu_after_the_first_is_full(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    free = {0: [0, 1, 2, 3], 1: [2, 3], 5: [1, 2, 3]}
    got = shared(allocator, replicas_of(dict.fromkeys(range(8), 4)), ids(free), [], 4, "packed")
    assert got == ["GPU-1::2", "GPU-1::3", "GPU-5::1", "GPU-5::2"]


def test_replica_numbers_are_taken_in_natural_order(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    devices = [(f"GPU-0::{r}", 0) for r in (10, 2, 9)] + [(f"GPU-\u00e9::{r}", 1) for r in (10, 2)]
    got = shared(allocator, devices, [d for d, _ in devices], [], 2, "packed")
    assert got == ["GPU-0::2", "GPU-0::9"]
    assert shared(allocator, devices, [d for d, _ in devices[3:]], [], 1) == ["GPU-\u00e9::2"]


def test_must_include_replica_is_kept_and_others_go_elsewhere_when_distributed(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    devices = replicas_of(dict.fromkeys(range(8), 2))
    got = shared(allocator, devices, [d for d, _ in devices], ["GPU-6::1"], 2)
    assert got == ["GPU-6::1", "GPU-7::0"]


def test_a_gpus_load_is_its_replicas_allocated_to_others(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    # GPU 0: 2 of 2 replicas free (load 0); GPU 4: 3 of 8 free (load 5)
    devices = replicas_of({0: 2, 4: 8})
    assert shared(allocator, devices, ids({0: [0, 1], 4: [5, 6, 7]}), [], 1) == ["GPU-0::0"]
    # GPU 0: 2 of 4 free (load 2); GPU 4: 7 of 8 free (load 1)
    devices = replicas_of({0: 4, 4: 8})
    free = ids({0: [0, 1], 4: [1, 2, 3, 4, 5, 6, 7]})
    assert shared(allocator, devices, free, [], 1) == ["GPU-4::1"]
    assert shared(allocator, devices, free, [], 2, "packed") == ["GPU-0::0", "GPU-0::1"]


def test_replicas_are_deterministic(impl):
    allocator = AllocationEngine(nvswitch_node())
    devices = replicas_of(dict.fromkeys(range(8), 3))
    available = [d for d, _ in devices]
    first = shared(allocator, devices, available, [], 5)
    assert all(shared(allocator, devices, available[::-1], [], 5) == first for _ in range(3))
    assert len({d.split("::")[0] for d in first}) == 5


# ---------------------------------------------------------------------------- MIG
def mig_devices(free: dict[int, int]) -> list[tuple[str, int]]:
    return [(f"MIG-{g}-{i}", g) for g, count in free.items() for i in range(count)]


def mig(allocator: AllocationEngine, free: dict[int, int], must: list[str], size: int) -> list[str]:
    devices = mig_devices(free)
    return shared(allocator, devices, [d for d, _ in devices], must, size, "mig")


def test_mig_request_fits_on_one_parent_with_the_fewest_free_instances(impl):
    allocator = AllocationEngine(nvswitch_node())
    assert mig(allocator, {0: 7, 1: 3, 2: 2}, [], 2) == ["MIG-2-0", "MIG-2-1"]


def test_mig_request_spanning_parents_stays_on_one_numa_node(impl):
    allocator = AllocationEngine(nvswitch_node())  # GPUs 0-3 on node 0, 4-7 on node 1
    got = mig(allocator, {0: 2, 4: 3, 5: 3}, [], 5)
    assert {d.split("-")[1] for d in got} == {"4", "5"}


def test_mig_request_keeps_must_include_and_grows_on_its_parent(impl):
    allocator = AllocationEngine(nvswitch_node())
    assert mig(allocator, {0: 2, 6: 4}, ["MIG-6-3"], 2) == ["MIG-6-0", "MIG-6-3"]


def test_mig_request_larger_than_any_numa_node_uses_both(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = mig(allocator, {0: 2, 4: 2}, [], 4)
    assert got == ["MIG-0-0", "MIG-0-1", "MIG-4-0", "MIG-4-1"]


def test_mig_topology_from_the_model_is_usable(impl):
    mig_devs = tuple(MigDevice(f"MIG-a-{i}", 0, i, "1g.10gb", 9856) for i in range(3))
    topo = Topology.build(
        [Gpu(0, "GPU-a", "A100", mig_enabled=True, mig_devices=mig_devs, numa_node=0)], []
    )
    devices = [(m.uuid, m.parent_index) for m in mig_devs]
    got = shared(AllocationEngine(topo), devices, [d for d, _ in devices], [], 2, "mig")
    assert got == ["MIG-a-0", "MIG-a-1"]


# ---------------------------------------------------------------------------- built-in machines
@pytest.fixture(scope="module")
def builtin_topologies():
    from agent.discovery import load_topology
    from agent.hw.sim.machines import BUILTIN_MACHINES

    return {name: load_topology(name) for name in BUILTIN_MACHINES}


def test_every_built_in_machine_answers_every_size_with_distinct_available_gpus(
    impl, builtin_topologies
):
    for name, topo in builtin_topologies.items():
        n = topo.gpu_count
        if impl == "python" and n > 8:
            continue  # the twin is exact but slow on 16 GPUs; parity is tested elsewhere
        allocator = AllocationEngine(topo)
        for size in range(1, n + 1):
            got = best_set(allocator, list(range(n)), [], size)
            assert len(got) == size == len(set(got)) and got == sorted(got), (name, size)
            assert topo.set_score(got) <= allocator.best_score_for_size(size), (name, size)


def test_nvswitch_machines_fill_one_socket_before_the_other(impl, builtin_topologies):
    topo = builtin_topologies["dgx-h100"]
    got = best_set(AllocationEngine(topo), list(range(8)), [], 4)
    assert len({topo.gpus[i].numa_node for i in got}) == 1
