"""Waiting for something the agent does in the background, seen from outside."""

from __future__ import annotations

import time
from typing import Callable


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0, poll_s: float = 0.02) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()
