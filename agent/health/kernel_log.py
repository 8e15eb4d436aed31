"""The kernel log as a health source: NVRM ``Xid`` lines, NVSwitch ``SXid`` lines and the
driver's GPU (re)initialisation line, read from ``/dev/kmsg`` or from a plain file.

:func:`parse_line` turns one line into a :class:`KernelEvent` (or None: not ours, or a
malformed one of ours, counted by kind). Two spellings of a line are read:

- ``/dev/kmsg`` records, ``PRIO,SEQ,USEC,FLAGS[,...];MESSAGE`` (continuation lines starting
  with a space are dropped); the position of an event is the record's sequence number;
- plain text lines (``dmesg`` output, a file or FIFO the simulator's users append to); the
  position is the line's byte offset in the file.

:class:`KernelLogReader` follows one path like ``tail -f`` on its own thread, from the start
(the lines since boot, so a fault before the agent started is not lost) and hands events to
an :class:`Inbox`: at most :data:`INBOX_KEYS` distinct kinds of event, each with a count, so a
storm of 10,000 identical lines costs one entry, never a queue of 10,000.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import stat
import threading
from dataclasses import dataclass
from typing import Callable

from agent.worker import Worker

__all__ = ["INBOX_KEYS", "Inbox", "KernelEvent", "KernelLogReader", "parse_line", "parse_record"]

log = logging.getLogger(__name__)

#: distinct events an inbox holds between two drains; more are counted and dropped
INBOX_KEYS = 256
#: a line longer than this is cut (the parts that matter come first)
MAX_LINE_BYTES = 4096
_READ_BYTES = 65536

_KMSG_RECORD = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$", re.S)
_PCI = r"(?:PCI:)?(?P<pci>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?"
_XID = re.compile(r"NVRM: Xid \(" + _PCI + r"\): (?P<code>\d{1,5})(?:[, ]\s*(?P<rest>.*))?$")
_SXID = re.compile(r"(?P<dev>nvidia-nvswitch\d+): SXid \(" + _PCI + r"\): (?P<code>\d{1,5})(?:[, ]\s*(?P<rest>.*))?$")
# Logged by the driver once per GPU initialisation, before that GPU's first XID: seen again
# after a fault, it says the driver set the GPU up anew (a GPU reset or a driver reload).
_GPU_INIT = re.compile(r"NVRM: GPU at " + _PCI + r": (?P<uuid>GPU-[0-9a-fA-F-]+)\s*$")


@dataclass(frozen=True)
class KernelEvent:
    """One line of ours. ``kind``: ``"xid"``, ``"sxid"`` or ``"gpu-init"``; ``pci``:
    ``(domain, bus, device)`` as the driver prints it; ``code``: the XID or SXid number (0 for
    ``gpu-init``); ``text``: what follows the number (the UUID for ``gpu-init``);
    ``device``: the NVSwitch (``nvidia-nvswitch3``) of an SXid, else ""."""

    kind: str
    pci: tuple[int, int, int]
    code: int
    text: str
    device: str = ""


def parse_record(line: str) -> tuple[int | None, str]:
    """``(kmsg sequence number or None, message)`` of one line in either spelling."""
    m = _KMSG_RECORD.match(line)
    if m is None:
        return None, line.rstrip("\n")
    return int(m.group(2)), m.group(4).split("\n", 1)[0]


def _pci(text: str) -> tuple[int, int, int]:
    domain, bus, dev = text.split(":")
    return int(domain, 16), int(bus, 16), int(dev, 16)


def parse_line(message: str) -> KernelEvent | str | None:
    """The event one message holds; a string naming the kind of a line of ours that does not
    parse (``"xid"``, ``"sxid"``); None for any other line."""
    if "Xid" not in message and "NVRM: GPU at" not in message:
        return None
    if "SXid" in message:
        m = _SXID.search(message)
        if m is None:
            return "sxid"
        return KernelEvent("sxid", _pci(m["pci"]), int(m["code"]), (m["rest"] or "").strip(), m["dev"])
    if "NVRM: Xid" in message:
        m = _XID.search(message)
        if m is None:
            return "xid"
        return KernelEvent("xid", _pci(m["pci"]), int(m["code"]), (m["rest"] or "").strip())
    m = _GPU_INIT.search(message)
    if m is not None:
        return KernelEvent("gpu-init", _pci(m["pci"]), 0, m["uuid"])
    return None


def _aggregation_key(event: KernelEvent) -> tuple[object, ...]:
    # NVLink XIDs (144-150) and XID 154 say what they need in their text: keep it apart.
    # Any other XID of one GPU is one fault whatever its text (a pid, a channel).
    if event.kind == "xid" and (144 <= event.code <= 150 or event.code == 154):
        return (event.kind, event.pci, event.code, event.text)
    return (event.kind, event.pci, event.code, event.device)


class Inbox:
    """Events waiting for the watcher, aggregated: one entry per distinct event with the
    number of times it came and the last position it came at. A ``gpu-init`` line is a
    barrier (what came before it is not merged with what comes after: a fault before a reset
    and one after it are not one). Thread-safe; bounded by ``max_keys`` entries."""

    def __init__(self, max_keys: int = INBOX_KEYS) -> None:
        self._lock = threading.Lock()
        self._entries: list[list[object]] = []  # [event, count, last position], oldest first
        self._open: dict[tuple[object, ...], list[object]] = {}  # key -> its entry since the last barrier
        self._max_keys = max_keys
        self.dropped = 0  # events that found the inbox full (cumulative)
        self.malformed: dict[str, int] = {}  # lines of ours that did not parse, by kind (cumulative)

    def put(self, event: KernelEvent, position: int | None) -> None:
        key = _aggregation_key(event)
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                entry[1] = int(entry[1]) + 1  # type: ignore[call-overload]
                entry[2] = position
                return
            if len(self._entries) >= self._max_keys:
                self.dropped += 1
                return
            entry = [event, 1, position]
            self._entries.append(entry)
            if event.kind == "gpu-init":
                self._open = {}
            else:
                self._open[key] = entry

    def count_malformed(self, kind: str) -> None:
        with self._lock:
            self.malformed[kind] = self.malformed.get(kind, 0) + 1

    def drain(self) -> list[tuple[KernelEvent, int, int | None]]:
        """``(event, count, last position)`` for each entry, oldest first; empties the inbox."""
        with self._lock:
            entries, self._entries, self._open = self._entries, [], {}
        return [(e[0], e[1], e[2]) for e in entries]  # type: ignore[misc]


class KernelLogReader(Worker):
    """Follows ``path`` (``/dev/kmsg``, a regular file or a FIFO) into ``inbox``.

    ``resume(stream) -> position``: lines of ``stream`` (:attr:`stream`, an identity of the
    file and the boot) at or before ``position`` were handled by an earlier run and are
    skipped (-1: none). A regular file that shrinks or is replaced is read again from its
    start as a new stream. A path that cannot be opened is retried every ``retry_s`` (said
    once). ``poll_s`` bounds how long a stop waits."""

    thread_name = "kernel-log"

    def __init__(
        self,
        path: str,
        inbox: Inbox,
        *,
        boot_id: str = "",
        resume: Callable[[str], int] = lambda _stream: -1,
        poll_s: float = 0.2,
        retry_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.path = path
        self.inbox = inbox
        self.boot_id = boot_id
        self.resume = resume  # may be replaced before start (the watcher's saved position)
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.stream = ""
        self.position = -1  # the last position read (of :attr:`stream`)
        self._said_malformed: set[str] = set()
        self._said_open = False
        self._skip_through = -1
        #: set once every line there was at start has been read (or the log cannot be read):
        #: the watcher's start-up read is then complete
        self.caught_up = threading.Event()

    # ------------------------------------------------------------------ lines
    def _take(self, line: str, position: int | None) -> None:
        seq, message = parse_record(line[:MAX_LINE_BYTES])
        if seq is not None:
            position = seq
        if position is not None:
            self.position = position
            if position <= self._skip_through:
                return
        event = parse_line(message)
        if event is None:
            return
        if isinstance(event, str):
            self.inbox.count_malformed(event)
            if event not in self._said_malformed:  # once per kind: a storm of bad lines is one log line
                self._said_malformed.add(event)
                log.warning("kernel log %s: a %s line that does not parse, skipped (counted; said once): %r",
                            self.path, "SXid" if event == "sxid" else "Xid", message[:200])
            return
        self.inbox.put(event, position)

    # ------------------------------------------------------------------ following
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                if not self._said_open:
                    log.error("cannot read the kernel log %s (%s): XID lines are not watched until it can"
                              " be read; retrying every %.0f s", self.path, exc.strerror or exc, self.retry_s)
                    self._said_open = True
                self.caught_up.set()  # nothing to wait for: said, and retried
                self._stop.wait(self.retry_s)
                continue
            if self._said_open:
                log.warning("reading the kernel log %s again", self.path)
                self._said_open = False
            try:
                self._follow(fd)
            except OSError as exc:
                log.error("kernel log %s: read failed (%s); reopening in %.0f s", self.path, exc, self.retry_s)
                self._stop.wait(self.retry_s)
            finally:
                os.close(fd)

    def _start_stream(self, stream: str) -> None:
        self.stream = stream
        self.position = -1
        self._skip_through = self.resume(stream)

    def _follow(self, fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode):
            self._start_stream(f"kmsg:{self.boot_id}")
            self._follow_kmsg(fd)
        else:
            regular = stat.S_ISREG(st.st_mode)
            stream = f"file:{st.st_dev}:{st.st_ino}:{self.boot_id}" if regular else ""
            self._start_stream(stream)
            if regular and self._skip_through >= st.st_size:
                self._skip_through = -1  # shorter than what was read before: not the same file
            self._follow_text(fd, regular)

    def _follow_kmsg(self, fd: int) -> None:
        while not self._stop.is_set():
            try:
                record = os.read(fd, 8192)  # one record per read
            except BlockingIOError:
                self.caught_up.set()
                select.select([fd], [], [], self.poll_s)
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                raise
            self._take(record.decode("utf-8", "replace"), None)

    def _follow_text(self, fd: int, regular: bool) -> None:
        offset = 0
        partial = b""
        while not self._stop.is_set():
            try:
                chunk = os.read(fd, _READ_BYTES)
            except BlockingIOError:
                chunk = b""
            if not chunk:
                self.caught_up.set()
                if regular and self._replaced(fd, offset + len(partial)):
                    return  # reopened by _run: a new stream
                self._stop.wait(self.poll_s)
                continue
            data = partial + chunk
            lines = data.split(b"\n")
            partial = lines.pop()
            for raw in lines:
                self._take(raw.decode("utf-8", "replace"), offset)
                offset += len(raw) + 1
            if len(partial) > _READ_BYTES:  # one endless line: cut it, keep following
                self._take(partial.decode("utf-8", "replace"), offset)
                offset += len(partial)
                partial = b""

    def _replaced(self, fd: int, read: int) -> bool:
        try:
            now = os.stat(self.path)
        except OSError:
            return False
        was = os.fstat(fd)
        return (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino) or now.st_size < read
