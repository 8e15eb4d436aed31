"""Metrics end to end on the real NVML code path on the built-in machines: ``NvmlBackend``
over the fake ``pynvml`` of a simulated machine, with its fault injection; and the hw side's
typed samples (``agent.hw.nvml.telemetry``) on their own."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.config import Config
from agent.discovery import read_topology
from agent.hw.protocols import GpuSample
from agent.hw.sim import machines
from agent.metrics.fields import DCGM_METRICS, XID_METRIC, dcgm_values
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from tests.testbed.metrics_support import by_gpu, node_of

ROOT = Path(__file__).resolve().parent.parent

GPM_RATIOS = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
              "DCGM_FI_PROF_DRAM_ACTIVE"}


def service_for(name: str) -> tuple[MetricsService, machines.SimulatedMachine]:
    machine = machines.open_simulated(name)
    backend = machine.backend()
    backend.init()
    topology = read_topology(backend, machine)
    service = MetricsService(backend, topology, Config(metrics_address="127.0.0.1:0"),
                             hostname="sim", ready=lambda: True,
                             agent_metrics=AgentMetrics(CollectorRegistry(), backend))
    return service, machine


def test_every_dcgm_counter_is_exported_for_every_gpu_of_a_dgx_h100():
    service, _ = service_for("dgx-h100")
    service.sampler.sample_once()
    service.sampler.sample_once()
    text = service.render().decode()
    gpus = {str(g.index) for g in service.topology.gpus}
    for m in DCGM_METRICS:
        assert set(by_gpu(text, m.name)) == gpus, m.name


def test_gpus_older_than_hopper_have_no_gpm_ratios_but_pcie_bytes():
    service, _ = service_for("dgx-a100")
    assert all(g.compute_capability < (9, 0) for g in service.topology.gpus)
    service.sampler.sample_once()
    service.sampler.sample_once()
    text = service.render().decode()
    for name in GPM_RATIOS:
        assert by_gpu(text, name) == {}, name
    assert len(by_gpu(text, "DCGM_FI_PROF_PCIE_TX_BYTES")) == service.topology.gpu_count
    assert len(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == service.topology.gpu_count


def test_telemetry_knobs_show_up_in_the_next_round():
    service, machine = service_for("dgx-h100")
    machine.lib.set_value(2, "gpu_temp_c", 91)
    machine.lib.set_value(2, "gpu_util_pct", 77)
    service.sampler.sample_once()
    text = service.render().decode()
    assert by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")["2"] == 91
    assert by_gpu(text, "DCGM_FI_DEV_GPU_UTIL")["2"] == 77


def test_energy_counter_grows_between_rounds():
    service, _ = service_for("dgx-h100")
    first = service.sampler.sample_once().gpus[0]["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    second = service.sampler.sample_once().gpus[0]["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert second > first


def test_lost_gpu_vanishes_from_the_scrape_and_returns_after_recovery():
    service, machine = service_for("dgx-h100")
    service.sampler.sample_once()
    machine.lib.lose_gpu(3)
    service.sampler.sample_once()
    text = service.render().decode()
    temps = by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")
    assert "3" not in temps and len(temps) == service.topology.gpu_count - 1
    assert 3 in service.backend.lost_gpus
    machine.lib.recover_gpu(3)
    assert service.backend.probe(3)  # the health watcher's job in the agent
    service.sampler.sample_once()
    assert "3" in by_gpu(service.render().decode(), "DCGM_FI_DEV_GPU_TEMP")


def test_unsupported_function_on_one_gpu_leaves_only_its_series_out():
    service, machine = service_for("dgx-h100")
    machine.lib.make_unsupported("nvmlDeviceGetTotalEccErrors", index=1)
    service.sampler.sample_once()
    text = service.render().decode()
    ecc = by_gpu(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")
    assert "1" not in ecc and len(ecc) == service.topology.gpu_count - 1


def test_nvml_failures_are_counted_by_function_and_do_not_break_the_round():
    service, machine = service_for("dgx-h100")
    unknown_error = machine.lib.NVML_ERROR_UNKNOWN
    machine.lib.fail("nvmlDeviceGetPowerUsage", unknown_error, index=0)
    snap = service.sampler.sample_once()
    assert "DCGM_FI_DEV_POWER_USAGE" not in snap.gpus[0]
    assert "DCGM_FI_DEV_POWER_USAGE" in snap.gpus[1]
    assert service.registry.get_sample_value(
        "gpu_agent_nvml_errors_total", {"function": "nvmlDeviceGetPowerUsage"}) >= 1


def test_double_bit_ecc_injection_shows_in_the_volatile_counter():
    service, machine = service_for("dgx-h100")
    machine.lib.inject_ecc_dbe(5)
    service.sampler.sample_once()
    text = service.render().decode()
    assert by_gpu(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")["5"] >= 1
    assert by_gpu(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")["4"] == 0


# ------------------------------------------------------------------ hw sampling API
GPM_FIELDS = ("graphics_active_pct", "tensor_active_pct", "dram_active_pct")


def test_nvml_sampler_gives_gpm_fields_on_hopper_from_the_second_round_on():
    with node_of("dgx-h100") as node:
        sampler = node.backend.sample_source()
        first = sampler.sample(0)
        second = sampler.sample(0)
        sampler.close()
    assert isinstance(first, GpuSample) and first.index == 0
    assert all(getattr(first, f) is None for f in GPM_FIELDS)
    assert second is not None
    assert all(0 <= getattr(second, f) <= 100 for f in GPM_FIELDS)
    assert second.pcie_tx_bytes_per_s is not None and second.pcie_tx_bytes_per_s > 0


def test_nvml_sampler_has_no_gpm_fields_before_hopper_and_reads_pcie_throughput():
    with node_of("dgx-a100") as node:
        sampler = node.backend.sample_source()
        sampler.sample(0)
        sample = sampler.sample(0)
        gpm_calls = node.lib.calls["nvmlGpmSampleGet"]
    assert sample is not None and all(getattr(sample, f) is None for f in GPM_FIELDS)
    assert sample.pcie_rx_bytes_per_s is not None and sample.pcie_rx_bytes_per_s % 1024 == 0
    assert gpm_calls == 0


def test_nvml_sampler_gives_none_for_a_lost_gpu_and_samples_it_again_after_recovery():
    with node_of("pcie-pairs") as node:
        sampler = node.backend.sample_source()
        node.lib.lose_gpu(1)
        assert sampler.sample(1) is None
        assert 1 in node.backend.lost_gpus
        calls = sum(node.lib.calls.values())
        assert sampler.sample(1) is None
        assert sum(node.lib.calls.values()) == calls  # a lost GPU is not called again
        node.lib.recover_gpu(1)
        assert node.backend.probe(1)
        assert sampler.sample(1) is not None


def test_an_unsupported_function_is_a_none_field_not_an_error():
    with node_of("single-gpu") as node:
        node.lib.make_unsupported("nvmlDeviceGetPowerUsage")
        sample = node.backend.sample_source().sample(0)
        assert node.backend.error_counts == {}
    assert sample is not None and sample.power_mw is None and sample.gpu_temp_c is not None


def test_every_sample_field_feeds_one_dcgm_metric():
    # the processes feed the per-pod series (tests/test_pod_metrics.py), not a DCGM one
    per_pod = {"index", "processes", "process_utilization"}
    fields = [f.name for f in dataclasses.fields(GpuSample) if f.name not in per_pod]
    for name in fields:
        values = dcgm_values(GpuSample(index=0, **{name: 1}))
        assert len(values) == 1, name
    every = dcgm_values(GpuSample(index=0, **{name: 1 for name in fields}))
    assert set(every) == {m.name for m in DCGM_METRICS} - {XID_METRIC}


def test_the_metrics_package_names_no_nvml_function_or_constant():
    found = subprocess.run(
        ["grep", "-rnE", r"nvml[A-Z]|NVML_|pynvml|c_nvml", str(ROOT / "agent" / "metrics")],
        capture_output=True, text=True)
    assert found.stdout == "", found.stdout


@pytest.mark.parametrize("machine", ["dgx-h100", "a100-mig"])
def test_sampled_values_reach_the_scrape_unchanged(machine):
    with node_of(machine) as node:
        service = MetricsService(node.backend, node.topology,
                                 Config(metrics_address="127.0.0.1:0"), hostname="h",
                                 ready=lambda: True,
                                 agent_metrics=AgentMetrics(CollectorRegistry(), node.backend))
        snap = service.sampler.sample_once()
        text = service.render().decode()
        gpus = {str(g.index) for g in node.topology.gpus}
    # every GPU is sampled, and the scrape has series (the loop below would pass on {} == {})
    assert {str(i) for i in snap.gpus} == gpus and len(gpus) >= 2, sorted(snap.gpus)
    assert set(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == gpus
    for m in DCGM_METRICS:
        assert by_gpu(text, m.name) == {str(i): v[m.name] for i, v in snap.gpus.items()
                                        if m.name in v}, m.name
