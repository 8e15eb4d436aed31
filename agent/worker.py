"""The agent's background threads share one lifecycle: one daemon thread per worker,
started once, stopped by setting an event that its loop waits on."""

from __future__ import annotations

import threading


class Worker:
    """Runs :meth:`_run` on one daemon thread named ``thread_name``. ``_run`` loops until
    ``self._stop`` is set and waits on it (``self._stop.wait(s)``, or :meth:`_nap` where
    others may :meth:`wake` it) rather than sleeping, so :meth:`stop` returns promptly."""

    thread_name = "worker"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; a second call while it runs does nothing."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """The thread runs (started, not stopped, and its loop has not ended)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the loop to end and wait up to ``timeout_s`` for it; idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def wake(self) -> None:
        """End the loop's current :meth:`_nap` now (the owner has news)."""
        self._wake.set()

    def _nap(self, seconds: float) -> None:
        """Wait up to ``seconds``, or until :meth:`wake` or :meth:`stop`."""
        self._wake.wait(max(0.0, seconds))
        self._wake.clear()

    def _run(self) -> None:
        raise NotImplementedError

