"""Metrics end to end on the real NVML code path: ``NvmlBackend`` over the fake ``pynvml``
of a simulated machine, with its fault injection."""

from __future__ import annotations

from metrics_support import samples_of

from agent.config import Config
from agent.hw.sim import machines
from agent.metrics.fields import DCGM_METRICS
from agent.metrics.service import MetricsService
from agent.topology.model import Topology

NVLINK_AND_HBM_ONLY = {"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_MEMORY_TEMP",
                       "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                       "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
GPM_RATIOS = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
              "DCGM_FI_PROF_DRAM_ACTIVE"}


def service_for(name: str) -> tuple[MetricsService, object]:
    machine = machines.open_simulated(name)
    backend = machine.backend()
    backend.init()
    topology = Topology.from_facts(backend.read_facts())
    service = MetricsService(backend, topology, Config(metrics_address="127.0.0.1:0"),
                             hostname="sim", ready=lambda: True)
    return service, machine


def by_gpu(text: str, name: str) -> dict[str, float]:
    return {s.labels["gpu"]: s.value for s in samples_of(text, name)}


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
