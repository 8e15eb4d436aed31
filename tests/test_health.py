"""Health watcher: critical events mark GPUs unhealthy, quiet GPUs recover, a failing
watcher fences every GPU."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import pytest

from agent.config import Config
from agent.health import FENCED_REASON_PREFIX, HealthState, HealthWatcher


@dataclass(frozen=True)
class Event:
    gpu_index: int
    kind: str
    xid: int | None = None


class ScriptedEvents:
    """An event source with the backend's two methods; events are queued by the test."""

    def __init__(self, gpu_count: int) -> None:
        self.queue: list[Event] = []
        self.answering = [True] * gpu_count
        self.lost_gpus: set[int] = set()  # GPUs the backend found lost on other calls
        self.fail_with: Exception | None = None
        self.cond = threading.Condition()

    def push(self, *events: Event) -> None:
        with self.cond:
            self.queue.extend(events)
            self.cond.notify_all()

    def wait_events(self, timeout_ms: int):
        with self.cond:
            if self.fail_with is not None:
                raise self.fail_with
            if not self.queue:
                self.cond.wait(timeout_ms / 1000)
            out, self.queue = self.queue, []
            return out

    def probe(self, index: int) -> bool:
        return self.answering[index]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watcher(config=None, gpus=4):
    source = ScriptedEvents(gpus)
    state = HealthState(gpus)
    clock = Clock()
    w = HealthWatcher(source, state, config or Config(health_recovery_s=60), poll_ms=1, clock=clock)
    return source, state, clock, w


def test_critical_xid_marks_its_gpu_unhealthy():
    source, state, _, w = watcher()
    source.push(Event(2, "xid", 79))
    w.step()
    assert state.snapshot() == {2: "XID 79"}


def test_application_xids_are_ignored_by_default():
    source, state, _, w = watcher()
    source.push(*(Event(1, "xid", x) for x in (13, 31, 43, 45, 68, 109)))
    w.step()
    assert state.snapshot() == {}


def test_configured_critical_xid_overrides_the_ignore_list():
    source, state, _, w = watcher(Config(extra_critical_xids=(13,)))
    source.push(Event(1, "xid", 13))
    w.step()
    assert state.snapshot() == {1: "XID 13"}


def test_double_bit_ecc_and_lost_gpu_mark_unhealthy():
    source, state, _, w = watcher()
    source.push(Event(0, "ecc_dbe"), Event(3, "lost"))
    w.step()
    assert state.snapshot() == {0: "double-bit ECC error", 3: "GPU lost"}


def test_gpu_recovers_after_the_quiet_period_when_it_answers():
    source, state, clock, w = watcher(Config(health_recovery_s=60))
    source.push(Event(2, "xid", 79))
    w.step()
    clock.now += 59
    w.step()
    assert not state.is_healthy(2)
    clock.now += 1
    w.step()
    assert state.is_healthy(2)


def test_new_event_restarts_the_quiet_period():
    source, state, clock, w = watcher(Config(health_recovery_s=60))
    source.push(Event(2, "xid", 79))
    w.step()
    clock.now += 50
    source.push(Event(2, "xid", 48))
    w.step()
    clock.now += 50
    w.step()
    assert not state.is_healthy(2)
    clock.now += 10
    w.step()
    assert state.is_healthy(2)


def test_gpu_that_does_not_answer_stays_unhealthy():
    source, state, clock, w = watcher(Config(health_recovery_s=10))
    source.push(Event(1, "lost"))
    source.answering[1] = False
    w.step()
    clock.now += 100
    w.step()
    assert not state.is_healthy(1)
    source.answering[1] = True
    clock.now += 5
    w.step()
    assert not state.is_healthy(1)  # quiet period counts from the last failed probe
    clock.now += 5
    w.step()
    assert state.is_healthy(1)


def test_generation_advances_on_every_change_and_wakes_waiters():
    state = HealthState(2)
    g0 = state.generation
    woke = []
    t = threading.Thread(target=lambda: woke.append(state.wait_for_change(g0, 5.0)))
    t.start()
    state.mark_unhealthy(1, "XID 48")
    t.join(5)
    assert woke == [g0 + 1]
    assert state.mark_unhealthy(1, "XID 48") is False and state.generation == g0 + 1


def test_watcher_failure_fences_every_gpu_loudly(caplog):
    source, state, clock, w = watcher(Config(health_recovery_s=30))
    w.retry_s = 0.01
    source.fail_with = RuntimeError("event set broken")
    with caplog.at_level(logging.ERROR, logger="agent.health"):
        w.start()
        assert _wait(lambda: len(state.snapshot()) == 4)
        w.stop()
    assert all(r.startswith(FENCED_REASON_PREFIX) for r in state.snapshot().values())
    assert any("HEALTH WATCHER FAILED" in r.message and r.levelno == logging.ERROR for r in caplog.records)
    assert w.fenced


def test_fenced_gpus_recover_once_the_watcher_works_again():
    source, state, clock, w = watcher(Config(health_recovery_s=30))
    source.fail_with = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        w.step()
    w._fence(RuntimeError("boom"))
    source.fail_with = None
    w.step()
    assert len(state.snapshot()) == 4 and not w.fenced
    clock.now += 30
    w.step()
    assert state.snapshot() == {}


def test_watcher_thread_applies_events_and_stops_promptly():
    source, state, clock, w = watcher()
    before = set(threading.enumerate())
    w.start()
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "health-watcher"]
    source.push(Event(0, "xid", 48))
    assert _wait(lambda: not state.is_healthy(0))
    w.stop(timeout_s=2.0)
    assert not thread.is_alive()


def _wait(predicate, timeout_s=5.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_gpu_the_backend_found_lost_is_marked_unhealthy_once():
    source, state, clock, w = watcher(Config(health_recovery_s=10))
    source.lost_gpus = {3}
    source.answering[3] = False
    w.step()
    assert state.snapshot() == {3: "GPU lost"}
    source.answering[3] = True
    clock.now += 10
    w.step()
    assert state.is_healthy(3)  # still listed by the backend, but not newly lost


def test_a_failing_listener_is_logged_and_the_others_still_hear_every_change(caplog):
    state = HealthState(4)
    heard: list[dict[int, str]] = []

    def broken() -> None:
        raise RuntimeError("listener bug")

    state.add_listener(broken)
    state.add_listener(lambda: heard.append(state.snapshot()))
    with caplog.at_level(logging.ERROR, logger="agent.health"):
        assert state.mark_unhealthy(1, "XID 79")
        assert state.mark_healthy(1)
    assert heard == [{1: "XID 79"}, {}]
    failed = [r for r in caplog.records if r.getMessage() == "health listener failed"]
    assert len(failed) == 2 and all(r.exc_info for r in failed)
