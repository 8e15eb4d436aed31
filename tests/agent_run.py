"""A real ``python -m agent run`` process whose log can be read while it runs (it goes to a
file, not a pipe that nobody drains).

Give it ``--metrics-address 127.0.0.1:0`` (the probes then take a free port too) and read the
ports it bound with :meth:`AgentRun.ports`. A port picked beforehand with a throw-away bind
is not safe under ``pytest -n``: another test's socket can take it before the agent binds,
and the probes' default, the metrics port + 1, is never checked at all (on Linux it is the
even neighbour that outgoing connections are given); the agent then exits at start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Variables of the test's own environment that would change the agent's configuration.
CONFIG_VARIABLES = ("CONFIG_FILE", "KUBECONFIG", "AGENT_MODE", "NODE_NAME", "DELETE_SLICES_ON_SHUTDOWN",
                    "LABELS_SINK", "POD_NAMESPACE", "POD_NAME", "POD_UID")
#: The agent's start-up line naming its listeners (agent.http.endpoints.HttpEndpoints.describe).
LISTENING = re.compile(r"metrics on \S+:(\d+) \(https?: /metrics\), probes on \S+:(\d+) ")


class AgentRun:
    """``python -m agent run ARGS``, its stderr in ``log_path``; ``env`` is added to the
    test's environment (less the variables that configure the agent)."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        environ = {k: v for k, v in os.environ.items() if k not in CONFIG_VARIABLES}
        environ.update(env or {}, PYTHONPATH=ROOT)
        with open(log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "agent", "run", *args], cwd=ROOT, env=environ,
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

    def ports(self, timeout_s: float = 30.0) -> tuple[int, int]:
        """(metrics port, probe port) of the latest listeners the agent logged, waiting up to
        ``timeout_s`` for the first; AssertionError with the log's tail if it exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = LISTENING.findall(self.log())
            if found:
                metrics, probes = found[-1]
                return int(metrics), int(probes)
            assert self.proc.poll() is None, f"the agent exited ({self.proc.returncode}):\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"no listeners logged in {timeout_s} s:\n{self.log()[-3000:]}"
            time.sleep(0.05)

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
