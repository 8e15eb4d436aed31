"""A claim for one GPU set alone, no fallback (``daemonset/dra/examples``' ``best-set-of-4``,
or ``gpu.gpu-agent.io/set-of-4: 1`` in a pod's limits), fits a node exactly where k single
GPUs fit, once the agent has re-rendered for the claims the node holds: it publishes a free set
of every size of ``set_sizes`` wherever that many GPUs are free, whatever it published before
(sets kept because a claim may hold them, sets being withdrawn). So the singles tier of
``[set -> k singles]`` serves only while the scheduler's view lags the claims it allocated, and
the set alone spares the scheduler that tier's search on every node without room
(``bench/bench_dra_scheduler.py``, ``set alone``; ``bench/quality_dra.py`` measures what waiting
for the next rendering costs in placement).

The node's history is random: claims take a free device (set or single GPU) the scheduler
sees, claims end, withdrawal graces run out; after each step the agent re-renders
(``tests/testbed/dra_publishers.py``'s publisher, the one the benches replay) and the scheduler's
allocator (``tests/testbed/dra_allocator_model.py``) is asked for one set of each size alone.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from agent.discovery import load_topology
from agent.dra.gpusets import set_sizes
from tests.testbed.dra_allocator_model import AllocatorModel
from tests.testbed.dra_publishers import agent_publisher
from tests.testbed.dra_shipped_classes import CEL, CLASSES, set_alone
from tests.testbed.dra_views import HISTORY_STEPS, node_history

D = "gpu.gpu-agent.io"
NODE = "node-1"
PUBLISH = agent_publisher()
MACHINES = {name: load_topology(name) for name in ("dgx-h100", "dgx1-v100", "dgx2", "pcie-pairs")}


def claim(request):
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {"devices": {"requests": [request], "constraints": []}}}


def singles(k):
    return {"name": "gpus", "exactly": {"deviceClassName": D, "count": k}}


@pytest.mark.parametrize("machine", sorted(MACHINES))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=HISTORY_STEPS)
def test_a_set_alone_fits_exactly_where_k_single_gpus_fit_once_the_agent_re_rendered(machine, steps):
    topo = MACHINES[machine]
    checked = 0
    for held, _, stored in node_history(PUBLISH, topo, NODE, steps):
        gpus_free = topo.gpu_count - len({g for gpus in held.values() for g in gpus})
        allocated = [(D, NODE, name) for name in held]
        for k in set_sizes(topo):
            got = AllocatorModel(stored, CLASSES, CEL, allocated).allocate([claim(set_alone(k))], NODE)
            assert (got is not None) == (k <= gpus_free), (sorted(held), k)
            if k <= 4:  # k singles through the model too (above, an infeasible search is exponential)
                got = AllocatorModel(stored, CLASSES, CEL, allocated).allocate([claim(singles(k))], NODE)
                assert (got is not None) == (k <= gpus_free), (sorted(held), k, "singles")
            checked += 1
    assert checked
