"""The simulator's MIG state file: the MIG mode and layout of the simulated GPUs, kept across
agent restarts as a real GPU keeps them (``GPU_AGENT_SIM_STATE=<path>``).

When the environment names a file, a simulated machine starts from the layout in it (the
machine spec's where it holds nothing for a GPU) and writes it again, atomically, after every
MIG change: an agent killed between creating an instance and its checkpoint finds the
instance on the same simulated GPUs when it starts again. GPUs are matched by UUID; a file
written for another machine, or one that cannot be read, is one :class:`InputFormatError`
naming the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from agent.errors import InputFormatError
from agent.files import write_json_atomic
from agent.hw.sim.nvml_mig_state import MigGpuState
from agent.hw.sim.spec_model import MachineSpec

__all__ = ["STATE_ENV", "load_mig_state", "save_mig_state"]

log = logging.getLogger(__name__)

#: The environment variable naming the state file.
STATE_ENV = "GPU_AGENT_SIM_STATE"
_VERSION = 1


def load_mig_state(path: str, spec: MachineSpec, states: Sequence[MigGpuState]) -> None:
    """Lay the layout of ``path`` over ``states`` (one per GPU of ``spec``); nothing when the
    file does not exist yet."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        raise InputFormatError(
            f"{path} ({STATE_ENV}): not a readable MIG state file: {exc}"
        ) from None
    try:
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            raise ValueError(f"expected a mapping with version {_VERSION}")
        if data.get("machine") != spec.name:
            raise ValueError(f"written for machine {data.get('machine')!r}, not {spec.name!r}")
        gpus = data["gpus"]
        if not isinstance(gpus, dict):
            raise ValueError("gpus: expected a mapping of GPU UUIDs")
        for g, state in zip(spec.gpus, states):
            if g.uuid in gpus:
                state.load_json(gpus[g.uuid])
    except (KeyError, TypeError, ValueError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise InputFormatError(
            f"{path} ({STATE_ENV}): not a MIG state file of this simulator: {what}"
        ) from None


def save_mig_state(path: str, spec: MachineSpec, states: Sequence[MigGpuState]) -> None:
    """Write ``states`` to ``path`` atomically; a failure is logged (the simulated GPUs keep
    their layout in memory)."""
    data = {
        "version": _VERSION,
        "machine": spec.name,
        "gpus": {g.uuid: state.to_json() for g, state in zip(spec.gpus, states)},
    }
    try:
        write_json_atomic(path, data)
    except OSError as exc:
        log.warning("cannot write the simulator's MIG state file %s: %s", path, exc)


def state_path() -> str | None:
    """The state file the environment names (None: the layout lives in memory only)."""
    return os.environ.get(STATE_ENV) or None
