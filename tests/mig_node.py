"""A DRA node of :mod:`test_dra_daemon` whose simulated machine is a MIG spec of the test's,
its MIG layout kept in a state file across agent processes (``GPU_AGENT_SIM_STATE``, as a
real GPU keeps it): the set-up the dynamic MIG tests that kill or reload a real agent share."""

from __future__ import annotations

import os

from agent_run import CONFIG_VARIABLES
from test_dra_daemon import ROOT, Node


class MigNode(Node):
    def __init__(self, spec: str) -> None:
        super().__init__()
        self.spec = os.path.join(self.root, "spec.yaml")
        with open(self.spec, "w", encoding="utf-8") as fh:
            fh.write(spec)
        self.state = os.path.join(self.root, "mig-state.json")

    def env(self, **extra: str) -> dict[str, str]:
        """The test's environment less what configures the agent, with the layout's state file."""
        env = {k: v for k, v in os.environ.items() if k not in CONFIG_VARIABLES}
        return {**env, "PYTHONPATH": ROOT, "GPU_AGENT_SIM_STATE": self.state, **extra}

    def run_args(self) -> list[str]:
        """``agent run``'s arguments: this machine, dynamic MIG on, this node's directories."""
        return ["--simulate", self.spec, "--dynamic-mig", "on", "--metrics-address", "127.0.0.1:0", *self.args()]
