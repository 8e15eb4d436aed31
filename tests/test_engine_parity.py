"""The Cython engine and its pure-Python twin agree with each other and with brute force.

Brute force here enumerates the issue-3 objective directly from its definition: every k-set
G with R ⊆ G ⊆ A, criterion 1 from every partition of A \\ G into k-groups plus one group of
the ``|A \\ G| mod k`` remaining GPUs (the same remainder definition as the allocator's
docstring), then criteria 2-5.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import _topo
from agent.topology import _pure

PAIR_VALUES = [0, 10, 20, 30, 40, 50, 60, 100, 110, 150, 200, 230, 250, 1200, 1810]


def _set_score(s, group):
    return sum(s[a][b] for a, b in itertools.combinations(group, 2))


def _partitions(items, k):
    """Every split of ``items`` into k-groups plus one group of len(items) % k (if any)."""
    if not items:
        yield []
        return
    low, others = items[0], items[1:]
    sizes = ([k] if len(items) >= k else []) + ([len(items) % k] if len(items) % k else [])
    for size in sizes:
        for combo in itertools.combinations(others, size - 1):
            left = [x for x in others if x not in combo]
            for rest in _partitions(left, k):
                yield [(low, *combo), *rest]


def brute_force_best(s, numa, available, required, k):
    best_key, best_set = None, None
    free = [a for a in available if a not in required]
    for extra in itertools.combinations(free, k - len(required)):
        g = sorted([*required, *extra])
        rest = [a for a in available if a not in g]
        part = max(sum(_set_score(s, grp) for grp in p) for p in _partitions(rest, k))
        score = _set_score(s, g)
        cut = sum(s[a][b] for a in g for b in rest)
        key = (-(score + part), -score, len({numa[x] for x in g}), cut, g)
        if best_key is None or key < best_key:
            best_key, best_set = key, g
    return best_set


@st.composite
def problems(draw, max_gpus=10):
    n = draw(st.integers(1, max_gpus))
    s = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            s[a][b] = s[b][a] = draw(st.sampled_from(PAIR_VALUES))
    numa = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    available = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
    k = draw(st.integers(1, len(available)))
    required = sorted(draw(st.sets(st.sampled_from(available), max_size=min(k, 3))))
    return s, numa, available, required, k


def _mask(indices):
    return sum(1 << i for i in indices)


def _members(mask):
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_extension_and_twin_choose_the_brute_force_optimum(problem):
    s, numa, available, required, k = problem
    expected = brute_force_best(s, numa, available, required, k)
    for impl in (_topo, _pure):
        ranked = impl.AllocationSolver(s, numa).rank(_mask(available), _mask(required), k, 1)
        assert _members(ranked[0][0]) == expected, impl.__name__


@st.composite
def twin_problems(draw, max_gpus=10):
    """Nodes with interchangeable GPUs (the extension searches the best set once per group of
    them): every GPU has a type, pair scores and NUMA nodes depend on the types only."""
    n = draw(st.integers(2, max_gpus))
    types = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    value = {(a, b): draw(st.sampled_from(PAIR_VALUES)) for a in range(4) for b in range(a, 4)}
    s = [[0 if a == b else value[tuple(sorted((types[a], types[b])))] for b in range(n)]
         for a in range(n)]
    numa_of_type = draw(st.lists(st.integers(0, 1), min_size=4, max_size=4))
    numa = [numa_of_type[t] for t in types]
    available = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
    k = draw(st.integers(1, len(available)))
    required = sorted(draw(st.sets(st.sampled_from(available), max_size=min(k, 3))))
    return s, numa, available, required, k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(twin_problems())
def test_the_best_set_among_interchangeable_gpus_is_the_brute_force_optimum(problem):
    s, numa, available, required, k = problem
    expected = brute_force_best(s, numa, available, required, k)
    a, r = _mask(available), _mask(required)
    for impl in (_topo, _pure):
        solver = impl.AllocationSolver(s, numa)
        assert _members(solver.best_mask(a, r, k)) == expected, impl.__name__
        assert solver.rank(a, r, k, 1) == _pure.AllocationSolver(s, numa).rank(a, r, k, 1)


@settings(max_examples=80, deadline=None)
@given(problems(max_gpus=12), st.integers(1, 8))
def test_extension_and_twin_rank_runners_up_identically(problem, top):
    s, numa, available, required, k = problem
    a = _topo.AllocationSolver(s, numa).rank(_mask(available), _mask(required), k, top)
    b = _pure.AllocationSolver(s, numa).rank(_mask(available), _mask(required), k, top)
    assert a == b
    assert len({entry[0] for entry in a}) == len(a)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_extension_and_twin_agree_on_the_bounded_search_above_16_available(data):
    n = data.draw(st.integers(17, 24))
    s = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            s[a][b] = s[b][a] = data.draw(st.sampled_from(PAIR_VALUES))
    numa = [i * 2 // n for i in range(n)]
    available = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=17)))
    k = data.draw(st.integers(1, len(available)))
    required = sorted(data.draw(st.sets(st.sampled_from(available), max_size=min(k, 2))))
    a = _topo.AllocationSolver(s, numa).rank(_mask(available), _mask(required), k, 3)
    b = _pure.AllocationSolver(s, numa).rank(_mask(available), _mask(required), k, 3)
    assert a == b
    best = _members(a[0][0])
    assert len(best) == k and set(required) <= set(best) <= set(available)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_large_node_with_few_available_is_solved_exactly_on_the_available_gpus(data):
    n = data.draw(st.integers(17, 40))
    s = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            s[a][b] = s[b][a] = data.draw(st.sampled_from(PAIR_VALUES))
    numa = [i % 3 for i in range(n)]
    available = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=9)))
    k = data.draw(st.integers(1, len(available)))
    expected = brute_force_best(s, numa, available, [], k)
    for impl in (_topo, _pure):
        ranked = impl.AllocationSolver(s, numa).rank(_mask(available), 0, k, 2)
        assert _members(ranked[0][0]) == expected


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 9).flatmap(
        lambda n: st.tuples(
            st.just(n), st.lists(st.sampled_from(PAIR_VALUES), min_size=n * n, max_size=n * n)
        )
    )
)
def test_best_score_for_each_size_is_the_best_set_score(args):
    n, flat = args
    s = [[0 if a == b else flat[min(a, b) * n + max(a, b)] for b in range(n)] for a in range(n)]
    for impl in (_topo, _pure):
        solver = impl.AllocationSolver(s, [0] * n)
        for k in range(1, n + 1):
            assert solver.best_score(k) == max(
                _set_score(s, g) for g in itertools.combinations(range(n), k)
            )


@st.composite
def graphs(draw):
    n = draw(st.integers(0, 24))
    adjacency = [0] * n
    for a in range(n):
        for b in range(a + 1, n):
            if draw(st.booleans()):
                adjacency[a] |= 1 << b
                adjacency[b] |= 1 << a
    return adjacency


@settings(max_examples=120, deadline=None)
@given(graphs())
def test_islands_and_cliques_agree_between_extension_and_twin(adjacency):
    assert _topo.nvlink_islands(adjacency) == _pure.nvlink_islands(adjacency)
    assert _topo.maximal_cliques(adjacency) == _pure.maximal_cliques(adjacency)
    # every clique is complete and maximal
    n = len(adjacency)
    for clique in _pure.maximal_cliques(adjacency):
        members = _mask(clique)
        assert all((adjacency[v] | 1 << v) & members == members for v in clique)
        assert not any(v not in clique and adjacency[v] & members == members for v in range(n))


def test_solvers_refuse_impossible_requests_alike():
    s = [[0, 10], [10, 0]]
    for args in ((0b11, 0b00, 3), (0b01, 0b10, 1), (0b100, 0, 1), (0b11, 0, 0)):
        outcomes = [outcome(impl.AllocationSolver(s, [0, 0]).rank, *args) for impl in IMPLS]
        assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ValueError", args


# ----------------------------------------------------------------- errors and every method
IMPLS = (_topo, _pure)


def outcome(fn, *args):
    """``("ok", result)``, or the exception's type name and message."""
    try:
        return ("ok", fn(*args))
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))


def test_both_implementations_export_one_exact_search_limit():
    from agent.topology import kernel

    for name in ("EXACT_MAX_GPUS", "MAX_GPUS", "SCORE_MAX", "COUNT_MAX"):
        assert getattr(_topo, name) == getattr(_pure, name), name
    assert kernel.EXACT_MAX_GPUS == _topo.EXACT_MAX_GPUS == 16


def _node(n, seed=0):
    s = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            s[a][b] = s[b][a] = PAIR_VALUES[(a * 7 + b * 11 + seed) % len(PAIR_VALUES)]
    return s, [i * 2 // n for i in range(n)]


def test_partition_value_on_an_eighteen_gpu_node_agrees_for_every_size():
    # the extension indexed its per-k memo tables (17 of them) with k = 17 and built 2**18
    # tables for a node above the exact limit: garbage where the twin answered
    s, numa = _node(18)
    solvers = [impl.AllocationSolver(s, numa) for impl in IMPLS]
    every = (1 << 18) - 1
    sixteen = every & ~0b101  # 16 GPUs: exact on those alone
    for mask in (every, sixteen, 0b1110110):
        for k in (1, 2, 5, 16, 17, 18):
            got = [outcome(solver.partition_value, mask, k) for solver in solvers]
            assert got[0] == got[1], (mask, k, got)
    assert outcome(solvers[0].partition_value, every, 17)[0] == "ValueError"
    assert outcome(solvers[0].partition_value, sixteen, 17) == ("ok", solvers[1].set_score(sixteen))


def _bad(value_strategy):
    """Valid values, plus the out-of-range and non-int ones every entry point must refuse."""
    return st.one_of(
        value_strategy,
        st.integers(-3, -1),
        st.sampled_from([1 << 64, 1 << 70, -(1 << 70)]),
        st.sampled_from([1.0, "1", None, True]),
    )


@st.composite
def nodes(draw):
    n = draw(st.sampled_from([*range(1, 11), *range(17, 25)]))
    s = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            s[a][b] = s[b][a] = draw(st.sampled_from(PAIR_VALUES))
    return s, draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))


def masks(n, max_bits=10):
    few = st.sets(st.integers(0, n - 1), max_size=min(n, max_bits)).map(_mask)
    return _bad(st.one_of(few, st.just((1 << n) - 1), st.just(1 << n)))


def sizes(n):
    return _bad(st.integers(0, n + 1))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes(), st.data())
def test_every_solver_method_agrees_or_fails_alike_on_nodes_up_to_24_gpus(node, data):
    s, numa = node
    n = len(s)
    solvers = [impl.AllocationSolver(s, numa) for impl in IMPLS]
    mask, k = data.draw(masks(n)), data.draw(sizes(n))
    required, top = data.draw(masks(n, 3)), data.draw(_bad(st.integers(0, 4)))
    calls = [
        ("set_score", (mask,)),
        ("partition_value", (mask, k)),
        ("best_score", (k,)),
        ("rank", (mask, required, k, top)),
        ("best_mask", (mask, required, k)),
    ]
    for name, args in calls:
        got = [outcome(getattr(solver, name), *args) for solver in solvers]
        assert got[0] == got[1], (name, args)
    if type(mask) is int and 0 < mask < 1 << n:  # best_mask is rank's first answer
        size = data.draw(st.integers(1, mask.bit_count()))
        best = [solver.best_mask(mask, 0, size) for solver in solvers]
        assert best[0] == best[1] == solvers[1].rank(mask, 0, size)[0][0]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 5).flatmap(
        lambda n: st.tuples(
            st.lists(
                st.lists(_bad(st.sampled_from(PAIR_VALUES)), min_size=n, max_size=n + 1),
                min_size=n,
                max_size=n,
            ),
            st.lists(_bad(st.integers(0, 70)), min_size=max(n - 1, 0), max_size=n + 1),
        )
    ),
    st.booleans(),
)
def test_solver_construction_refuses_bad_matrices_alike(args, symmetric):
    scores, numa = args
    if symmetric:  # mostly valid matrices, so that numa is checked too
        scores = [
            [0 if a == b else row[b] if a < b or b >= len(scores) else scores[b][a]
             for b in range(len(row))]
            for a, row in enumerate(scores)
        ]
    got = [outcome(lambda impl=impl: impl.AllocationSolver(scores, numa).n) for impl in IMPLS]
    assert got[0] == got[1]


def test_solver_construction_refuses_more_than_64_gpus_alike():
    scores = [[0] * 65 for _ in range(65)]
    got = [outcome(impl.AllocationSolver, scores, [0] * 65) for impl in IMPLS]
    assert got[0] == got[1] == ("ValueError", "at most 64 GPUs, got 65")


@settings(max_examples=80, deadline=None)
@given(st.lists(_bad(st.integers(0, (1 << 6) - 1)), max_size=6), st.integers(0, 3))
def test_islands_cliques_and_mask_indices_refuse_bad_input_alike(adjacency, extra):
    adjacency = adjacency + [0] * extra
    for name in ("nvlink_islands", "maximal_cliques", "mask_indices"):
        arg = adjacency if name != "mask_indices" else (adjacency[0] if adjacency else -1)
        got = [outcome(getattr(impl, name), arg) for impl in IMPLS]
        assert got[0] == got[1], name
    too_many = [0] * 65
    assert outcome(_topo.nvlink_islands, too_many) == outcome(_pure.maximal_cliques, too_many)


@st.composite
def replica_requests(draw):
    """A resource of 0-4 replicas per GPU (``start``), a request's free and required ranks
    (ascending, disjoint) and a size that fits; now and then one bad argument."""
    s, numa = draw(nodes())
    n = len(s)
    per_gpu = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    start = [sum(per_gpu[:g]) for g in range(n + 1)]
    ranks = list(range(start[n]))
    state = draw(st.lists(st.sampled_from("fro"), min_size=len(ranks), max_size=len(ranks)))
    free = [r for r, x in zip(ranks, state) if x == "f"]
    required = [r for r, x in zip(ranks, state) if x == "r"]
    args = [start, free, required, draw(st.integers(len(required), len(required) + len(free)))]
    if draw(st.integers(0, 3)) == 0:
        which = draw(st.integers(0, 4))
        if which == 4 and required:  # a rank both free and required
            args[1] = sorted({*free, required[0]})
        elif which == 3:
            args[3] = draw(_bad(st.integers(len(free) + len(required) + 1, len(free) + 99)))
        elif which == 4 or draw(st.booleans()) or not args[which]:
            which %= 3
            args[which] = [*args[which], draw(st.sampled_from([0, start[n], -1]))]
        else:
            bad = list(args[which])
            bad[draw(st.integers(0, len(bad) - 1))] = draw(_bad(st.just(2**63)))
            args[which] = bad
    return s, numa, args, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(replica_requests())
def test_replica_ranks_agree_or_fail_alike(problem):
    s, numa, args, packed = problem
    got = [outcome(impl.AllocationSolver(s, numa).replica_ranks, *args, packed) for impl in IMPLS]
    assert got[0] == got[1]
    if got[0][0] == "ok":
        _, free, required, size = args
        answer = got[0][1]
        assert len(answer) == size and answer == sorted(answer)
        assert set(required) <= set(answer) <= set(free) | set(required)


def test_a_stale_extension_is_not_used(monkeypatch, caplog):
    # an agent._topo built from an older ext/_topo.pyx lacks newer functions: the engine
    # must fall back to the twin (with a warning) instead of failing on the request path
    import types

    import agent
    from agent.topology import kernel as kernel_module

    stale = types.ModuleType("agent._topo")
    stale.nvlink_islands = lambda adjacency: []  # type: ignore[attr-defined]
    monkeypatch.setattr(agent, "_topo", stale, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "agent._topo", stale)
    monkeypatch.delenv("AGENT_PUREPYTHON", raising=False)
    with caplog.at_level("WARNING", logger="agent.topology.kernel"):
        module, name = kernel_module._select()
    assert name == "python" and module.__name__ == "agent.topology._pure"
    assert "stale" in caplog.text and "AllocationSolver" in caplog.text


@pytest.mark.parametrize("value, engine", [("1", "python"), ("0", "cython"), ("", "cython")])
def test_agent_purepython_picks_the_engine_at_import(value, engine):
    # the switch the README's `AGENT_PUREPYTHON=1 pytest tests/test_allocator.py` relies on (that
    # file runs every test on both engines itself, through the impl fixture)
    out = subprocess.run([sys.executable, "-c", "from agent.topology import kernel; print(kernel.IMPLEMENTATION)"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "AGENT_PUREPYTHON": value})
    assert out.stdout.strip() == engine, out.stderr
