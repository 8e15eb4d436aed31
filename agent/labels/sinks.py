"""Where labels go. A sink is the only I/O of the labels feature.

:class:`FeatureFileSink` writes Node Feature Discovery's *local* source format: one file in
``features.d`` holding ``key=value`` lines, which NFD's worker turns into node labels. NFD
may read the directory at any moment, so the file is written to a dot-file in the same
directory (NFD skips dot-files) and renamed over the old one: readers see the old or the
new content, never half a file. Whatever stands at the path (a file of another encoding or
size, a named pipe, a link, a directory) never blocks, crashes or misleads the agent: see
:class:`FeatureFileSink`. The sink logs only what changes state (a special file replaced);
the publisher says when the labels themselves change.

:func:`label_sink` picks the sink ``--labels-sink`` names: this one, or
:class:`agent.labels.nodefeature.NodeFeatureSink` (NFD's NodeFeature API).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
from typing import Mapping, Protocol

from agent.config import Config
from agent.files import TEMP_SUFFIX, remove_stale_temps, temp_prefix
from agent.labels import format_labels

log = logging.getLogger(__name__)


class LabelSink(Protocol):
    """Destination for node labels."""

    #: where the labels go, for log lines (a directory, an object's kind and name)
    where: str

    def write(self, labels: Mapping[str, str]) -> bool:
        """Publish ``labels`` (the complete set); True if what was published changed.
        A failure raises OSError (the publisher logs it) or
        :class:`agent.errors.LabelWriteError` (the sink logged it)."""
        ...

    def remove(self) -> None:
        """Withdraw the labels (clean shutdown). No error if nothing was written."""
        ...


class FeatureFileSink:
    """NFD feature file ``<features_dir>/<filename>``; rewritten only when labels change.

    Whatever else is found at the path is never trusted, never followed and never waited on.
    The sink reads back only the regular file it wrote itself (same device and inode), opened
    with ``O_NOFOLLOW | O_NONBLOCK`` after ``lstat`` and checked again with ``fstat``, and
    reads at most one byte more than the labels' own text, as bytes: a file of any size or
    encoding costs nothing and breaks nothing, it is simply written over. A named pipe, a
    socket, a device node or a symbolic link at the path is replaced by the rename (a link
    is replaced itself; what it points to is left alone), said in one warning each time one
    is found. A directory cannot be renamed over and may hold someone's files: it is left in
    place and the write fails naming it (the publisher logs it, counts it and reports not
    ready until it is gone).
    """

    def __init__(self, features_dir: str, filename: str = "gpu-topology-agent") -> None:
        if not filename or "/" in filename or filename.startswith("."):
            raise ValueError(f"invalid feature file name {filename!r}")
        self.features_dir = features_dir
        self.filename = filename
        self.path = os.path.join(features_dir, filename)
        self.where = features_dir
        self._written: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we wrote
        self._swept = False  # the temp files of interrupted writes are removed before the first

    def _lstat(self) -> os.stat_result | None:
        try:
            return os.lstat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _identity(self) -> tuple[int, int] | None:
        st = self._lstat()
        return None if st is None else (st.st_dev, st.st_ino)

    def _holds(self, data: bytes) -> bool:
        """True when the path is still the regular file this sink wrote, holding ``data``."""
        st = self._lstat()
        if self._written is None or st is None or not stat.S_ISREG(st.st_mode):
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone, swapped for a link, unreadable: written again
            return False
        try:
            st = os.fstat(fd)  # what was opened, not what lstat saw a moment before
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != self._written:
                return False
            return st.st_size == len(data) and _read_at_most(fd, len(data) + 1) == data
        finally:
            os.close(fd)

    def write(self, labels: Mapping[str, str]) -> bool:
        """Write ``labels`` atomically unless the file already holds exactly them.

        Compares against the file on disk (not a cached copy), so a file deleted, edited or
        replaced by someone else is restored. Raises ``OSError`` when the directory is
        unwritable or a directory stands at the file's path.
        """
        data = format_labels(labels).encode("utf-8")
        if self._holds(data):
            return False
        found = self._lstat()
        if found is not None and stat.S_ISDIR(found.st_mode):
            raise IsADirectoryError(
                errno.EISDIR,
                f"{self.path} is a directory, not a label file: left in place (it may hold someone's"
                " files); remove it",
                self.path,
            )
        os.makedirs(self.features_dir, exist_ok=True)
        if not self._swept:  # before this process writes one: only a killed one's are left
            self._swept = True
            removed = remove_stale_temps(self.features_dir, lambda name: name == self.filename)
            if removed:
                log.info("%s: removed %d temp file(s) of interrupted writes", self.features_dir, removed)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(self.filename), suffix=TEMP_SUFFIX, dir=self.features_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                st = os.fstat(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; NFD may run as another user
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self._written = (st.st_dev, st.st_ino)
        if found is not None and not stat.S_ISREG(found.st_mode):
            log.warning("replaced the %s at %s with the label file", _kind(found.st_mode), self.path)
        log.debug("wrote %d labels to %s", len(labels), self.path)
        return True

    def remove(self) -> None:
        """Delete the file if it is still the one this sink wrote; a file another process
        put there since (another agent, GFD) is left alone."""
        if self._written is None or self._identity() != self._written:
            if self._identity() is not None:
                log.info("left %s in place: another process wrote it", self.path)
            return
        try:
            os.unlink(self.path)
            log.info("removed %s", self.path)
        except FileNotFoundError:
            pass
        self._written = None


def label_sink(config: Config) -> LabelSink:
    """The sink ``config.labels_sink`` names. Raises ConfigError when the NodeFeature sink
    cannot be set up (no node name, namespace or API-server access)."""
    if config.labels_sink == "nodefeature":
        from agent.labels.nodefeature import NodeFeatureSink

        return NodeFeatureSink.from_config(config)
    return FeatureFileSink(config.features_dir, config.feature_file)


def _read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd`` (fewer at its end)."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "named pipe (FIFO)"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device node"
    return "special file"
