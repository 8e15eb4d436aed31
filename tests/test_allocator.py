"""AllocationEngine behaviour: GPU sets, explanations, invalid input, replicas and MIG.

Topologies are built here from the model (no hardware, no other package needed).
"""

from __future__ import annotations

import threading

import pytest

from agent.errors import AllocationError
from agent.topology.allocator import CRITERIA, AllocationEngine
from agent.topology.model import Gpu, Link, MigDevice, PcieLevel, Topology
from agent.topology.synthetic import synthetic_islands_topology

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
    assert allocator.best_set(list(range(8)), [], 2) == [0, 1]


def test_broken_pairs_are_used_up_before_intact_ones(impl):
    # 0 and 3 are taken: 1 and 2 have lost their partners, so a size-1 request takes one of
    # them (best fit) rather than breaking an intact pair
    allocator = AllocationEngine(pcie_pairs_node())
    assert allocator.best_set([1, 2, 4, 5, 6, 7], [], 1) in ([1], [2])


def test_size_four_on_nvswitch_node_stays_on_one_numa_node(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = allocator.best_set([0, 1, 2, 4, 5, 6, 7], [], 4)
    assert got == [4, 5, 6, 7]


def test_fewer_numa_nodes_breaks_a_tie_on_score(impl):
    # all pairs score the same, so criteria 1-2 tie; criterion 3 keeps the pair on one node
    gpus = [Gpu(i, f"GPU-{i}", "x", numa_node=[0, 1, 1, 0][i]) for i in range(4)]
    links = [Link(a, b, 0, PcieLevel.SYS) for a in range(4) for b in range(a + 1, 4)]
    allocator = AllocationEngine(Topology.build(gpus, links))
    assert allocator.best_set([0, 1, 3], [], 2) == [0, 3]


def test_unknown_numa_node_counts_as_one_node_of_its_own(impl):
    gpus = [
        Gpu(0, "a", "x", numa_node=None),
        Gpu(1, "b", "x", numa_node=0),
        Gpu(2, "c", "x", numa_node=None),
    ]
    links = [Link(a, b, 0, PcieLevel.SYS) for a in range(3) for b in range(a + 1, 3)]
    allocator = AllocationEngine(Topology.build(gpus, links))
    assert allocator.best_set([0, 1, 2], [], 2) == [0, 2]


def test_must_include_is_always_in_the_answer(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = allocator.best_set(list(range(8)), [3, 4], 3)
    assert {3, 4} <= set(got) and len(got) == 3


def test_result_is_sorted_and_does_not_depend_on_input_order(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    assert (
        allocator.best_set([7, 6, 5, 4], [], 2) == allocator.best_set([4, 5, 6, 7], [], 2) == [4, 5]
    )


@pytest.mark.parametrize(
    "available, must, size, message",
    [
        ([0, 1], [], 0, "at least 1"),
        ([0, 1], [], 3, "more than the 2 available"),
        ([0, 1], [2], 1, "not available"),
        ([0, 1, 2], [0, 1], 1, "do not fit"),
        ([0, 9], [], 1, "unknown GPU index 9"),
        ([0, 0, 1], [], 1, "duplicate GPU index 0"),
        ([0, 1], [1, 1], 2, "duplicate GPU index 1"),
        ([0, "1"], [], 1, "not a GPU index"),
        ([0, 1], [], 1.5, "must be an integer"),
    ],
)
def test_invalid_requests_raise_one_clear_allocation_error(impl, available, must, size, message):
    allocator = AllocationEngine(pcie_pairs_node())
    with pytest.raises(AllocationError, match=message):
        allocator.best_set(available, must, size)
    with pytest.raises(AllocationError, match=message):
        allocator.explain(available, must, size)


def test_explain_names_the_winner_and_why_each_runner_up_lost(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    explanation = allocator.explain(list(range(8)), [], 2, runners_up=3)
    assert explanation.chosen.indices == (0, 1)
    assert explanation.exact and explanation.implementation == impl
    assert [c.indices for c, _ in explanation.runners_up] == [(2, 3), (4, 5), (6, 7)]
    # the other intact pairs score the same and leave the same split: they lose on indices
    assert [CRITERIA[i] for _, i in explanation.runners_up] == ["lowest indices"] * 3
    text = "\n".join(explanation.lines())
    assert "chosen [0, 1]" in text and "lost on lowest indices" in text


def test_explain_reports_the_anchor_criterion_as_the_separator_when_it_decides(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    explanation = allocator.explain([0, 1, 2, 3], [], 2, runners_up=10)
    separators = {c.indices: i for c, i in explanation.runners_up}
    assert separators[(0, 2)] == 0  # breaks both pairs: worse split of the rest
    assert (
        explanation.chosen.anchor_score
        > dict((c.indices, c.anchor_score) for c, _ in explanation.runners_up)[(0, 2)]
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
    assert allocator.best_set(everyone, [], 8) == list(range(8))
    got = allocator.best_set(everyone, [20], 4)
    assert 20 in got and {g // 8 for g in got} == {2}
    explanation = allocator.explain(everyone, [], 2)
    assert not explanation.exact


def test_large_node_with_at_most_sixteen_available_is_exact(impl):
    allocator = AllocationEngine(synthetic_islands_topology())
    available = [5, 6, 7, 8, 9, 40, 41, 42]
    assert allocator.best_set(available, [], 3) in ([5, 6, 7], [40, 41, 42])
    assert allocator.explain(available, [], 3).exact


def test_concurrent_callers_get_the_same_answers(impl):
    allocator = AllocationEngine(nvswitch_node(12, 6, 6))
    expected = {k: allocator.best_set(list(range(12)), [], k) for k in (2, 3, 4)}
    errors: list[object] = []

    def worker(k: int) -> None:
        for _ in range(5):
            if allocator.best_set(list(range(12)), [], k) != expected[k]:
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
    reference = AllocationEngine(nvswitch_node(12, 6, 6))
    expected = {k: reference.replicas(pairs, [], k) for k in (3, 5)}
    chosen = reference.explain(list(range(12)), [], 5).chosen.indices
    allocator = AllocationEngine(nvswitch_node(12, 6, 6))  # cold tables, filled concurrently
    errors: list[object] = []

    def worker(k: int) -> None:
        for _ in range(5):
            if allocator.replicas(pairs, [], k) != expected[k]:
                errors.append(k)
            if allocator.explain(list(range(12)), [], 5).chosen.indices != chosen:
                errors.append("explain")

    threads = [threading.Thread(target=worker, args=(k,)) for k in (3, 5, 3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_unusual_but_valid_requests_get_the_plain_answer(impl):
    class Size(int):
        pass

    allocator = AllocationEngine(pcie_pairs_node())
    assert allocator.best_set([4, 5, 6, 7], [], Size(2)) == [4, 5]
    pairs = [("GPU-0::10", 0), ("GPU-0::2", 0), ("GPU-0::9", 0), ("GPU-3::1", 3)]
    expected = ["GPU-0::2", "GPU-0::9", "GPU-3::1"]
    assert allocator.replicas(pairs, [], 3, "packed") == expected
    assert allocator.replicas([list(p) for p in pairs], [], 3, "packed") == expected
    assert allocator.replicas(tuple(pairs), [], Size(3), "packed") == expected
    assert allocator.replicas(pairs, [], 3, "packed", replicas_per_gpu=2**70) == expected
    accented = [("GPU-\u00e9::10", 0), ("GPU-\u00e9::2", 0), ("GPU-\u00e9::9", 0)]
    assert allocator.replicas(accented, [], 2) == ["GPU-\u00e9::2", "GPU-\u00e9::9"]


# ---------------------------------------------------------------------------- replicas
def replica_pairs(free: dict[int, list[int]]) -> list[tuple[str, int]]:
    return [(f"GPU-{g}::{r}", g) for g, reps in free.items() for r in reps]


def test_distributed_replicas_land_on_distinct_least_loaded_gpus(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    # 4 replicas per GPU; GPUs 0 and 1 have 3 allocated already, the others none
    free = {0: [3], 1: [3], **{g: [0, 1, 2, 3] for g in range(2, 8)}}
    got = allocator.replicas(replica_pairs(free), [], 2)
    assert got == ["GPU-2::0", "GPU-3::0"]  # an NVLinked pair among the least loaded


def test_distributed_replicas_wrap_around_when_more_than_the_gpus_are_asked(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    free = {0: [0, 1, 2], 1: [0, 1, 2]}
    got = allocator.replicas(replica_pairs(free), [], 5)
    assert got == ["GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-1::0", "GPU-1::1"]


def test_packed_replicas_prefer_the_busier_gpu_after_the_first_is_full(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    free = {0: [0, 1, 2, 3], 1: [2, 3], 5: [1, 2, 3]}
    got = allocator.replicas(replica_pairs(free), [], 4, "packed")
    assert got == ["GPU-1::2", "GPU-1::3", "GPU-5::1", "GPU-5::2"]


def test_replica_numbers_are_taken_in_natural_order(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    free = {0: [10, 2, 9]}
    assert allocator.replicas(replica_pairs(free), [], 2, "packed") == ["GPU-0::2", "GPU-0::9"]


def test_must_include_replica_is_kept_and_others_go_elsewhere_when_distributed(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    free = {g: [0, 1] for g in range(8)}
    got = allocator.replicas(replica_pairs(free), ["GPU-6::1"], 2)
    assert got == ["GPU-6::1", "GPU-7::0"]


def test_explicit_replica_counts_define_load(impl):
    allocator = AllocationEngine(pcie_pairs_node())
    # GPU 0 has 2 of 2 free, GPU 4 has 3 of 8 free: GPU 0 is less loaded
    free = {0: [0, 1], 4: [5, 6, 7]}
    got = allocator.replicas(replica_pairs(free), [], 1, replicas_per_gpu={0: 2, 4: 8})
    assert got == ["GPU-0::0"]
    # assuming equal counts instead, GPU 4 (more free) is the less loaded one
    assert allocator.replicas(replica_pairs(free), [], 1) == ["GPU-4::5"]


def test_replicas_are_deterministic(impl):
    allocator = AllocationEngine(nvswitch_node())
    pairs = replica_pairs({g: [0, 1, 2] for g in range(8)})
    first = allocator.replicas(pairs, [], 5)
    assert all(allocator.replicas(list(reversed(pairs)), [], 5) == first for _ in range(3))
    assert len({d.split("::")[0] for d in first}) == 5


@pytest.mark.parametrize(
    "pairs, must, size, policy, message",
    [
        ([("a::0", 0)], [], 2, "distributed", "more than the 1 available"),
        ([("a::0", 0), ("a::0", 0)], [], 1, "distributed", "duplicate device ID a::0"),
        ([("a::0", 0)], ["b::0"], 1, "distributed", "not available"),
        ([("a::0", 0)], ["a::0", "a::0"], 1, "distributed", "duplicate"),
        ([("a::0", 12)], [], 1, "distributed", "unknown GPU index 12"),
        ([("a::0", 0)], [], 1, "spread", "unknown replica policy"),
        (["a::0"], [], 1, "distributed", "not a .device ID, GPU index. pair"),
        ([("a::0", 0)], [], 0, "distributed", "at least 1"),
    ],
)
def test_invalid_replica_requests_raise_one_clear_allocation_error(
    impl, pairs, must, size, policy, message
):
    allocator = AllocationEngine(pcie_pairs_node())
    with pytest.raises(AllocationError, match=message):
        allocator.replicas(pairs, must, size, policy)


# ---------------------------------------------------------------------------- MIG
def mig_pairs(free: dict[int, int]) -> list[tuple[str, int]]:
    return [(f"MIG-{g}-{i}", g) for g, count in free.items() for i in range(count)]


def test_mig_request_fits_on_one_parent_with_the_fewest_free_instances(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = allocator.mig(mig_pairs({0: 7, 1: 3, 2: 2}), [], 2)
    assert got == ["MIG-2-0", "MIG-2-1"]


def test_mig_request_spanning_parents_stays_on_one_numa_node(impl):
    allocator = AllocationEngine(nvswitch_node())  # GPUs 0-3 on node 0, 4-7 on node 1
    got = allocator.mig(mig_pairs({0: 2, 4: 3, 5: 3}), [], 5)
    assert {d.split("-")[1] for d in got} == {"4", "5"}


def test_mig_request_keeps_must_include_and_grows_on_its_parent(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = allocator.mig(mig_pairs({0: 2, 6: 4}), ["MIG-6-3"], 2)
    assert got == ["MIG-6-0", "MIG-6-3"]


def test_mig_request_larger_than_any_numa_node_uses_both(impl):
    allocator = AllocationEngine(nvswitch_node())
    got = allocator.mig(mig_pairs({0: 2, 4: 2}), [], 4)
    assert sorted(got) == ["MIG-0-0", "MIG-0-1", "MIG-4-0", "MIG-4-1"]


def test_invalid_mig_requests_raise_one_clear_allocation_error(impl):
    allocator = AllocationEngine(nvswitch_node())
    with pytest.raises(AllocationError, match="not available"):
        allocator.mig(mig_pairs({0: 1}), ["MIG-9-9"], 1)
    with pytest.raises(AllocationError, match="more than the 1 available"):
        allocator.mig(mig_pairs({0: 1}), [], 2)


def test_mig_topology_from_the_model_is_usable(impl):
    mig = tuple(MigDevice(f"MIG-a-{i}", 0, i, "1g.10gb", 9856) for i in range(3))
    topo = Topology.build(
        [Gpu(0, "GPU-a", "A100", mig_enabled=True, mig_devices=mig, numa_node=0)], []
    )
    got = AllocationEngine(topo).mig([(m.uuid, m.parent_index) for m in mig], [], 2)
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
            got = allocator.best_set(list(range(n)), [], size)
            assert len(got) == size == len(set(got)) and got == sorted(got), (name, size)
            assert topo.set_score(got) <= allocator.best_score_for_size(size), (name, size)


def test_nvswitch_machines_fill_one_socket_before_the_other(impl, builtin_topologies):
    topo = builtin_topologies["dgx-h100"]
    got = AllocationEngine(topo).best_set(list(range(8)), [], 4)
    assert len({topo.gpus[i].numa_node for i in got}) == 1


def test_replica_counts_beyond_the_kernel_limit_keep_the_order_of_loads(impl):
    # the kernel takes loads up to 2**62: larger ones are shrunk, keeping every comparison
    allocator = AllocationEngine(pcie_pairs_node())
    free = {0: [0, 1], 2: [0], 4: [5, 6, 7]}
    small = {0: 5, 2: 9, 4: 7}
    huge = {g: 2**70 + 1000 * c for g, c in small.items()}
    for policy in ("distributed", "packed"):
        for size in (1, 2, 4):
            expected = allocator.replicas(replica_pairs(free), [], size, policy, replicas_per_gpu=small)
            got = allocator.replicas(replica_pairs(free), [], size, policy, replicas_per_gpu=huge)
            assert got == expected, (policy, size)
