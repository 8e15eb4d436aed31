"""No lock across I/O in the metrics layer: while an NVML read or a pod-resources ``List``
hangs, the scrape path (``render``, ``/metrics``, ``/ready``, the published snapshot) answers
at once, no lock of the sampler or the cache is held, and stopping does not wait on it."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config import Config
from agent.hw.protocols import GpuSample, SampleSource
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from tests.testbed.metrics_support import (
    Node,
    PodResourcesStub,
    listing,
    node_of,
    pod,
    samples_of,
    small_machine,
)

PROMPT_S = 1.0  # a scrape that waits on the hung call would take its full duration


class HungSource:
    """A sample source whose read of GPU 0 hangs until ``release`` is set; records the
    order of what happened to it."""

    def __init__(self, inner: SampleSource) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []

    def sample(self, index: int) -> GpuSample | None:
        if index == 0:
            self.entered.set()
            self.release.wait(30)
            self.events.append("read returned")
        return self.inner.sample(index)

    def close(self) -> None:
        self.events.append("closed")
        self.inner.close()


def held_locks(obj: Any) -> list[str]:
    """The names of ``obj``'s locks and conditions that another thread holds now."""
    kinds = (type(threading.Lock()), type(threading.RLock()), threading.Condition)
    held = []
    for name, value in vars(obj).items():
        if isinstance(value, kinds):
            if value.acquire(timeout=0.2):
                value.release()
            else:
                held.append(name)
    return held


def get(url: str) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    return status, body, time.monotonic() - started


def timed(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


@pytest.fixture
def box2() -> Iterator[Node]:
    with node_of(small_machine(2)) as node:
        yield node


@pytest.fixture
def kubelet(tmp_path: Any) -> Iterator[PodResourcesStub]:
    stub = PodResourcesStub(str(tmp_path / "kubelet.sock")).start()
    yield stub
    if stub.list_gate is not None:
        stub.list_gate.set()
    stub.stop()


class Gate(threading.Event):
    """The stand-in kubelet's ``list_gate`` that also says when a List reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.entered.set()
        return super().wait(timeout)


def service_on(node: Node, kubelet: PodResourcesStub) -> MetricsService:
    config = Config(metrics_address="127.0.0.1:0", pod_resources_socket=kubelet.socket_path,
                    sample_interval_s=60, pod_resources_refresh_s=60)
    return MetricsService(node.backend, node.topology, config, hostname="node-a", ready=lambda: True,
                          agent_metrics=AgentMetrics(CollectorRegistry(), node.backend))


def test_a_hung_nvml_read_holds_no_lock_and_the_scrape_answers_from_the_last_snapshot(box2, kubelet):
    service = service_on(box2, kubelet)
    service.sampler.sample_once()
    hung = HungSource(service.sampler.source)
    service.sampler.source = hung
    service.start()  # the sampler thread's first round hangs on GPU 0
    try:
        assert hung.entered.wait(5)
        assert held_locks(service.sampler) == []
        base = f"http://127.0.0.1:{service.port}"
        status, body, took = get(base + "/metrics")
        assert status == 200 and took < PROMPT_S
        assert {s.labels["gpu"] for s in samples_of(body, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1"}
        assert get(base + "/ready")[0] == 200
        text, took = timed(service.render)
        assert b"DCGM_FI_DEV_GPU_TEMP" in text and took < PROMPT_S
        assert service.sampler.snapshot.rounds == 1  # the hung round has published nothing
        _, took = timed(lambda: service.sampler.record_xid(1, 79))
        assert took < PROMPT_S
    finally:
        hung.release.set()
        service.stop()
    assert hung.events == ["read returned", "closed"]


def test_stopping_the_sampler_does_not_wait_for_a_hung_read_and_closes_the_source_after_it(box2):
    sampler = box2.sampler()
    hung = HungSource(sampler.source)
    sampler.source = hung
    sampler.start()
    assert hung.entered.wait(5)
    _, took = timed(lambda: sampler.stop(timeout_s=0.1))
    assert took < PROMPT_S
    assert hung.events == [], "the source is not closed under a read in flight"
    hung.release.set()
    deadline = time.monotonic() + 5
    while "closed" not in hung.events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hung.events == ["read returned", "closed"]


def test_a_hung_pod_resources_list_holds_no_lock_and_the_scrape_answers(box2, kubelet):
    kubelet.list_response = listing(
        pod("ml", "a", {"main": [("nvidia.com/gpu", [box2.topology.gpus[0].uuid])]}))
    kubelet.list_gate = Gate()
    service = service_on(box2, kubelet)
    service.sampler.sample_once()
    service.start()  # the cache's first List hangs in the kubelet
    try:
        assert kubelet.list_gate.entered.wait(5), "the cache's List never reached the kubelet"
        assert held_locks(service.pod_resources) == []
        status, body, took = get(f"http://127.0.0.1:{service.port}/metrics")
        assert status == 200 and took < PROMPT_S
        assert all("pod" not in s.labels for s in samples_of(body, "DCGM_FI_DEV_GPU_TEMP"))
        _, took = timed(service.render)
        assert took < PROMPT_S
        kubelet.list_gate.set()
        deadline = time.monotonic() + 5
        while not service.pod_resources.current.containers and time.monotonic() < deadline:
            time.sleep(0.01)
        body = get(f"http://127.0.0.1:{service.port}/metrics")[1]
        temps = samples_of(body, "DCGM_FI_DEV_GPU_TEMP")
        assert [s.labels.get("pod") for s in temps if s.labels["gpu"] == "0"] == ["a"]
    finally:
        kubelet.list_gate.set()
        service.stop()
