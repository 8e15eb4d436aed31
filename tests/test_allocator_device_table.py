"""``AllocationEngine.replicas_in`` (IDs looked up in a per-resource device table) gives
exactly ``replicas()``'s answers and errors, on both engines."""

from __future__ import annotations

import random

import pytest

from agent.errors import AllocationError
from agent.topology.allocator import AllocationEngine
from agent.topology.synthetic import synthetic_islands_topology

pytestmark = pytest.mark.usefixtures("impl")  # every test on both engines (conftest.py)


def _outcome(call, *args, **kwargs):
    try:
        return ("ok", call(*args, **kwargs))
    except AllocationError as e:
        return ("error", str(e))


def test_replicas_in_answers_and_fails_exactly_as_replicas_on_pairs():
    topo = synthetic_islands_topology()
    eng = AllocationEngine(topo)
    every = [(f"GPU-{g}::{r}", g) for g in range(8) for r in range(12)]
    table = eng.device_table(every)
    rng = random.Random(3)
    outcomes = set()
    for _ in range(400):
        pairs = [p for p in every if rng.random() < rng.choice([0.1, 0.5, 0.9])]
        rng.shuffle(pairs)
        ids = [d for d, _ in pairs]
        must = rng.sample(ids, min(len(ids), rng.choice([0, 0, 1, 3])))
        if rng.random() < 0.1 and ids:
            ids.append(ids[0])
            pairs.append(pairs[0])
        if rng.random() < 0.1 and must:
            must.append(must[0])
        size = rng.choice([0, 1, 2, 5, 12, 500, True])
        policy = rng.choice(["distributed", "packed", "bogus"])
        per = rng.choice([None, 12, {g: 12 + g for g in range(8)}])
        want = _outcome(eng.replicas, pairs, must, size, policy, replicas_per_gpu=per)
        got = _outcome(eng.replicas_in, table, ids, must, size, policy, replicas_per_gpu=per)
        assert got == want
        outcomes.add(want[0])
    assert outcomes == {"ok", "error"}  # both kinds were compared


def test_replicas_in_names_an_id_the_table_does_not_hold():
    eng = AllocationEngine(synthetic_islands_topology())
    table = eng.device_table([("GPU-0::1", 0), ("GPU-0::2", 0)])
    with pytest.raises(AllocationError, match="'GPU-9::1' is not a device of this resource"):
        eng.replicas_in(table, ["GPU-0::1", "GPU-9::1"], [], 1)


def test_a_device_table_rejects_a_duplicate_id():
    eng = AllocationEngine(synthetic_islands_topology())
    with pytest.raises(AllocationError, match="duplicate device ID GPU-0::1"):
        eng.device_table([("GPU-0::1", 0), ("GPU-0::1", 1)])
