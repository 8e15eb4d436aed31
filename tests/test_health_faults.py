"""The fault model of the health watcher, driven through its sources (NVML events, kernel-log
lines in the inbox, the facts' poll) and read through HealthState (faults, occurrences,
watching, per-GPU marks)."""

from __future__ import annotations

from test_health import Clock, Event, ScriptedEvents

from agent.config import Config
from agent.health import Fault, FaultClass, HealthState, HealthWatcher, Watching
from agent.health.kernel_log import parse_line

BUS = {(0, 0x1B, 0): 0, (0, 0x43, 0): 1}


def watcher(config=None, facts=None):
    source, state, clock = ScriptedEvents(2), HealthState(2), Clock()
    heard = []
    state.add_occurrence_listener(heard.append)
    w = HealthWatcher(source, state, config or Config(health_recovery_s=60), poll_ms=1, clock=clock,
                      wall=clock, bus_ids=BUS, facts=facts, facts_interval_s=10)
    return source, state, clock, w, heard


def kmsg(w: HealthWatcher, *lines: str) -> None:
    for line in lines:
        w.inbox.put(parse_line(line), None)


def test_the_same_xid_from_nvml_and_the_kernel_log_is_one_occurrence():
    source, state, clock, w, heard = watcher()
    source.push(Event(0, "xid", 79))
    kmsg(w, "NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.")
    w.step()
    w.step()
    assert sum(o.count for o in heard if o.xid == 79) == 1
    clock.now += 11  # past the window: a new line is a new occurrence
    kmsg(w, "NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.")
    w.step()
    assert sum(o.count for o in heard if o.xid == 79) == 2
    assert [f.key for f in state.faults()] == ["xid-79/gpu-0"] and state.faults()[0].count == 2


def test_an_ignored_xid_is_never_a_fault_by_itself_and_a_critical_one_always_is():
    source, state, _, w, heard = watcher(Config(ignored_xids=(79,), extra_critical_xids=(13,)))
    source.push(Event(0, "xid", 79), Event(1, "xid", 13))
    w.step()
    assert [(f.key, f.cls) for f in state.faults()] == [("xid-13/gpu-1", FaultClass.GPU_RESET_REQUIRED)]
    assert state.snapshot() == {1: "XID 13"}
    assert [o.cls for o in heard if o.xid == 79] == [FaultClass.APPLICATION]


def test_xid_154_stands_until_the_driver_names_no_action_and_the_quiet_period_does_not_clear_it():
    source, state, clock, w, heard = watcher()
    kmsg(w, "NVRM: Xid (PCI:0000:43:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")
    w.step()
    assert [(f.key, f.cls) for f in state.faults()] == [("recovery-action/gpu-1", FaultClass.GPU_RESET_REQUIRED)]
    clock.now += 600
    w.step()
    assert not state.is_healthy(1)
    kmsg(w, "NVRM: Xid (PCI:0000:43:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)")
    w.step()
    assert state.faults() == () and state.is_healthy(1)
    assert heard[-1].recovered and heard[-1].key == "recovery-action/gpu-1"


def test_an_xid_on_a_bus_that_is_no_gpu_of_ours_is_a_node_wide_fault():
    _, state, _, w, _ = watcher()
    kmsg(w, "NVRM: Xid (PCI:0000:99:00): 79, pid=1, GPU has fallen off the bus.")
    w.step()
    assert [(f.key, f.gpus) for f in state.faults()] == [("xid-79/pci-0000:99:00", ())]
    assert state.snapshot() == {}


def test_the_facts_poll_raises_and_clears_its_faults_and_marks_their_gpus():
    found = [Fault("row-remap-failure/gpu-0", FaultClass.MEMORY_ERROR, (0,), "Reset the GPU.", "row remap failed")]
    _, state, clock, w, heard = watcher(facts=lambda: list(found))
    w.step()
    assert [f.key for f in state.faults()] == ["row-remap-failure/gpu-0"] and not state.is_healthy(0)
    found.clear()
    clock.now += 5
    w.step()
    assert state.faults() != ()  # polled every facts_interval_s
    clock.now += 5
    w.step()
    assert state.faults() == () and state.is_healthy(0) and heard[-1].recovered


def test_a_failing_event_source_says_nvml_unavailable_and_a_working_one_says_watching():
    source, state, _, w, _ = watcher()
    source.fail_with = RuntimeError("NVML gone")
    try:
        w.step()
    except RuntimeError as exc:
        w._fence(exc)
    assert state.watching() == Watching.NVML_UNAVAILABLE
    source.fail_with = None
    w.step()
    assert state.watching() == Watching.YES
