"""``doctor``: the node checks platform engineers run first. Each check reads (never writes,
restarts or registers) one thing that decides whether the agent can serve GPUs on this node
and answers PASS, WARN or FAIL, what it found and what to do.

- :mod:`agent.doctor.report`: results, the runner (every check in its own thread with a
  timeout: a hung NVML or socket costs that check, not the run) and the rendering;
- :mod:`agent.doctor.context`: the settings and the node read once, shared by the checks;
- the checks, by what they look at: :mod:`~agent.doctor.nvml`, :mod:`~agent.doctor.host`,
  :mod:`~agent.doctor.kubelet`, :mod:`~agent.doctor.settings`, :mod:`~agent.doctor.cluster`.

It sits just below the commands (``agent/commands/doctor.py`` parses the flags) and above
everything it checks, reaching NVML through ``agent.hw.nvml``, the kubelet through
``agent.kubelet`` and the API server through ``agent.kube`` (its client, ``call`` and
discovery). A rule the agent applies (a sharing's check of the node, the IMEX channels, the
MPS control program) is asked of the agent's own code, never written again here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.config import Config
from agent.doctor import cluster, host, kubelet, nvml, settings
from agent.doctor.context import DoctorContext
from agent.doctor.report import Check, Outcome, run_checks

__all__ = ["DoctorContext", "all_checks", "diagnose"]


def all_checks(load: Callable[[str], Config]) -> tuple[Check, ...]:
    """Every check, in the order they are shown; ``load`` reads a config file as ``run``
    would (for the per-node config)."""
    return (*nvml.CHECKS, *host.CHECKS, *kubelet.CHECKS, *settings.checks(load), *cluster.CHECKS)


def diagnose(context: DoctorContext, load: Callable[[str], Config]) -> tuple[list[Outcome], float]:
    """Run every check on ``context`` (closed afterwards): the outcomes and the wall time."""
    start = time.monotonic()
    try:
        outcomes = run_checks(all_checks(load), context)
    finally:
        context.close()
    return outcomes, time.monotonic() - start
