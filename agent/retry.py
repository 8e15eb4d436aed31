"""How the agent's long-lived components retry and say so: one :class:`Backoff` and one
:class:`Outage` (the "said once" value) instead of a hand-rolled delay and flag in each.

- :class:`Backoff` is capped exponential backoff: ``initial``, then ``initial * factor``, ...
  up to ``max``; :meth:`Backoff.reset` starts again at ``initial`` once things work.
- :class:`Outage` is one thing that can fail and recover (a registration, a socket, an API
  watch). Its first failure is said once with the reason (again only when the reason
  changes, with ``per_reason``); the failures after it are counted and logged at DEBUG; the
  recovery is said once. A component retrying in a loop therefore writes two lines per
  outage, not one per retry (the agent's log-volume rule).

Neither takes a lock: each is owned by the one thread that retries (or guarded by its
owner's lock).
"""

from __future__ import annotations

import logging

__all__ = ["Backoff", "Outage"]


class Backoff:
    """Capped exponential backoff: :meth:`next` answers ``initial_s``, then ``factor`` times
    the last answer, never more than ``max_s``; :meth:`reset` starts over."""

    def __init__(self, initial_s: float, max_s: float, factor: float = 2.0) -> None:
        if initial_s <= 0 or max_s < initial_s or factor < 1:
            raise ValueError(f"backoff needs 0 < initial ({initial_s}) <= max ({max_s}) and factor >= 1 ({factor})")
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self._last_s = 0.0

    @property
    def last_s(self) -> float:
        """The delay :meth:`next` answered last (0 after a reset)."""
        return self._last_s

    def next(self) -> float:
        """The delay to wait before the next try."""
        last = self._last_s
        self._last_s = min(self.max_s, self.initial_s if last == 0 else last * self.factor)
        return self._last_s

    def reset(self) -> None:
        """Things work again: the next delay is ``initial_s``."""
        self._last_s = 0.0


class Outage:
    """The log lines of one thing that can fail and recover, ``what`` naming it as a
    gerund phrase ("registering nvidia.com/gpu with the kubelet").

    :meth:`failed` says ``"<what> failed: <reason> (<retrying>)"`` at ``level`` the first
    time (and when the reason changes, with ``per_reason``), then at DEBUG;
    :meth:`recovered` says ``"<what> works again"`` at ``recovered_level`` once after a
    failure (``recovered_level=None``: the caller says it in its own words)."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        level: int = logging.WARNING,
        recovered_level: int | None = logging.INFO,
        retrying: str = "retrying with backoff",
        per_reason: bool = False,
    ) -> None:
        self.log = log
        self.what = what
        self.level = level
        self.recovered_level = recovered_level
        self.retrying = retrying
        self.per_reason = per_reason
        self._reason: str | None = None
        self.failures = 0  # since the outage began

    @property
    def failing(self) -> bool:
        return self._reason is not None

    def failed(self, reason: str, *, exc_info: bool = False) -> bool:
        """One more failure; True when it was said (the outage's first, or a new reason)."""
        news = self._reason is None or (self.per_reason and reason != self._reason)
        self._reason = reason
        self.failures += 1
        suffix = f" ({self.retrying})" if self.retrying else ""
        if news:
            self.log.log(self.level, "%s failed: %s%s", self.what, reason, suffix, exc_info=exc_info)
        else:
            self.log.debug("%s failed again (%d times): %s", self.what, self.failures, reason)
        return news

    def recovered(self) -> bool:
        """It works (again); True when this ended an outage (said once at
        ``recovered_level`` unless that is None)."""
        if self._reason is None:
            return False
        self._reason = None
        self.failures = 0
        if self.recovered_level is not None:
            self.log.log(self.recovered_level, "%s works again", self.what)
        return True
