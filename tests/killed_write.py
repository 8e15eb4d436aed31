"""What an atomic write leaves when its process is killed between writing the temp file and
renaming it into place: the write runs in a child process that SIGKILLs itself where
``os.replace`` would rename."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = "import os, signal\nos.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"


def killed_write(statement: str, directory: str) -> str:
    """Run ``statement`` (Python, the agent importable) in a child killed at its first rename;
    the name of the one file it left in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    before = set(os.listdir(directory))
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + statement], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = set(os.listdir(directory)) - before
    return left
