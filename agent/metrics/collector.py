"""Prometheus collectors that render the latest snapshot; a scrape never calls NVML.

:class:`GpuCollector` turns the sampler's :class:`Snapshot`, the pod-resources
:class:`Attribution` and the static :class:`Topology` into dcgm-exporter-compatible families
plus our topology and per-pod metrics. A GPU that is gone simply stops being yielded. The families that
depend only on the snapshot and the attribution (nearly all of them) are built and rendered
once per snapshot/attribution pair, as :class:`RenderedMetric`: every scrape in between
reuses their text; only the clock-dependent families are built on each ``collect()``.

:func:`render_text` is the Prometheus text exposition used by ``/metrics``. It differs from
``prometheus_client.generate_latest`` in one way that matters for compatibility:
dcgm-exporter's counters are named without ``_total`` (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``
is a counter), and ``generate_latest`` would rename their ``# TYPE`` line. It also leaves
out ``_created`` series, which dcgm-exporter does not have.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from agent.attribution import ContainerRef
from agent.attribution.holders import EMPTY_ATTRIBUTION, Attribution
from agent.attribution.pod_processes import NO_POD, PodUse
from agent.metrics.fields import DCGM_METRICS, POD_METRICS
from agent.metrics.sampler import EMPTY_SNAPSHOT, Snapshot
from agent.topology.allocator import AllocationEngine
from agent.topology.model import Gpu, Topology


def gpu_labels(gpu: Gpu, hostname: str, driver_version: str) -> dict[str, str]:
    """dcgm-exporter's per-GPU labels, in its order."""
    minor = gpu.minor_number if gpu.minor_number is not None else gpu.index
    return {
        "gpu": str(gpu.index),
        "UUID": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "device": f"nvidia{minor}",
        "modelName": gpu.name,
        "Hostname": hostname,
        "DCGM_FI_DRIVER_VERSION": driver_version,
    }


def _pod_labels(ref: ContainerRef) -> dict[str, str]:
    return {"container": ref.container, "namespace": ref.namespace, "pod": ref.pod}


class PlacementScorer:
    """Placement quality of a GPU set: its pair-score sum over the best sum any set of the
    same size reaches on this node (1.0 = as good as it gets). Best scores come from
    ``AllocationEngine(topology).best_score_for_size(k)`` and are cached per size."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._best: dict[int, int] = {}
        self._engine: AllocationEngine | None = None  # built on first use

    def best_score(self, size: int) -> int:
        if size not in self._best:
            self._best[size] = self._compute_best(size)
        return self._best[size]

    def _compute_best(self, size: int) -> int:
        if self._engine is None:
            self._engine = AllocationEngine(self.topology)
        return self._engine.best_score_for_size(size)

    def ratio(self, indices: Sequence[int]) -> float:
        k = len(indices)
        if k <= 1:
            return 1.0
        best = self.best_score(k)
        if best <= 0:
            return 1.0  # nothing is known about the links: no set is better than another
        return min(1.0, self.topology.set_score(indices) / best)


class RenderedMetric(Metric):
    """A metric family whose text exposition is rendered once (:meth:`freeze`) and reused
    by :func:`render_families` until the family is replaced."""

    text: bytes = b""

    def freeze(self) -> RenderedMetric:
        self.text = _render_one(self)
        return self


class GpuCollector(Collector):
    """Renders GPU telemetry, pod attribution and topology from in-memory state only."""

    def __init__(
        self,
        topology: Topology,
        *,
        hostname: str,
        snapshot: Callable[[], Snapshot] = lambda: EMPTY_SNAPSHOT,
        attribution: Callable[[], Attribution] = lambda: EMPTY_ATTRIBUTION,
        scorer: PlacementScorer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topology = topology
        self.hostname = hostname
        self._snapshot = snapshot
        self._attribution = attribution
        self.scorer = scorer or PlacementScorer(topology)
        self.clock = clock
        driver = topology.driver_version or ""
        self._labels = {g.index: gpu_labels(g, hostname, driver) for g in topology.gpus}
        self._info_labels = self._topology_info_labels()
        self._info = self._info_family().freeze()  # static: the topology's
        self._cache: tuple[Snapshot, Attribution, list[RenderedMetric]] | None = None

    def describe(self) -> Iterable[Metric]:
        # names only: lets the registry detect clashes without a (cheap anyway) collect
        for m in DCGM_METRICS:
            yield Metric(m.name, m.help, m.kind)
        for p in POD_METRICS:
            yield Metric(p.name, p.help, "gauge")
        yield Metric("gpu_topology_info", "", "gauge")
        yield Metric("gpu_topology_placement_quality_ratio", "", "gauge")
        yield Metric("gpu_topology_allocated_idle_seconds", "", "gauge")

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        attr = self._attribution()
        cached = self._cache
        if cached is None or cached[0] is not snap or cached[1] is not attr:
            families = [f.freeze() for f in self._dcgm_families(snap, attr)]
            families.extend(f.freeze() for f in self._pod_families(snap, attr))
            families.append(self._info)
            cached = self._cache = (snap, attr, families)
        yield from cached[2]
        yield from self._dynamic_families(snap, attr)

    def _dcgm_families(self, snap: Snapshot, attr: Attribution) -> Iterator[RenderedMetric]:
        # per GPU: the label sets its series carry (one per container holding it)
        series_labels: dict[int, list[dict[str, str]]] = {}
        for index, base in self._labels.items():
            holders = attr.by_gpu.get(index, ())
            if holders:
                series_labels[index] = [{**base, **_pod_labels(ref)} for ref in holders]
            else:
                series_labels[index] = [base]
        for m in DCGM_METRICS:
            family = RenderedMetric(m.name, m.help, m.kind)
            for index, values in snap.gpus.items():
                value = values.get(m.name)
                if value is None or index not in series_labels:
                    continue
                for labels in series_labels[index]:
                    family.add_sample(m.name, labels, value)
            if family.samples:
                yield family

    def _pod_families(self, snap: Snapshot, attr: Attribution) -> Iterator[RenderedMetric]:
        """The per-pod series: each container with processes on a GPU, and each container
        holding it (pod-resources) without any, at 0."""
        rows: list[tuple[dict[str, str], PodUse]] = []
        for index, uses in snap.pods.items():
            base = self._labels.get(index)
            if base is None:
                continue
            rows.extend((base, use) for use in uses)
            util = 0.0 if index in snap.pod_utilization else None
            present = {use.ref for use in uses}
            rows.extend(
                (base, PodUse(ref, 0, util, util, 0.0))
                for ref in attr.by_gpu.get(index, ()) if ref not in present
            )
        for m in POD_METRICS:
            family = RenderedMetric(m.name, m.help, "gauge")
            for base, use in rows:
                value = m.value(use)
                if value is not None:
                    family.add_sample(m.name, {**base, **_pod_labels(use.ref)}, value)
            if family.samples:
                yield family

    # ---------------------------------------------------------------- ours
    def _topology_info_labels(self) -> dict[int, dict[str, str]]:
        t = self.topology
        island_of = {i: str(k) for k, isl in enumerate(t.nvlink_islands) for i in isl}
        clique_of: dict[int, str] = {}
        # the largest clique holding the GPU; ties: the first in the topology's order
        for k, clique in sorted(enumerate(t.nvlink_cliques), key=lambda kc: (-len(kc[1]), kc[0])):
            for i in clique:
                clique_of.setdefault(i, str(k))
        out: dict[int, dict[str, str]] = {}
        for g in t.gpus:
            nearest = "none"
            ranked = sorted(
                (nic.levels[g.index], nic.name) for nic in t.nics
                if g.index < len(nic.levels) and nic.levels[g.index] is not None
            )
            if ranked:
                nearest = ranked[0][1]
            base = self._labels[g.index]
            out[g.index] = {
                "gpu": base["gpu"], "UUID": base["UUID"], "pci_bus_id": base["pci_bus_id"],
                "device": base["device"], "modelName": base["modelName"],
                "Hostname": base["Hostname"],
                "numa_node": str(g.numa_node) if g.numa_node is not None else "none",
                "nvlink_island": island_of.get(g.index, "none"),
                "nvlink_clique": clique_of.get(g.index, "none"),
                "nearest_nic": nearest,
            }
        return out

    def _info_family(self) -> RenderedMetric:
        info = RenderedMetric("gpu_topology_info",
                      "GPU topology facts as labels: NUMA node, NVLink island and clique "
                      "(indices into the node's lists), nearest RDMA NIC.", "gauge")
        for labels in self._info_labels.values():
            info.add_sample("gpu_topology_info", labels, 1.0)
        return info

    def _dynamic_families(self, snap: Snapshot, attr: Attribution) -> Iterator[Metric]:
        quality = Metric("gpu_topology_placement_quality_ratio",
                         "Per container: score of its GPU set over the best score of any set "
                         "of the same size on this node (1 = ideal placement).", "gauge")
        idle = Metric("gpu_topology_allocated_idle_seconds",
                      "Per allocated GPU and container: seconds since the GPU's utilisation "
                      "last exceeded the idle threshold (or since the container got it).",
                      "gauge")
        now = self.clock()
        for ref, gpus in attr.containers.items():
            pod = _pod_labels(ref)
            quality.add_sample(
                "gpu_topology_placement_quality_ratio",
                {"Hostname": self.hostname, **pod, "gpu_count": str(len(gpus)),
                 "gpus": ",".join(map(str, gpus))},
                self.scorer.ratio(gpus),
            )
            for index in gpus:
                if index not in snap.gpus or index not in self._labels:
                    continue  # no telemetry for this GPU: we cannot say it is idle
                since = _busy_since(snap, attr, ref, index, now)
                base = self._labels[index]
                idle.add_sample(
                    "gpu_topology_allocated_idle_seconds",
                    {"gpu": base["gpu"], "UUID": base["UUID"], "Hostname": self.hostname, **pod},
                    max(0.0, now - since),
                )
        yield quality
        yield idle


def _busy_since(snap: Snapshot, attr: Attribution, ref: ContainerRef, index: int,
                now: float) -> float:
    """When container ``ref``'s use of GPU ``index`` was last above the idle threshold (or
    when it got the GPU, if later). On a shared GPU (held by several containers) with
    per-process utilisation, it is the container's own figure: a busy neighbour does not
    hide an idle notebook. Processes of no pod count as anyone's (they may be a holder's
    whose cgroup could not be read). Elsewhere it is the GPU's utilisation."""
    first_seen = attr.first_seen.get((ref, index))
    if len(attr.by_gpu.get(index, ())) > 1 and index in snap.pod_utilization:
        seen = first_seen if first_seen is not None else now
        busy_at = max(snap.pod_busy_at.get((ref, index), seen),
                      snap.pod_busy_at.get((NO_POD, index), seen))
    else:
        busy_at = snap.last_busy_at.get(index, now)
    return max(busy_at, first_seen if first_seen is not None else busy_at)


# -------------------------------------------------------------------- exposition
#: prometheus_client's Go-style float formatting (unannotated there)
_go_float: Callable[[float], str] = floatToGoString


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {_go_float(value)}\n"
    return f"{name} {_go_float(value)}\n"


def render_text(registry: Collector) -> bytes:
    """The Prometheus text format (0.0.4) of everything ``registry`` collects.

    Counters keep their name as collected: a counter whose samples carry the family name
    (dcgm-exporter style) is typed under that name; a client_python counter (samples
    ``<name>_total``) under ``<name>_total``. ``_created`` samples are left out.
    """
    return render_families(registry.collect())


def render_families(metrics: Iterable[Metric]) -> bytes:
    """:func:`render_text` of these metric families (a :class:`RenderedMetric` contributes
    its text as rendered when it was frozen)."""
    out: list[bytes] = []
    for metric in metrics:
        if isinstance(metric, RenderedMetric) and metric.text:
            out.append(metric.text)
        else:
            out.append(_render_one(metric))
    return b"".join(out)


def _render_one(metric: Metric) -> bytes:
    mtype = metric.type
    name = metric.name
    samples = [s for s in metric.samples if not s.name.endswith("_created")]
    if mtype == "counter":
        if any(s.name == name + "_total" for s in samples) or (
            not samples and not name.startswith("DCGM_")
        ):
            name += "_total"
    elif mtype == "info":
        name, mtype = name + "_info", "gauge"
    elif mtype in ("unknown", "untyped"):
        mtype = "untyped"
    elif mtype == "stateset":
        mtype = "gauge"
    elif mtype == "gaugehistogram":
        mtype = "histogram"
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    out = [f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n"]
    out.extend(_sample_line(s.name, s.labels, s.value) for s in samples)
    return "".join(out).encode("utf-8")
