"""Metrics: dcgm-exporter names/types/labels, snapshot semantics, pod attribution, service.

Every test that samples runs the real ``NvmlBackend`` on the fake ``pynvml`` of a simulated
machine (``metrics_support``), with the fake's telemetry knobs and fault injection."""

from __future__ import annotations

import csv
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent.attribution import ContainerRef
from agent.attribution.holders import Attribution, DeviceIdResolver, PodResourcesCache
from agent.config import Config
from agent.kubelet.podresources import PodResourcesClient
from agent.metrics.collector import GpuCollector, PlacementScorer, render_text
from agent.metrics.fields import DCGM_METRICS
from agent.metrics.sampler import Sampler
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from tests.testbed.metrics_support import (
    Clock,
    PodResourcesStub,
    by_gpu,
    collect_text,
    families,
    listing,
    node_of,
    open_node,
    pod,
    samples_of,
    small_machine,
)

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm"


def agent_metrics(node) -> AgentMetrics:
    """The agent's own metrics on a registry of their own, built first (as the daemon does)."""
    return AgentMetrics(CollectorRegistry(auto_describe=True), node.backend)


def dcgm_default_counters() -> dict[str, tuple[str, str]]:
    """name -> (type, help) of the uncommented lines of dcgm-exporter's default list."""
    out = {}
    with open(FIXTURES / "dcgm-exporter-default-counters.csv") as f:
        for row in csv.reader(line for line in f if line.strip() and not line.startswith("#")):
            name, kind, help_text = (c.strip() for c in row[:3])
            out[name] = (kind, help_text)
    return out


@pytest.fixture
def box():
    """4 H100s in NVLinked pairs, MIG on GPU 3 (metrics_support.small_machine)."""
    with node_of(small_machine(4)) as node:
        yield node


@pytest.fixture
def box2():
    with node_of(small_machine(2)) as node:
        yield node


# ------------------------------------------------------------------ names, types, help
def test_every_exported_default_counter_has_dcgm_exporters_type_and_help():
    defaults = dcgm_default_counters()
    assert len(defaults) > 10  # the fixture CSV was read: the loop below checks something
    ours = {m.name: m for m in DCGM_METRICS}
    for name, (kind, help_text) in defaults.items():
        if kind == "label" or name == "DCGM_FI_DEV_VGPU_LICENSE_STATUS":
            continue  # the driver version is a label; vGPU licensing exists only in guests
        assert name in ours, name
        assert ours[name].kind == kind, name
        assert ours[name].help.rstrip(".") == help_text.rstrip("."), name


def test_counters_are_typed_under_their_dcgm_name_without_total_suffix(box2):
    text = collect_text(box2)
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert re.search(r"^DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION\{", text, re.M)
    assert "_total_total" not in text and "_created" not in text
    assert families(text)["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "counter"


def test_series_carry_dcgm_exporters_labels_with_nvml_bus_id_spelling(box2):
    box2.lib.set_value(1, "gpu_temp_c", 51)
    text = collect_text(box2)
    line = next(ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_TEMP{gpu=\"1\""))
    assert line == (
        'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-00000001-aaaa-bbbb-cccc-000000000000",'
        'pci_bus_id="00000000:28:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",'
        'Hostname="node-a",DCGM_FI_DRIVER_VERSION="550.54.15"} 51.0'
    )


def test_values_are_in_dcgm_exporters_units(box2):
    knobs = {"power_w": 300, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619,
             "memory_used_mib": 1024, "memory_temp_c": 45, "ecc_sbe_volatile": 7,
             "ecc_dbe_volatile": 0, "remapped_correctable": 2, "remapped_uncorrectable": 1,
             "gpu_util_pct": 60, "tensor_active_pct": 25, "dram_active_pct": 10,
             "pcie_tx_kbps": 3 * 1024, "dec_util_pct": 5}
    for knob, value in knobs.items():
        box2.lib.set_value(0, knob, value)
    text = collect_text(box2)
    value = {f.name: s.value for f in families(text).values() for s in f.samples
             if s.labels.get("gpu") == "0"}
    reserved_mib = 600  # the fake reserves min(1 %, 600 MiB) of an H100's 81559 MiB
    assert value["DCGM_FI_DEV_POWER_USAGE"] == 300.0  # W from mW
    assert value["DCGM_FI_DEV_SM_CLOCK"] == 1980 and value["DCGM_FI_DEV_MEM_CLOCK"] == 2619
    assert value["DCGM_FI_DEV_FB_USED"] == 1024 and value["DCGM_FI_DEV_FB_RESERVED"] == reserved_mib
    assert value["DCGM_FI_DEV_FB_FREE"] == 81559 - 1024 - reserved_mib
    assert value["DCGM_FI_DEV_MEMORY_TEMP"] == 45
    assert value["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] > 0
    assert value["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] == 7 and value["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == 0
    assert value["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"] == 2
    assert value["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"] == 1
    assert value["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(0.60)
    assert value["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] == pytest.approx(0.25)
    assert value["DCGM_FI_PROF_DRAM_ACTIVE"] == pytest.approx(0.10)
    assert value["DCGM_FI_PROF_PCIE_TX_BYTES"] == 3 * 2**20  # from GPM's MiB/s
    assert value["DCGM_FI_DEV_XID_ERRORS"] == 0
    assert value["DCGM_FI_DEV_DEC_UTIL"] == 5


def test_every_default_counter_is_exported_for_a_gpm_capable_gpu(box2):
    names = set(families(collect_text(box2)))
    assert {m.name for m in DCGM_METRICS} <= names


# ------------------------------------------------------------------ GPM and fallbacks
def test_gpm_ratios_appear_from_the_second_round_on(box2):
    text = collect_text(box2, rounds=1)
    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" not in text
    assert "DCGM_FI_DEV_GPU_TEMP" in text


def test_gpm_samples_are_freed_every_round_and_on_stop(box2):
    sampler = box2.sampler()
    for _ in range(3):
        sampler.sample_once()
    calls = box2.lib.calls
    # one sample per GPU is kept between rounds, every older one is freed
    assert calls["nvmlGpmSampleAlloc"] - calls["nvmlGpmSampleFree"] == 2
    sampler.stop()
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"]


def test_without_gpm_ratios_are_absent_and_pcie_bytes_come_from_pcie_throughput(box2):
    box2.lib.make_unsupported("nvmlGpmQueryDeviceSupport")
    box2.lib.set_value(0, "pcie_tx_kbps", 1000)
    text = collect_text(box2)
    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" not in text
    assert by_gpu(text, "DCGM_FI_PROF_PCIE_TX_BYTES")["0"] == 1000 * 1024
    assert box2.lib.calls["nvmlGpmSampleGet"] == 0


def test_memory_info_falls_back_to_v1_without_reserved(box2, monkeypatch):
    # a library whose v2 version the driver does not know (an older driver)
    monkeypatch.setattr(box2.lib, "nvmlMemory_v2", box2.lib.nvmlMemory_v2 + 1)
    text = collect_text(box2)
    assert set(by_gpu(text, "DCGM_FI_DEV_FB_USED")) == {"0", "1"}
    assert by_gpu(text, "DCGM_FI_DEV_FB_RESERVED") == {}


# ------------------------------------------------------------------ missing data
def test_unsupported_field_is_an_absent_series_and_the_rest_is_served(box2):
    box2.lib.make_unsupported("nvmlDeviceGetTotalEccErrors", index=1)
    text = collect_text(box2)
    assert list(by_gpu(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")) == ["0"]
    assert len(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == 2


def test_failing_nvml_function_drops_that_field_only(box2):
    box2.lib.fail("nvmlDeviceGetPowerUsage", box2.lib.NVML_ERROR_UNKNOWN, index=0)
    text = collect_text(box2)
    assert list(by_gpu(text, "DCGM_FI_DEV_POWER_USAGE")) == ["1"]
    assert len(by_gpu(text, "DCGM_FI_DEV_GPU_UTIL")) == 2


def test_lost_gpu_disappears_from_the_scrape_and_the_others_stay():
    with node_of(small_machine(3)) as node:
        node.lib.lose_gpu(1)
        text = collect_text(node)
        assert sorted(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == ["0", "2"]
        assert node.backend.lost_gpus == {1}


def test_a_scrape_never_calls_nvml(box2):
    sampler = box2.sampler()
    sampler.sample_once()
    registry = CollectorRegistry()
    registry.register(GpuCollector(box2.topology, hostname="h",
                                   snapshot=lambda: sampler.snapshot))
    before = sum(box2.lib.calls.values())
    for _ in range(5):
        render_text(registry)
    assert sum(box2.lib.calls.values()) == before


def test_scrape_before_the_first_round_serves_topology_but_no_telemetry(box2):
    registry = CollectorRegistry()
    registry.register(GpuCollector(box2.topology, hostname="h"))
    text = render_text(registry).decode()
    assert "DCGM_FI_DEV_GPU_TEMP" not in text
    assert len(samples_of(text, "gpu_topology_info")) == 2


def test_recorded_xid_is_exported_as_the_last_xid(box2):
    sampler = box2.sampler()
    sampler.record_xid(1, 48)
    sampler.record_xid(1, 79)
    snap = sampler.sample_once()
    assert snap.gpus[1]["DCGM_FI_DEV_XID_ERRORS"] == 79
    assert snap.gpus[0]["DCGM_FI_DEV_XID_ERRORS"] == 0


def test_sampler_rejects_a_non_positive_interval(box2):
    with pytest.raises(ValueError, match="sample interval must be > 0 s, got 0"):
        Sampler(box2.backend.sample_source(), box2.topology, interval_s=0)


# ------------------------------------------------------------------ topology metrics
def test_topology_info_names_numa_node_island_clique_and_nearest_nic(box):
    text = collect_text(box)
    info = {s.labels["gpu"]: s.labels for s in samples_of(text, "gpu_topology_info")}
    assert info["0"]["numa_node"] == "0" and info["3"]["numa_node"] == "1"
    assert info["0"]["nvlink_island"] == "0" and info["2"]["nvlink_island"] == "1"
    assert info["1"]["nvlink_clique"] == "0" and info["3"]["nvlink_clique"] == "1"
    assert info["2"]["nearest_nic"] == "mlx5_1"


def test_placement_quality_is_one_for_an_ideal_pair_and_lower_for_a_split_pair(box):
    topo = box.topology
    scorer = PlacementScorer(topo)
    assert scorer.ratio([0, 1]) == 1.0
    assert scorer.ratio([0, 2]) == pytest.approx(topo.pair_score(0, 2) / topo.pair_score(0, 1))
    assert scorer.ratio([3]) == 1.0


def test_idle_seconds_count_from_the_last_busy_sample_or_the_allocation(box2):
    clock = Clock(1000.0)
    topo = box2.topology
    box2.lib.set_value(0, "gpu_util_pct", 40)
    box2.lib.set_value(1, "gpu_util_pct", 41)
    sampler = box2.sampler(clock, idle_threshold_pct=5.0)
    sampler.sample_once()  # both GPUs busy at t=1000
    box2.lib.set_value(0, "gpu_util_pct", 0)
    box2.lib.set_value(1, "gpu_util_pct", 0)
    clock.t = 1600.0
    sampler.sample_once()
    ref_a, ref_b = ContainerRef("ml", "trainer", "main"), ContainerRef("ml", "late", "main")
    attribution = Attribution(
        containers={ref_a: (0,), ref_b: (1,)}, by_gpu={0: (ref_a,), 1: (ref_b,)},
        first_seen={(ref_a, 0): 500.0, (ref_b, 1): 1500.0})
    clock.t = 2800.0
    registry = CollectorRegistry()
    registry.register(GpuCollector(topo, hostname="h", snapshot=lambda: sampler.snapshot,
                                   attribution=lambda: attribution, clock=clock))
    assert registry.get_sample_value("gpu_topology_allocated_idle_seconds",
                                     {"gpu": "0", "UUID": topo.gpus[0].uuid, "Hostname": "h",
                                      "container": "main", "namespace": "ml",
                                      "pod": "trainer"}) == 1800.0
    assert registry.get_sample_value("gpu_topology_allocated_idle_seconds",
                                     {"gpu": "1", "UUID": topo.gpus[1].uuid, "Hostname": "h",
                                      "container": "main", "namespace": "ml",
                                      "pod": "late"}) == 1300.0


# ------------------------------------------------------------------ pod attribution
def test_device_ids_map_back_to_gpus_through_the_topology(box):
    topo = box.topology
    r = DeviceIdResolver(topo)
    assert r.resolve(topo.gpus[2].uuid) == 2
    assert r.resolve(topo.gpus[2].uuid + "::3") == 2
    assert r.resolve(topo.gpus[3].mig_devices[0].uuid) == 3
    assert r.resolve("GPU-unknown") is None
    assert r.resolve("1") is None
    assert DeviceIdResolver(topo, index_ids=True).resolve("1") == 1
    assert DeviceIdResolver(topo, index_ids=True).resolve("3:0") == 3
    assert DeviceIdResolver(topo, index_ids=True).resolve("9") is None


@pytest.fixture
def kubelet(tmp_path):
    stub = PodResourcesStub(str(tmp_path / "kubelet.sock")).start()
    yield stub
    stub.stop()


def refreshed(kubelet, topo, **kwargs) -> PodResourcesCache:
    cache = PodResourcesCache(PodResourcesClient(kubelet.socket_path, timeout_s=2), topo,
                              refresh_s=60, **kwargs)
    return cache


def test_pods_sharing_a_gpu_each_get_their_own_series(kubelet, box):
    g = box.topology.gpus
    kubelet.list_response = listing(
        pod("ml", "a", {"main": [("nvidia.com/gpu", [g[0].uuid + "::0"])]}),
        pod("ml", "b", {"main": [("nvidia.com/gpu", [g[0].uuid + "::1"])]}),
        pod("web", "c", {"side": [("nvidia.com/mig-1g.10gb", [g[3].mig_devices[0].uuid])],
                         "nogpu": [("example.com/foo", ["x"])]}),
    )
    cache = refreshed(kubelet, box.topology)
    assert cache.refresh_once()
    cache.client.close()
    text = collect_text(box, attribution=cache.current)
    temps = [(s.labels["gpu"], s.labels.get("pod"), s.labels.get("namespace"),
              s.labels.get("container")) for s in samples_of(text, "DCGM_FI_DEV_GPU_TEMP")]
    assert sorted(temps, key=str) == sorted([
        ("0", "a", "ml", "main"), ("0", "b", "ml", "main"), ("1", None, None, None),
        ("2", None, None, None), ("3", "c", "web", "side")], key=str)


def test_multi_gpu_container_gets_a_placement_ratio(kubelet, box):
    g = box.topology.gpus
    kubelet.list_response = listing(
        pod("ml", "good", {"m": [("nvidia.com/gpu", [g[0].uuid, g[1].uuid])]}),
        pod("ml", "bad", {"m": [("nvidia.com/gpu", [g[1].uuid, g[2].uuid])]}))
    cache = refreshed(kubelet, box.topology)
    cache.refresh_once()
    cache.client.close()
    text = collect_text(box, attribution=cache.current)
    ratio = {s.labels["pod"]: s for s in samples_of(text, "gpu_topology_placement_quality_ratio")}
    assert ratio["good"].value == 1.0
    assert ratio["bad"].value < 0.5
    assert ratio["bad"].labels["gpu_count"] == "2" and ratio["bad"].labels["gpus"] == "1,2"


def test_failed_list_keeps_the_last_attribution_and_counts_the_error(kubelet, box2):
    topo = box2.topology
    kubelet.list_response = listing(
        pod("ml", "a", {"main": [("nvidia.com/gpu", [topo.gpus[0].uuid])]}))
    errors = []
    cache = refreshed(kubelet, topo, on_error=lambda: errors.append(1))
    assert cache.refresh_once()
    kubelet.stop()  # the kubelet restarts: List fails
    assert cache.refresh_once() is False
    cache.client.close()
    assert errors == [1]
    assert cache.current.by_gpu[0] == (ContainerRef("ml", "a", "main"),)


def test_first_seen_is_kept_across_refreshes(kubelet, box2):
    topo = box2.topology
    kubelet.list_response = listing(
        pod("ml", "a", {"main": [("nvidia.com/gpu", [topo.gpus[0].uuid])]}))
    clock = Clock(100.0)
    cache = refreshed(kubelet, topo, clock=clock)
    cache.refresh_once()
    clock.t = 200.0
    cache.refresh_once()
    cache.client.close()
    assert cache.current.first_seen[(ContainerRef("ml", "a", "main"), 0)] == 100.0


# ------------------------------------------------------------------ service over HTTP
def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_service_serves_metrics_health_and_readiness(kubelet, box2):
    topo = box2.topology
    kubelet.list_response = listing(
        pod("ml", "a", {"main": [("nvidia.com/gpu", [topo.gpus[1].uuid])]}))
    ready = {"value": False}
    config = Config(metrics_address="127.0.0.1:0", pod_resources_socket=kubelet.socket_path,
                    sample_interval_s=60, pod_resources_refresh_s=60)
    service = MetricsService(box2.backend, topo, config, hostname="node-a",
                             ready=lambda: ready["value"], agent_metrics=agent_metrics(box2))
    service.start()
    try:
        base = f"http://127.0.0.1:{service.port}"
        assert get(base + "/health") == (200, "ok\n")
        assert get(base + "/ready")[0] == 503
        ready["value"] = True
        assert get(base + "/ready")[0] == 200
        assert get(base + "/nope")[0] == 404
        # the threads' first round and refresh (the next ones are a minute away)
        assert eventually(lambda: service.sampler.snapshot.rounds == 1
                          and bool(service.pod_resources.current.containers))
        # the kubelet's answer changes: a scrape that called List would show pod b
        kubelet.list_response = listing(
            pod("ml", "b", {"main": [("nvidia.com/gpu", [topo.gpus[1].uuid])]}))
        for _ in range(5):
            status, body = get(base + "/metrics")
            assert status == 200
            temps = samples_of(body, "DCGM_FI_DEV_GPU_TEMP")
            # never one List per scrape: the attribution of the last refresh
            assert [s.labels.get("pod") for s in temps if s.labels["gpu"] == "1"] == ["a"]
        assert samples_of(body, "gpu_agent_samples")[0].value >= 1
    finally:
        service.stop()
        service.stop()


def test_the_fields_table_lists_every_agent_and_topology_series_the_agent_registers(box2):
    import types

    from agent.metrics import fields

    registry = CollectorRegistry()
    AgentMetrics(registry, backend=types.SimpleNamespace(error_counts={}))
    collector = GpuCollector(box2.topology, hostname="h")
    registry.register(collector)
    families = [*registry.collect(), *collector.describe()]
    registered = {f.name + "_total" if f.type == "counter" else f.name for f in families
                  if f.name.startswith(("gpu_agent_", "gpu_topology_"))}
    documented = set(re.findall(r"^((?:gpu_agent|gpu_topology)_\w+)", fields.__doc__ or "", re.M))
    assert len(registered) >= 20  # the self-metrics, the per-pod and the topology series
    assert registered - documented == set(), "missing from agent/metrics/fields.py's table"
    assert documented - registered == set(), "in agent/metrics/fields.py's table, not registered"


def test_agent_metrics_record_what_other_components_report(box2):
    box2.lib.fail("nvmlDeviceGetPowerUsage", box2.lib.NVML_ERROR_UNKNOWN, index=0)
    service = MetricsService(box2.backend, box2.topology, Config(metrics_address="127.0.0.1:0"),
                             hostname="h", ready=lambda: True, agent_metrics=agent_metrics(box2))
    for _ in range(3):
        service.sampler.sample_once()
    am = service.agent_metrics
    am.observe_preferred_allocation(0.0004)
    am.registration("nvidia.com/gpu")
    am.registration("nvidia.com/gpu")
    am.kubelet_restart()
    am.devices_offered([("nvidia.com/gpu", "GPU-1", False)])
    reg = service.registry
    assert reg.get_sample_value("gpu_agent_preferred_allocation_seconds_count") == 1
    assert reg.get_sample_value("gpu_agent_preferred_allocation_seconds_bucket",
                                {"le": "0.0005"}) == 1
    assert reg.get_sample_value("gpu_agent_registrations_total",
                                {"resource": "nvidia.com/gpu"}) == 2
    assert reg.get_sample_value("gpu_agent_kubelet_restarts_total") == 1
    assert reg.get_sample_value("gpu_agent_device_healthy",
                                {"resource": "nvidia.com/gpu", "device": "GPU-1"}) == 0
    am.devices_offered([("nvidia.com/gpu", "GPU-2", True)])  # the whole table: no stale series
    assert reg.get_sample_value("gpu_agent_device_healthy",
                                {"resource": "nvidia.com/gpu", "device": "GPU-1"}) is None
    assert reg.get_sample_value("gpu_agent_device_healthy",
                                {"resource": "nvidia.com/gpu", "device": "GPU-2"}) == 1
    assert reg.get_sample_value("gpu_agent_nvml_errors_total",
                                {"function": "nvmlDeviceGetPowerUsage"}) == 3
    text = service.render().decode()
    assert "# TYPE gpu_agent_nvml_errors_total counter" in text
    assert "# TYPE gpu_agent_preferred_allocation_seconds histogram" in text
    assert families(text)["gpu_agent_preferred_allocation_seconds"].type == "histogram"


def test_the_service_registers_on_the_registry_of_the_agent_metrics_it_is_given(box2):
    registry = CollectorRegistry()
    service = MetricsService(box2.backend, box2.topology, Config(metrics_address="127.0.0.1:0"),
                             hostname="h", ready=lambda: True, agent_metrics=AgentMetrics(registry, box2.backend))
    service.sampler.sample_once()
    assert service.registry is registry
    assert registry.get_sample_value("gpu_agent_samples_total") == 1
    assert registry.get_sample_value(
        "DCGM_FI_DEV_GPU_TEMP", {**dict(service.collector._labels[0])}) is not None


def test_served_body_equals_the_rendered_registry_and_follows_new_snapshots(box2):
    clock = Clock()
    service = MetricsService(box2.backend, box2.topology, Config(metrics_address="127.0.0.1:0"),
                             hostname="h", ready=lambda: True, agent_metrics=agent_metrics(box2), clock=clock)
    service.sampler.sample_once()
    first = service.render()
    assert first == service.render()  # from the cache this time
    box2.lib.set_value(0, "gpu_temp_c", 77)
    service.sampler.sample_once()
    body = service.render().decode()
    assert by_gpu(body, "DCGM_FI_DEV_GPU_TEMP")["0"] == 77
    assert service.render() == render_text(service.registry)


# ------------------------------------------------------------------ robustness
MAY_BE_UNSUPPORTED = ["nvmlDeviceGetTemperature", "nvmlDeviceGetMemoryInfo",
                      "nvmlDeviceGetFieldValues", "nvmlGpmQueryDeviceSupport",
                      "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetRemappedRows",
                      "nvmlDeviceGetClockInfo", "nvmlGpmMetricsGet"]
MAY_FAIL = ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors", "nvmlGpmSampleGet",
            "nvmlDeviceGetPcieThroughput"]


@settings(max_examples=30, deadline=None)
@given(
    unsupported=st.sets(st.tuples(st.sampled_from(MAY_BE_UNSUPPORTED),
                                  st.one_of(st.none(), st.integers(0, 3)))),
    failing=st.sets(st.tuples(st.sampled_from(MAY_FAIL),
                              st.one_of(st.none(), st.integers(0, 3)))),
    lost=st.sets(st.integers(0, 3)),
)
def test_any_mix_of_missing_failing_and_lost_still_gives_a_valid_scrape(unsupported, failing, lost):
    with node_of(small_machine(4)) as node:
        for function, index in unsupported:
            node.lib.make_unsupported(function, index=index)
        for function, index in failing:
            node.lib.fail(function, node.lib.NVML_ERROR_UNKNOWN, index=index)
        for index in lost:
            node.lib.lose_gpu(index)
        text = collect_text(node)
        temps = set(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP"))
        hidden = {str(g) for g in lost} | {
            str(g) for g in range(4)
            if ("nvmlDeviceGetTemperature", None) in unsupported
            or ("nvmlDeviceGetTemperature", g) in unsupported}
        assert temps == {str(g) for g in range(4)} - hidden
        # topology info never depends on NVML
        assert len(samples_of(text, "gpu_topology_info")) == 4


def test_every_metric_our_dashboard_uses_is_exported(box2):
    dashboard = json.loads((Path(__file__).parent.parent / "daemonset" / "helm" / "gpu-topology-agent" /
                            "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set()
    for expr in exprs:
        used |= set(re.findall(r"\b((?:DCGM_FI|gpu_topology|gpu_agent)_[A-Za-z0-9_]+)", expr))
    box2.lib.set_value(0, "processes", [(4242, 1024)])  # the per-pod series need a process
    service = MetricsService(box2.backend, box2.topology,
                             Config(metrics_address="127.0.0.1:0",
                                    proc_root=box2.machine.proc_root), hostname="h",
                             ready=lambda: True, agent_metrics=agent_metrics(box2))
    service.sampler.sample_once()
    service.sampler.sample_once()
    service.agent_metrics.observe_preferred_allocation(0.001)
    service.agent_metrics.devices_offered([("nvidia.com/gpu", "GPU-x", True)])
    service.agent_metrics.registration("nvidia.com/gpu")
    body = service.render().decode()
    exported = {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", body, re.M)}
    exported |= {n + "_bucket" for n in exported}
    missing = {u for u in used if u not in exported}
    # per-container series exist only with pods; they are typed all the same
    assert missing == set(), missing


def test_placement_scores_are_prepared_on_refresh_so_scrapes_never_compute_them(kubelet, box):
    g = box.topology.gpus
    kubelet.list_response = listing(
        pod("ml", "x", {"m": [("nvidia.com/gpu", [g[0].uuid, g[2].uuid, g[3].uuid])]}))
    config = Config(metrics_address="127.0.0.1:0", pod_resources_socket=kubelet.socket_path)
    service = MetricsService(box.backend, box.topology, config, hostname="h", ready=lambda: True,
                             agent_metrics=agent_metrics(box))
    service.pod_resources.refresh_once()
    service.pod_resources.client.close()

    def forbidden(size):
        raise AssertionError(f"best score for size {size} computed during a scrape")

    service.scorer._compute_best = forbidden
    ratio = samples_of(service.render().decode(), "gpu_topology_placement_quality_ratio")
    assert [(s.labels["pod"], s.labels["gpu_count"]) for s in ratio] == [("x", "3")]


def test_open_node_reads_every_built_in_machine_it_is_given():
    node = open_node("single-gpu")
    try:
        text = collect_text(node)
        assert set(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == {"0"}
        assert by_gpu(text, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL") == {}  # an A10: no NVLink
    finally:
        node.close()
