"""The production health watcher, built from the configuration: NVML's events (the backend),
the kernel log (``config.kernel_log``), the state file and the topology's bus IDs."""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

from agent.config import Config, state_dir_of
from agent.formats import parse_bus_id
from agent.health.faults import Fault, Occurrence
from agent.health.kernel_log import Inbox, KernelLogReader
from agent.health.persist import StateFile, read_boot_id
from agent.health.state import HealthState
from agent.health.watcher import HealthWatcher
from agent.hw.protocols import EventSource
from agent.topology.model import Topology

__all__ = ["build_watcher", "state_file_of", "xid_counter"]

log = logging.getLogger(__name__)


def state_file_of(config: Config) -> str:
    """``health.stateFile``, or where it is by default (:class:`Config`'s ``health_state_file``)."""
    return config.health_state_file or os.path.join(state_dir_of(config), "health-state.json")


def build_watcher(
    backend: EventSource,
    state: HealthState,
    config: Config,
    topology: Topology,
    *,
    on_xid: Callable[[int, int], None] | None = None,
    facts: Callable[[], Iterable[Fault]] | None = None,
    simulated: bool = False,
) -> HealthWatcher:
    """The watcher of ``topology``'s GPUs (not yet started). A ``simulated`` machine reads a
    kernel log and keeps a state file only when they are configured (the host's default
    ``/dev/kmsg`` and state directory are not the simulated machine's)."""
    bus_ids: dict[tuple[int, int, int], int] = {}
    for gpu in topology.gpus:
        try:
            domain, bus, dev, _fn = parse_bus_id(gpu.pci_bus_id)
        except ValueError:
            continue  # no bus ID known: its kernel-log lines name a bus that is no GPU of ours
        bus_ids[(domain, bus, dev)] = gpu.index
    boot_id = read_boot_id(config.proc_root)
    kernel_log = "" if simulated and config.kernel_log == Config().kernel_log else config.kernel_log
    reader = KernelLogReader(kernel_log, Inbox(), boot_id=boot_id) if kernel_log else None
    if reader is None:
        log.info("no kernel log read (give --kernel-log): XIDs come from NVML alone")
    state_file = None if simulated and not config.health_state_file else StateFile(state_file_of(config), boot_id)
    return HealthWatcher(backend, state, config, on_xid=on_xid, bus_ids=bus_ids, kernel_log=reader,
                         state_file=state_file, facts=facts,
                         facts_interval_s=config.health_facts_interval_s)


def xid_counter(count: Callable[[int, int, int], None]) -> Callable[[Occurrence], None]:
    """An occurrence listener calling ``count(gpu, xid, n)`` for every XID line or event seen
    on a GPU, fault or not (``DCGM_EXP_XID_ERRORS_TOTAL``); recoveries and the repeated-XID
    faults (made of XIDs already counted) are not counted."""

    def listener(o: Occurrence) -> None:
        if o.xid is not None and len(o.gpus) == 1 and not o.recovered and not o.key.startswith("repeated-"):
            count(o.gpus[0], o.xid, o.count)

    return listener
