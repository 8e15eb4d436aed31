"""Callbacks that hear about a change: the one fan-out the agent's shared states use
(:class:`agent.health.HealthState`, :class:`agent.dra.checkpoint.Checkpoint`)."""

from __future__ import annotations

import logging
import threading
from typing import Callable

__all__ = ["Listeners"]


class Listeners:
    """``callback()``s run by :meth:`notify`, in the order added. Thread-safe: a leaf lock of
    its own, released before any callback runs, so the owner calls :meth:`notify` after
    releasing its lock and a callback may take locks of its own. A callback that raises is
    logged (``"<what> listener failed"``, on ``log``) and the others still run: a listener
    never fails the change it hears about."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def notify(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a listener must not break its owner
                self._log.exception("%s listener failed", self._what)
