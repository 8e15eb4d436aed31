"""The metrics we export and the :class:`~agent.hw.protocols.GpuSample` field behind each.

Names, Prometheus types, units and help texts are dcgm-exporter's (its default counter list,
``tests/fixtures/dcgm/dcgm-exporter-default-counters.csv``) so that dashboards and alerts
written for dcgm-exporter work unchanged. Every series carries dcgm-exporter's labels
``gpu``, ``UUID``, ``pci_bus_id`` (NVML spelling ``00000000:3B:00.0``), ``device``
(``nvidia<minor>``), ``modelName``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION`` and, when the GPU
is allocated, ``pod``/``namespace``/``container`` (one series per container on a shared GPU).

The samples come from :mod:`agent.hw.nvml.telemetry`, which says what NVML answers each field;
this module only maps them to dcgm-exporter's names and units.

=========================================  =======  =====================================================
metric                                     type     GpuSample field
=========================================  =======  =====================================================
DCGM_FI_DEV_SM_CLOCK (MHz)                 gauge    sm_clock_mhz
DCGM_FI_DEV_MEM_CLOCK (MHz)                gauge    mem_clock_mhz
DCGM_FI_DEV_MEMORY_TEMP (C)                gauge    memory_temp_c
DCGM_FI_DEV_GPU_TEMP (C)                   gauge    gpu_temp_c
DCGM_FI_DEV_POWER_USAGE (W)                gauge    power_mw / 1000
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)  counter  energy_mj
DCGM_FI_DEV_PCIE_REPLAY_COUNTER            counter  pcie_replays
DCGM_FI_DEV_GPU_UTIL (%)                   gauge    gpu_util_pct
DCGM_FI_DEV_MEM_COPY_UTIL (%)              gauge    memory_util_pct
DCGM_FI_DEV_ENC_UTIL (%)                   gauge    encoder_util_pct
DCGM_FI_DEV_DEC_UTIL (%)                   gauge    decoder_util_pct
DCGM_FI_DEV_XID_ERRORS                     gauge    not sampled: the last XID the health watcher saw
                                                    (``Sampler.record_xid``); 0 if none
DCGM_FI_DEV_FB_FREE / USED / RESERVED      gauge    fb_free/used/reserved_bytes // 2**20
  (MiB)
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL         counter  nvlink_bandwidth_total
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS    counter  remapped_rows_uncorrectable
DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS      counter  remapped_rows_correctable
DCGM_FI_DEV_ROW_REMAP_FAILURE              gauge    row_remap_failure
DCGM_FI_DEV_ECC_SBE_VOL_TOTAL              counter  ecc_sbe_volatile
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL              counter  ecc_dbe_volatile
DCGM_FI_DEV_ECC_SBE_AGG_TOTAL              counter  ecc_sbe_aggregate
DCGM_FI_DEV_ECC_DBE_AGG_TOTAL              counter  ecc_dbe_aggregate
DCGM_FI_PROF_GR_ENGINE_ACTIVE (ratio)      gauge    graphics_active_pct / 100
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE (ratio)    gauge    tensor_active_pct / 100
DCGM_FI_PROF_DRAM_ACTIVE (ratio)           gauge    dram_active_pct / 100
DCGM_FI_PROF_PCIE_TX_BYTES (B/s)           gauge    pcie_tx_bytes_per_s
DCGM_FI_PROF_PCIE_RX_BYTES (B/s)           gauge    pcie_rx_bytes_per_s
=========================================  =======  =====================================================

The profiling ratios exist on Hopper and newer only, from the second sampling round on
(series absent otherwise, as dcgm-exporter without DCP). ``DCGM_FI_DEV_VGPU_LICENSE_STATUS``
(vGPU guests only) is not exported.

Our own metrics (no dcgm-exporter equivalent), every one of them (a test holds this table to
the registry's ``gpu_agent_*`` and ``gpu_topology_*`` families):

=============================================  =======  ====================================================
gpu_topology_info                              gauge    1 per GPU; labels numa_node, nvlink_island, nvlink_clique,
                                                        nearest_nic (from the Topology, read once)
gpu_topology_placement_quality_ratio           gauge    per container: set score / best score of any set of the
                                                        same size on this node (1.0 = ideal); labels gpu_count, gpus
gpu_topology_allocated_idle_seconds            gauge    per allocated GPU and container: seconds since its
                                                        utilisation last exceeded the idle threshold
gpu_agent_preferred_allocation_seconds         hist.    GetPreferredAllocation latency
gpu_agent_registrations_total{resource}        counter  registrations with the kubelet
gpu_agent_registration_failures_total          counter  failed registrations with the kubelet (retried
  {resource}                                            with backoff)
gpu_agent_list_and_watch_refused_total         counter  ListAndWatch streams refused at the per-resource
  {resource}                                            cap
gpu_agent_kubelet_restarts_total               counter  kubelet restarts seen
gpu_agent_device_healthy{resource,device}      gauge    1 healthy / 0 unhealthy, as advertised to the kubelet
gpu_agent_nvml_errors_total{function}          counter  NvmlBackend.error_counts
gpu_agent_sampler_duration_seconds             gauge    duration of the last NVML sampling round
gpu_agent_samples_total                        counter  sampling rounds completed
gpu_agent_pod_resources_errors_total           counter  failed pod-resources List calls
gpu_agent_label_write_errors_total             counter  failed writes of the node's labels (feature file
                                                        or NodeFeature object)
gpu_agent_claim_read_errors_total              counter  ResourceClaims the API server could not give (DRA)
gpu_agent_dra_claim_placements_total           counter  claims prepared (DRA), by how they were placed:
  {placement}                                           device_plugin_choice/other/unranked
                                                        (agent.dra.placement)
gpu_agent_active_config{name}                  gauge    1 for the per-node config applied
gpu_agent_config_refused{label,reason}         gauge    1 while the node label's config is not applied
gpu_agent_dra_api_feature{feature}             gauge    1 while the API server keeps a DRA feature's fields,
                                                        0 once it dropped them
gpu_agent_dra_gpu_sets_mode{mode,setting}      gauge    1 for the GPU-set publishing chosen (DRA): mode on/off
                                                        from dra.gpuSets auto/on/off
gpu_agent_dra_published_devices{kind,state}    gauge    devices in the node's pool as last published (DRA):
                                                        kind gpu/mig/gpuset, state ordinary/withdrawing
gpu_agent_node_condition{type,status,reason}   gauge    1 for the GPUHealthy condition as derived
                                                        (status True/False/Unknown, reason)
gpu_agent_node_health_writes_total             counter  writes of the condition and the Node's Events
  {kind,result}                                         (kind condition/event, result ok/error)
=============================================  =======  ====================================================

Per pod (container) and GPU, from the GPU's processes (:class:`~agent.hw.protocols.ProcessSample`,
mapped to containers by :mod:`agent.attribution.pod_processes`; :data:`POD_METRICS`; labels as the DCGM
series, with ``pod``/``namespace``/``container`` always present, empty for processes of no
pod; a container that holds the GPU by pod-resources but has no process on it shows 0):

=================================================  =======  ================================================
gpu_agent_pod_sm_utilization_percent               gauge    sum of its processes' sm_util_pct
gpu_agent_pod_memory_bandwidth_utilization_percent gauge    sum of its processes' mem_util_pct
gpu_agent_pod_framebuffer_used_mib                 gauge    sum of its processes' used_memory_bytes // 2**20
gpu_agent_pod_processes                            gauge    its processes on the GPU
=================================================  =======  ================================================

The two utilisations are absent for a GPU whose driver gives no per-process utilisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.attribution.pod_processes import PodUse
from agent.hw.protocols import GpuSample

_MIB = 1 << 20

#: filled by the sampler from the health watcher's XIDs, not from a GpuSample
XID_METRIC = "DCGM_FI_DEV_XID_ERRORS"


def _num(value: float | None) -> float | None:
    return None if value is None else float(value)


def _mib(value: int | None) -> float | None:
    return None if value is None else float(value // _MIB)


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000.0


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent * 0.01


@dataclass(frozen=True)
class MetricDef:
    """One exported GPU metric: dcgm-exporter's name, Prometheus type and help text, and
    its value in dcgm-exporter's unit from a :class:`GpuSample` (None: not in this sample).
    ``value`` is None for the one metric that is not sampled (:data:`XID_METRIC`)."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    value: Callable[[GpuSample], float | None] | None


#: dcgm-exporter's default counters we export, in exposition order.
DCGM_METRICS: tuple[MetricDef, ...] = (
    MetricDef("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
              lambda s: _num(s.sm_clock_mhz)),
    MetricDef("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
              lambda s: _num(s.mem_clock_mhz)),
    MetricDef("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
              lambda s: _num(s.memory_temp_c)),
    MetricDef("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
              lambda s: _num(s.gpu_temp_c)),
    MetricDef("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
              lambda s: _watts(s.power_mw)),
    MetricDef("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
              "Total energy consumption since boot (in mJ).", lambda s: _num(s.energy_mj)),
    MetricDef("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
              lambda s: _num(s.pcie_replays)),
    MetricDef("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
              lambda s: _num(s.gpu_util_pct)),
    MetricDef("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
              lambda s: _num(s.memory_util_pct)),
    MetricDef("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).",
              lambda s: _num(s.encoder_util_pct)),
    MetricDef("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).",
              lambda s: _num(s.decoder_util_pct)),
    MetricDef(XID_METRIC, "gauge", "Value of the last XID error encountered.", None),
    MetricDef("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
              lambda s: _mib(s.fb_free_bytes)),
    MetricDef("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
              lambda s: _mib(s.fb_used_bytes)),
    MetricDef("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
              lambda s: _mib(s.fb_reserved_bytes)),
    MetricDef("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
              "Total number of NVLink bandwidth counters for all lanes.",
              lambda s: _num(s.nvlink_bandwidth_total)),
    MetricDef("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for uncorrectable errors",
              lambda s: _num(s.remapped_rows_uncorrectable)),
    MetricDef("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for correctable errors",
              lambda s: _num(s.remapped_rows_correctable)),
    MetricDef("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
              lambda s: _num(s.row_remap_failure)),
    MetricDef("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
              "Total number of single-bit volatile ECC errors.",
              lambda s: _num(s.ecc_sbe_volatile)),
    MetricDef("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
              "Total number of double-bit volatile ECC errors.",
              lambda s: _num(s.ecc_dbe_volatile)),
    MetricDef("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter",
              "Total number of single-bit persistent ECC errors.",
              lambda s: _num(s.ecc_sbe_aggregate)),
    MetricDef("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter",
              "Total number of double-bit persistent ECC errors.",
              lambda s: _num(s.ecc_dbe_aggregate)),
    MetricDef("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
              lambda s: _ratio(s.graphics_active_pct)),
    MetricDef("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
              "Ratio of cycles the tensor (HMMA) pipe is active.",
              lambda s: _ratio(s.tensor_active_pct)),
    MetricDef("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
              "Ratio of cycles the device memory interface is active sending or receiving data.",
              lambda s: _ratio(s.dram_active_pct)),
    MetricDef("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
              "The rate of data transmitted over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second.",
              lambda s: _num(s.pcie_tx_bytes_per_s)),
    MetricDef("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
              "The rate of data received over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second.",
              lambda s: _num(s.pcie_rx_bytes_per_s)),
)
_SAMPLED: tuple[tuple[str, Callable[[GpuSample], float | None]], ...] = tuple(
    (m.name, m.value) for m in DCGM_METRICS if m.value is not None
)


def dcgm_values(sample: GpuSample) -> dict[str, float]:
    """The sampled DCGM metrics of one GPU: metric name -> value in dcgm-exporter's unit,
    for the fields the sample has."""
    out: dict[str, float] = {}
    for name, value_of in _SAMPLED:
        value = value_of(sample)
        if value is not None:
            out[name] = value
    return out


@dataclass(frozen=True)
class PodMetricDef:
    """One per-pod GPU gauge: its name, help text and value from a :class:`PodUse` (None:
    not known for this GPU)."""

    name: str
    help: str
    value: Callable[[PodUse], float | None]


#: The per-pod series (module docstring), in exposition order.
POD_METRICS: tuple[PodMetricDef, ...] = (
    PodMetricDef("gpu_agent_pod_sm_utilization_percent",
                 "Per container and GPU: SM utilization of its processes since the last "
                 "sample (in %).", lambda u: u.sm_util_pct),
    PodMetricDef("gpu_agent_pod_memory_bandwidth_utilization_percent",
                 "Per container and GPU: memory bandwidth utilization of its processes since "
                 "the last sample (in %).", lambda u: u.mem_util_pct),
    PodMetricDef("gpu_agent_pod_framebuffer_used_mib",
                 "Per container and GPU: framebuffer memory used by its processes (in MiB).",
                 lambda u: u.fb_used_mib),
    PodMetricDef("gpu_agent_pod_processes",
                 "Per container and GPU: its processes using the GPU.",
                 lambda u: float(u.processes)),
)
