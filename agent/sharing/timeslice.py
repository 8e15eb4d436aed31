"""Setting a GPU's time-slice interval: how long the GPU's scheduler lets one context run
before it switches to the next (DRA claims that ask for ``TimeSlicing`` with an interval).

The intervals are NVIDIA's names and values (``nvidia-smi compute-policy --set-timeslice``:
0 Default, 1 Short, 2 Medium, 3 Long). The preparer sets them through the narrow
:class:`TimeSliceControl`; :class:`NvidiaSmiTimeSlice` is the node's, which runs
``<nvidia-smi> compute-policy -i <GPU UUID> --set-timeslice <n>`` per GPU, as NVIDIA's DRA
driver does. A whole GPU only: NVIDIA's tool takes no MIG device there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Protocol

from agent.errors import AgentError

#: The interval names, in NVIDIA's order; each one's value is its position.
TIMESLICE_INTERVALS = ("Default", "Short", "Medium", "Long")
DEFAULT_INTERVAL = "Default"
#: How long one nvidia-smi run may take (s).
NVIDIA_SMI_TIMEOUT_S = 10.0


class TimeSliceControl(Protocol):
    def set_timeslice(self, gpu_uuid: str, interval: str) -> None:
        """Give the whole GPU ``gpu_uuid`` the time-slice ``interval`` (one of
        :data:`TIMESLICE_INTERVALS`); AgentError naming the GPU and why when it cannot."""
        ...


class NvidiaSmiTimeSlice:
    """:class:`TimeSliceControl` through ``program`` (``nvidia-smi``, a name on the PATH or a
    path; ``--nvidia-smi``)."""

    def __init__(self, program: str, timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> None:
        self.program = program
        self.timeout_s = timeout_s

    def set_timeslice(self, gpu_uuid: str, interval: str) -> None:
        value = TIMESLICE_INTERVALS.index(interval)
        program = self.program if "/" in self.program else shutil.which(self.program)
        if program is None or not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise AgentError(f"cannot set the time-slice interval of GPU {gpu_uuid}: {self.program} is not there"
                             " (not an executable file, or not on the PATH; --nvidia-smi)")
        args = [program, "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(value)]
        what = f"{os.path.basename(program)} compute-policy -i {gpu_uuid} --set-timeslice {value} ({interval})"
        try:
            done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise AgentError(f"{what}: no answer in {self.timeout_s:g} s") from None
        except OSError as exc:
            raise AgentError(f"{what}: cannot run {program}: {exc.strerror or exc}") from None
        if done.returncode != 0:
            text = (done.stdout + done.stderr).decode(errors="replace").strip()
            detail = f": {text.splitlines()[-1][:300]}" if text else ""
            raise AgentError(f"{what}: exit status {done.returncode}{detail}")
