"""The device plugin on the built-in simulated machines (topology read by the real NVML
backend from the fake pynvml), driven over the plugin socket."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent.config import Config
from agent.deviceplugin.manager import DevicePluginManager
from agent.discovery import load_topology
from agent.errors import ConfigError
from agent.health import HealthState
from agent.metrics.self_metrics import AgentMetrics
from agent.topology.allocator import AllocationEngine
from tests.testbed.allocation_support import best_set
from tests.testbed.kubelet_stub import KubeletStub, PluginClient


@functools.lru_cache(maxsize=None)
def machine(name: str):
    return load_topology(name)


@pytest.fixture
def serve():
    made = []

    def start(topology, config=Config()):
        kdir = tempfile.mkdtemp(prefix="dm", dir="/tmp")
        from dataclasses import replace

        config = replace(config, kubelet_dir=kdir)
        kubelet = KubeletStub(kdir).start()
        manager = DevicePluginManager(topology, config, HealthState(topology.gpu_count),
                                      events=AgentMetrics(CollectorRegistry()), poll_s=0.05)
        manager.start()
        clients = {r.name: PluginClient(os.path.join(kdir, r.socket_name)) for r in manager.resources}
        made.append((manager, kubelet, clients, kdir))
        assert eventually(manager.ready, 3.0)
        return manager, kubelet, clients

    yield start
    for manager, kubelet, clients, kdir in made:
        for c in clients.values():
            c.close()
        manager.stop(0.2)
        kubelet.stop()
        shutil.rmtree(kdir, ignore_errors=True)


@pytest.mark.parametrize("name", ["dgx1-v100", "pcie-pairs", "dgx-a100", "dgx-h100"])
def test_preferred_allocation_matches_the_engine_on_builtin_machines(serve, name):
    topo = machine(name)
    _, kubelet, clients = serve(topo)
    client = clients["nvidia.com/gpu"]
    engine = AllocationEngine(topo)
    uuids = [g.uuid for g in topo.gpus]
    n = topo.gpu_count
    requests = [(list(range(n)), [], k) for k in (1, 2, 4, n)]
    requests += [(list(range(1, n)), [n - 1], 2), ([i for i in range(n) if i % 3], [1], 3)]
    for available, must, size in requests:
        got = client.preferred([uuids[i] for i in available], [uuids[i] for i in must], size)
        assert got == [uuids[i] for i in best_set(engine, available, must, size)], (available, must, size)
    # the kubelet sees every GPU, with a NUMA node when the machine reports one for all
    # (ready = registered; the first device list comes on the kubelet's ListAndWatch)
    assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") is not None, 5.0)
    devices = kubelet.latest("nvidia.com/gpu").devices
    assert [d.ID for d in devices] == uuids
    if all(g.numa_node is not None for g in topo.gpus):
        assert [d.topology.nodes[0].ID for d in devices] == [g.numa_node for g in topo.gpus]


def test_dgx1_two_gpu_request_gets_an_nvlinked_pair(serve):
    topo = machine("dgx1-v100")
    _, _, clients = serve(topo)
    got = clients["nvidia.com/gpu"].preferred([g.uuid for g in topo.gpus], [], 2)
    a, b = (topo.gpu_by_uuid(u).index for u in got)
    assert topo.link(a, b).nvlinks > 0


def test_mixed_mig_machine_serves_one_resource_per_profile(serve):
    topo = machine("a100-mig")
    manager, kubelet, clients = serve(topo, Config(mig_strategy="mixed", device_id_strategy="index"))
    profiles = sorted({m.profile for g in topo.gpus for m in g.mig_devices})
    assert sorted(clients) == sorted(["nvidia.com/gpu"] + [f"nvidia.com/mig-{p}" for p in profiles])
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == len(clients))
    mig = topo.gpus[0].mig_devices[0]
    resp = clients[f"nvidia.com/mig-{mig.profile}"].allocate([mig.uuid])
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == f"0:{mig.index}"


def test_single_mig_strategy_on_a_mixed_machine_is_a_clear_error():
    with pytest.raises(ConfigError, match="migStrategy single: GPUs .* have MIG disabled"):
        from agent.deviceplugin.resources import build_resources

        build_resources(machine("a100-mig"), Config(mig_strategy="single"))
