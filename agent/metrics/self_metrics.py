"""The agent's own health metrics (``gpu_agent_*``), registered on the service's registry.

Other components report through :class:`AgentMetrics` (the device plugin: preferred
allocation latency, registrations, kubelet restarts, device health; the health watcher:
XIDs through ``MetricsService.record_xid``). NVML errors are read from
``backend.error_counts`` at scrape time (a dict read, no NVML call).
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.hooks import DevicePluginHooks

#: GetPreferredAllocation answers from memory: buckets from 50 us to 1 s (the anchor's
#: 16-30 s calls would land in +Inf).
PREFERRED_ALLOCATION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)


class ErrorCounting(Protocol):
    """What the NVML error counter reads (``NvmlBackend``)."""

    @property
    def error_counts(self) -> dict[str, int]: ...


class AgentMetrics(DevicePluginHooks):
    """Self-metrics; every method is thread-safe and cheap (no I/O). Subclassing the hooks
    protocol makes mypy check that every hook is here with its signature."""

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
        self._kubelet_restarts = Counter(
            "gpu_agent_kubelet_restarts", "Kubelet restarts seen (its socket re-created).",
            registry=registry,
        )
        self._device_health = Gauge(
            "gpu_agent_device_healthy",
            "1 if the device is advertised healthy to the kubelet, 0 if unhealthy.",
            ["resource", "device"], registry=registry,
        )
        self.sampler_duration = Gauge(
            "gpu_agent_sampler_duration_seconds",
            "Duration of the last NVML sampling round.", registry=registry,
        )
        self.samples = Counter(
            "gpu_agent_samples", "NVML sampling rounds completed.", registry=registry,
        )
        self.pod_resources_errors = Counter(
            "gpu_agent_pod_resources_errors",
            "Failed pod-resources List calls (the last answer is kept).", registry=registry,
        )
        self.label_write_errors = Counter(
            "gpu_agent_label_write_errors",
            "Failed writes of the label file (features directory missing or unwritable).", registry=registry,
        )
        self._backend = backend
        if backend is not None:
            registry.register(NvmlErrorCollector(lambda: backend.error_counts))

    def observe_preferred_allocation(self, seconds: float) -> None:
        self._preferred.observe(seconds)

    def registration(self, resource: str) -> None:
        self._registrations.labels(resource=resource).inc()

    def kubelet_restart(self) -> None:
        self._kubelet_restarts.inc()

    def set_device_health(self, resource: str, device_id: str, healthy: bool) -> None:
        self._device_health.labels(resource=resource, device=device_id).set(1.0 if healthy else 0.0)

    @property
    def nvml_errors(self) -> dict[str, int]:
        """NVML errors by function, as counted by the backend."""
        return dict(self._backend.error_counts) if self._backend is not None else {}


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
