"""The agent's own health metrics (``gpu_agent_*``), registered on the service's registry.

Built first (before the topology is read) and handed to each component's constructor, which
reports through methods of :class:`AgentMetrics` only (no component touches a
client_python object): the device plugin reports preferred-allocation latency,
registrations and failed ones, refused ListAndWatch streams, kubelet restarts and the
devices it offers the kubelet (its ``DevicePluginEvents``), the label publisher its failed
writes, DRA the claims it could not read and which features the API server keeps (its
``DraEvents``), the per-node config selector the config applied or refused, the metrics
service its sampling rounds and pod-resources errors. Where a condition repeats (a client
retrying in a loop, an API server down), the log says it once and these count the repeats.
Every series is listed in :mod:`agent.metrics.fields`'s table.

Sources handed over at construction are read at scrape time: NVML errors from
``backend.error_counts`` (a dict read, no NVML call). The devices offered to the kubelet are
reported by the device plugin whenever that table changes (servers replaced, a GPU's health,
a sharing supervisor's readiness), and a scrape reads the last table (one reference, no lock), so a
scrape never calls into the device plugin and a device no longer offered has no series.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: GetPreferredAllocation answers from memory: buckets from 50 us to 1 s (go-gpuallocator's
#: 16-30 s calls would land in +Inf).
PREFERRED_ALLOCATION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)


class ErrorCounting(Protocol):
    """What the NVML error counter reads (``NvmlBackend``)."""

    @property
    def error_counts(self) -> dict[str, int]: ...


class AgentMetrics:
    """Self-metrics on ``registry``; every method is thread-safe and cheap (no I/O), so
    serving threads call them directly."""

    def __init__(self, registry: CollectorRegistry, backend: ErrorCounting | None = None) -> None:
        self.registry = registry
        self._preferred = Histogram(
            "gpu_agent_preferred_allocation_seconds",
            "Latency of GetPreferredAllocation answers.",
            buckets=PREFERRED_ALLOCATION_BUCKETS_S, registry=registry,
        )
        self._registrations = Counter(
            "gpu_agent_registrations", "Registrations with the kubelet, by resource.",
            ["resource"], registry=registry,
        )
        self._registration_failures = Counter(
            "gpu_agent_registration_failures",
            "Failed registrations with the kubelet, by resource (each is retried with backoff).",
            ["resource"], registry=registry,
        )
        self._streams_refused = Counter(
            "gpu_agent_list_and_watch_refused",
            "ListAndWatch streams refused because the per-resource cap was reached, by resource.",
            ["resource"], registry=registry,
        )
        self._kubelet_restarts = Counter(
            "gpu_agent_kubelet_restarts", "Kubelet restarts seen (its socket re-created).",
            registry=registry,
        )
        self._sampler_duration = Gauge(
            "gpu_agent_sampler_duration_seconds",
            "Duration of the last NVML sampling round.", registry=registry,
        )
        self._samples = Counter(
            "gpu_agent_samples", "NVML sampling rounds completed.", registry=registry,
        )
        self._pod_resources_errors = Counter(
            "gpu_agent_pod_resources_errors",
            "Failed pod-resources List calls (the last answer is kept).", registry=registry,
        )
        self._label_write_errors = Counter(
            "gpu_agent_label_write_errors",
            "Failed writes of the node's labels (the feature file, or the NodeFeature object through the"
            " API server).", registry=registry,
        )
        self._claim_read_errors = Counter(
            "gpu_agent_claim_read_errors",
            "ResourceClaims that could not be read from the API server (their NodePrepareResources"
            " fails; the kubelet retries).", registry=registry,
        )
        self._claim_placements = Counter(
            "gpu_agent_dra_claim_placements",
            "Claims prepared (DRA) by how the scheduler placed them (placement device_plugin_choice:"
            " the GPUs the device plugin would have given for that many on the GPUs free when the"
            " claim was prepared; other: not those; unranked: a MIG device).",
            ["placement"], registry=registry,
        )
        self._state_gauges(registry)
        if backend is not None:
            registry.register(NvmlErrorCollector(lambda: backend.error_counts))
        # (resource, device ID, healthy): replaced whole by ``devices_offered``, read whole by
        # a scrape; one reference, so neither side takes a lock
        self._offered: tuple[tuple[str, str, bool], ...] = ()
        registry.register(DeviceHealthCollector(lambda: self._offered))

    def _state_gauges(self, registry: CollectorRegistry) -> None:
        """The gauges of states the agent reports on change (the per-node config, the DRA API
        features the API server keeps): one series each, replaced on change."""
        self._active_config = Gauge(
            "gpu_agent_active_config",
            "1 for the per-node config the agent applies (chosen by the node label).",
            ["name"], registry=registry,
        )
        self._refused_config = Gauge(
            "gpu_agent_config_refused",
            "1 while the node label asks for a config that is not applied (reason: unknown when"
            " no config has that name, invalid when it does not load); the last good one stays.",
            ["label", "reason"], registry=registry,
        )
        self._dra_api_features = Gauge(
            "gpu_agent_dra_api_feature",
            "1 while the API server keeps the ResourceSlice fields of a DRA feature (by feature gate:"
            " DRAPartitionableDevices for GPU sets and counters, DRADeviceTaints for health taints),"
            " 0 once it dropped them on write and the agent publishes without.",
            ["feature"], registry=registry,
        )
        self._dra_gpu_sets = Gauge(
            "gpu_agent_dra_gpu_sets_mode",
            "1 for the GPU-set publishing the DRA publisher chose (mode on: sets and counters, off: single"
            " GPUs only) from dra.gpuSets (setting auto, on, off) and the API server's version.",
            ["mode", "setting"], registry=registry,
        )
        self._node_condition = Gauge(
            "gpu_agent_node_condition",
            "1 for the status and reason of the Node condition the agent owns (type GPUHealthy: status"
            " True, False or Unknown), as the agent derives it (written to the Node unless"
            " health.nodeCondition is off or dry-run).",
            ["type", "status", "reason"], registry=registry,
        )
        self._node_writes = Counter(
            "gpu_agent_node_health_writes",
            "Writes of the GPUHealthy condition and the Node's Events to the API server, by kind"
            " (condition, event) and result (ok, error; an error is retried with backoff).",
            ["kind", "result"], registry=registry,
        )
        self._dra_published = Gauge(
            "gpu_agent_dra_published_devices",
            "Devices in the node's ResourceSlice pool as last published (DRA), by kind (gpu, mig, gpuset)"
            " and state (ordinary; withdrawing: tainted for dra.gpuSetWithdrawalGraceSeconds): what the"
            " scheduler reads for this node on every Filter.",
            ["kind", "state"], registry=registry,
        )

    def observe_preferred_allocation(self, seconds: float) -> None:
        self._preferred.observe(seconds)

    def registration(self, resource: str) -> None:
        self._registrations.labels(resource=resource).inc()

    def kubelet_restart(self) -> None:
        self._kubelet_restarts.inc()

    def config_applied(self, name: str) -> None:
        """The per-node config ``name`` is applied now (and no label is refused)."""
        self._active_config.clear()
        self._active_config.labels(name=name).set(1)
        self._refused_config.clear()

    def config_refused(self, label: str, reason: str) -> None:
        """The node label's value ``label`` is refused for ``reason`` (unknown|invalid)."""
        self._refused_config.clear()
        self._refused_config.labels(label=label, reason=reason).set(1)

    def registration_failure(self, resource: str) -> None:
        self._registration_failures.labels(resource=resource).inc()

    def stream_refused(self, resource: str) -> None:
        self._streams_refused.labels(resource=resource).inc()

    def dra_api_feature(self, feature: str, kept: bool) -> None:
        self._dra_api_features.labels(feature=feature).set(1.0 if kept else 0.0)

    def dra_gpu_sets(self, on: bool, setting: str) -> None:
        self._dra_gpu_sets.clear()
        self._dra_gpu_sets.labels(mode="on" if on else "off", setting=setting).set(1.0)

    def dra_published_devices(self, counts: Mapping[tuple[str, str], int]) -> None:
        for kind in ("gpu", "mig", "gpuset"):
            for state in ("ordinary", "withdrawing"):
                self._dra_published.labels(kind=kind, state=state).set(counts.get((kind, state), 0))

    def node_condition(self, status: str, reason: str) -> None:
        """The GPUHealthy condition is ``status`` for ``reason`` now (one series)."""
        self._node_condition.clear()
        self._node_condition.labels(type="GPUHealthy", status=status, reason=reason).set(1.0)

    def node_write(self, kind: str, ok: bool) -> None:
        """One write of the Node's ``kind`` (condition, event) to the API server."""
        self._node_writes.labels(kind=kind, result="ok" if ok else "error").inc()

    def devices_offered(self, offers: Sequence[tuple[str, str, bool]]) -> None:
        """The devices offered to the kubelet now, the whole table: (resource, device ID,
        healthy) each; ``gpu_agent_device_healthy`` has exactly these series from now on."""
        self._offered = tuple(offers)

    def sampling_round(self, duration_s: float) -> None:
        """One NVML sampling round completed in ``duration_s``."""
        self._sampler_duration.set(duration_s)
        self._samples.inc()

    def pod_resources_error(self) -> None:
        """A pod-resources ``List`` call failed (the last answer is kept)."""
        self._pod_resources_errors.inc()

    def label_write_error(self) -> None:
        """A write of the node's labels failed (whichever sink)."""
        self._label_write_errors.inc()

    def claim_read_error(self) -> None:
        """A ResourceClaim could not be read from the API server."""
        self._claim_read_errors.inc()

    def dra_claim_placement(self, placement: str) -> None:
        """A claim was prepared anew, placed as ``placement`` (:mod:`agent.dra.placement`)."""
        self._claim_placements.labels(placement=placement).inc()


class NvmlErrorCollector(Collector):
    """``gpu_agent_nvml_errors_total{function}`` from a live ``dict[str, int]``."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily("gpu_agent_nvml_errors", "", labels=["function"])

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gpu_agent_nvml_errors", "NVML calls that failed, by function.", labels=["function"]
        )
        for function, count in sorted(dict(self._counts() or {}).items()):
            family.add_metric([function], float(count))
        yield family


class DeviceHealthCollector(Collector):
    """``gpu_agent_device_healthy{resource,device}`` from ``devices()`` at collect time:
    (resource, device ID, healthy) for each device offered to the kubelet, as last reported."""

    def __init__(self, devices: Callable[[], Iterable[tuple[str, str, bool]]]) -> None:
        self._devices = devices

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gpu_agent_device_healthy", "", labels=["resource", "device"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpu_agent_device_healthy",
            "1 if the device is advertised healthy to the kubelet, 0 if unhealthy.",
            labels=["resource", "device"],
        )
        for resource, device_id, healthy in self._devices():
            family.add_metric([resource, device_id], 1.0 if healthy else 0.0)
        yield family
