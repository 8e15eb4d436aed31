"""``DCGM_EXP_XID_ERRORS_TOTAL{gpu,UUID,pci_bus_id,device,modelName,Hostname,DCGM_FI_DRIVER_VERSION,xid}``:
XIDs counted per GPU and XID since the agent started (both sources, NVML's events and the
kernel log, one count per occurrence). A counter, unlike ``DCGM_FI_DEV_XID_ERRORS`` (the last
XID only): ``increase()`` and ``rate()`` work on it. dcgm-exporter's per-GPU labels plus
``xid``; a GPU without an XID has no series."""

from __future__ import annotations

import threading
from typing import Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.metrics.collector import gpu_labels
from agent.topology.model import Topology

__all__ = ["XID_COUNTER", "XidCounter"]

XID_COUNTER = "DCGM_EXP_XID_ERRORS_TOTAL"
_HELP = "Count of XID errors seen since the agent started, per GPU and XID."
#: distinct (GPU, XID) series at most; more are counted under xid="other"
MAX_SERIES = 1024


class XidCounter(Collector):
    """Thread-safe: the health watcher counts, a scrape collects."""

    def __init__(self, topology: Topology, hostname: str) -> None:
        driver = topology.driver_version or ""
        self._labels = {g.index: gpu_labels(g, hostname, driver) for g in topology.gpus}
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str], int] = {}

    def count(self, gpu: int, xid: int, times: int = 1) -> None:
        if gpu not in self._labels or times <= 0:
            return
        with self._lock:
            key = (gpu, str(xid))
            if key not in self._counts and len(self._counts) >= MAX_SERIES:
                key = (gpu, "other")
            self._counts[key] = self._counts.get(key, 0) + times

    def describe(self) -> Iterable[Metric]:
        yield Metric(XID_COUNTER, _HELP, "counter")

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = sorted(self._counts.items(), key=lambda kv: (kv[0][0], kv[0][1].zfill(8)))
        metric = Metric(XID_COUNTER, _HELP, "counter")
        for (gpu, xid), value in counts:
            metric.add_sample(XID_COUNTER, {**self._labels[gpu], "xid": xid}, float(value))
        yield metric
