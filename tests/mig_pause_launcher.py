"""``gpu-topology-agent run ARGS`` whose MIG create or destroy (``MIG_PAUSE=create`` or
``destroy``) pauses once its effect is done, after writing the file ``MIG_PAUSE_MARK``: the
kill point of the crash tests (the instance made, or destroyed, and the agent's checkpoint not
yet told) held open long enough for a test to SIGKILL the agent there. The simulated GPUs
(``GPU_AGENT_SIM_STATE``) have kept the change by then, as a real GPU would. A test harness:
a stand-in for a slow NVML call, nothing of the agent's own."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from agent.cli import main
from agent.hw.nvml import mig_control

PAUSE_S = 120.0


def _pausing(real: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        with open(os.environ["MIG_PAUSE_MARK"], "w", encoding="utf-8") as fh:
            fh.write(real.__name__)
        time.sleep(PAUSE_S)
        return out

    return call


if __name__ == "__main__":
    which = os.environ.get("MIG_PAUSE", "")
    if which in ("create", "destroy"):
        name = f"{which}_mig"
        setattr(mig_control.NvmlMig, name, _pausing(getattr(mig_control.NvmlMig, name)))
    sys.exit(main(["run", *sys.argv[1:]]))
