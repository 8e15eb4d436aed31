"""The Cython engine and its pure-Python twin agree with each other and with brute force.

Brute force here enumerates the issue-3 objective directly from its definition: every k-set
G with R ⊆ G ⊆ A, criterion 1 from every partition of A \\ G into k-groups plus one group of
the ``|A \\ G| mod k`` remaining GPUs (the same remainder definition as the allocator's
docstring), then criteria 2-5.
"""

from __future__ import annotations

import itertools

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
    n = draw(st.integers(0, 16))
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
    for impl in (_topo, _pure):
        solver = impl.AllocationSolver(s, [0, 0])
        for args in ((0b11, 0b00, 3), (0b01, 0b10, 1), (0b100, 0, 1), (0b11, 0, 0)):
            try:
                solver.rank(*args)
            except ValueError:
                continue
            raise AssertionError(f"{impl.__name__} accepted {args}")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(st.integers(-2, 20), st.booleans(), st.text(max_size=2)), max_size=12),
    st.lists(st.integers(-1, 20), max_size=4),
    st.integers(1, 16),
)
def test_request_conversion_agrees_and_rejects_the_same_inputs(available, must_include, n):
    outcomes = []
    for impl in (_topo, _pure):
        try:
            outcomes.append(impl.request_masks(available, must_include, n))
        except ValueError:
            outcomes.append("rejected")
    assert outcomes[0] == outcomes[1]
    valid = (
        all(type(v) is int and 0 <= v < n for v in available + must_include)
        and len(set(available)) == len(available)
        and len(set(must_include)) == len(must_include)
    )
    assert (outcomes[0] != "rejected") == valid
    if valid:
        mask = outcomes[0][0]
        assert _topo.mask_indices(mask) == _pure.mask_indices(mask) == sorted(available)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.one_of(st.text(max_size=6), st.integers(0, 3)),
        st.one_of(st.integers(-1, 9), st.booleans()),
        max_size=10,
    ),
    st.integers(1, 8),
)
def test_device_grouping_agrees_and_rejects_the_same_inputs(parent, n):
    outcomes = []
    for impl in (_topo, _pure):
        try:
            outcomes.append(impl.group_devices(parent, n))
        except ValueError:
            outcomes.append("rejected")
    assert outcomes[0] == outcomes[1]
    valid = all(type(d) is str and d and type(g) is int and 0 <= g < n for d, g in parent.items())
    assert (outcomes[0] != "rejected") == valid
    if valid:
        assert sorted(d for ids in outcomes[0].values() for d in ids) == sorted(parent)
        assert all(parent[d] == g for g, ids in outcomes[0].items() for d in ids)


# ---------------------------------------------------------------------------- whole requests
@settings(max_examples=150, deadline=None)
@given(
    problems(max_gpus=9),
    st.lists(st.one_of(st.integers(-1, 10), st.booleans(), st.just("1")), max_size=3),
    st.integers(-1, 11),
)
def test_choose_agrees_between_extension_and_twin_and_with_rank(problem, extra, size):
    s, numa, available, required, k = problem
    for request in ((available, required, k), (available + extra, required, size)):
        answers = [impl.choose(impl.AllocationSolver(s, numa), *request) for impl in (_topo, _pure)]
        assert answers[0] == answers[1]
    ranked = _pure.AllocationSolver(s, numa).rank(_mask(available), _mask(required), k, 1)
    assert _topo.choose(_topo.AllocationSolver(s, numa), available, required, k) == _members(
        ranked[0][0]
    )


REPLICA_ID_FORMS = ("GPU-{g}::{r}", "GPU-{g}::0{r}", "GPU-{g}", "GPU-{g}::x{r}", "r{r}::{g}")


@st.composite
def replica_requests(draw):
    s, numa, _, _, _ = draw(problems(max_gpus=8))
    n = len(s)
    pairs = []
    for g in range(n):
        for r in sorted(draw(st.sets(st.integers(0, 12), max_size=5))):
            form = draw(st.sampled_from(REPLICA_ID_FORMS[:1] * 6 + REPLICA_ID_FORMS[1:]))
            pairs.append((form.format(g=g, r=r), g))
    pairs = draw(st.permutations(pairs))
    ids = [d for d, _ in pairs]
    must = draw(st.lists(st.sampled_from(ids) if ids else st.just("none"), max_size=3))
    if draw(st.booleans()):
        pairs = pairs + draw(
            st.lists(
                st.sampled_from([("GPU-0::1", 0), ("", 0), ("z", n), ("z", True), ["GPU-1::7", 1]]),
                max_size=2,
            )
        )
    size = draw(st.integers(0, len(pairs) + 1))
    per_gpu = draw(
        st.one_of(
            st.none(),
            st.integers(0, 20),
            st.dictionaries(st.integers(0, n - 1), st.integers(0, 20), max_size=n),
        )
    )
    return s, numa, pairs, must, size, draw(st.booleans()), per_gpu


@settings(max_examples=200, deadline=None)
@given(replica_requests())
def test_replica_selection_agrees_between_extension_and_twin(request):
    s, numa, pairs, must, size, packed, per_gpu = request
    answers = [
        impl.select_replicas(impl.AllocationSolver(s, numa), pairs, must, size, packed, per_gpu)
        for impl in (_topo, _pure)
    ]
    assert answers[0] == answers[1]
    if answers[0] is not None:
        assert len(answers[0]) == size and len(set(answers[0])) == size
        assert set(must) <= set(answers[0]) <= {d for d, _ in pairs}


def test_extension_declines_only_what_it_does_not_handle_and_the_twin_takes_it():
    s = [[0, 10], [10, 0]]
    cases = [
        ([("GPU-0::é", 0), ("GPU-0::1", 0)], 2, None),  # not ASCII
        ([("GPU-0::" + "9" * 19, 0), ("GPU-0::1", 0)], 2, None),  # a 19-digit replica number
        ([("GPU-0::1", 0), ("GPU-1::1", 1)], 1, 2**70),  # a replica count beyond 2**62
    ]
    for pairs, size, per_gpu in cases:
        assert (
            _topo.select_replicas(
                _topo.AllocationSolver(s, [0, 0]), pairs, [], size, False, per_gpu
            )
            is None
        )
        got = _pure.select_replicas(
            _topo.AllocationSolver(s, [0, 0]), pairs, [], size, False, per_gpu
        )
        assert got is not None and len(got) == size


def test_a_stale_extension_is_not_used(monkeypatch, caplog):
    # an agent._topo built from an older ext/_topo.pyx lacks newer functions: the engine
    # must fall back to the twin (with a warning) instead of failing on the request path
    import types

    import agent
    from agent.topology import engine as engine_module

    stale = types.ModuleType("agent._topo")
    stale.nvlink_islands = lambda adjacency: []  # type: ignore[attr-defined]
    monkeypatch.setattr(agent, "_topo", stale, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "agent._topo", stale)
    monkeypatch.delenv("AGENT_PUREPYTHON", raising=False)
    with caplog.at_level("WARNING", logger="agent.topology.engine"):
        module, name = engine_module._select()
    assert name == "python" and module.__name__ == "agent.topology._pure"
    assert "stale" in caplog.text and "choose" in caplog.text
