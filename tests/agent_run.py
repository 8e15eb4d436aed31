"""A real ``python -m agent run`` process whose log can be read while it runs (it goes to a
file, not a pipe that nobody drains)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Variables of the test's own environment that would change the agent's configuration.
CONFIG_VARIABLES = ("CONFIG_FILE", "KUBECONFIG", "AGENT_MODE", "NODE_NAME", "DELETE_SLICES_ON_SHUTDOWN")


class AgentRun:
    """``python -m agent run ARGS``, its stderr in ``log_path``."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=ROOT)
        for var in CONFIG_VARIABLES:
            env.pop(var, None)
        with open(log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "agent", "run", *args], cwd=ROOT, env=env,
                                         stdout=subprocess.DEVNULL, stderr=log, text=True)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def lines(self, fragment: str) -> list[str]:
        """The log lines holding ``fragment``."""
        return [line for line in self.log().splitlines() if fragment in line]

    def effective(self, which: str = "reloaded; effective configuration: ") -> list[dict]:
        """Every configuration the agent logged as effective (``which``: the reloaded ones by
        default; ``"effective configuration: "`` includes the one at start)."""
        return [json.loads(line.split(which, 1)[1]) for line in self.lines(which)]

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM; the exit code, or None when it did not exit within ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        reap(self.proc)


def reap(proc: subprocess.Popen) -> None:
    """Kills ``proc`` if it still runs and collects it (its pipes drained): the ``finally`` of
    a test that started an agent, so that a failed assertion leaves no process behind."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
