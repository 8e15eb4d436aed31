"""Where labels go. A sink is the only I/O of the labels feature.

:class:`FeatureFileSink` writes Node Feature Discovery's *local* source format: one file in
``features.d`` holding ``key=value`` lines, which NFD's worker turns into node labels. NFD
may read the directory at any moment, so the file is written to a dot-file in the same
directory (NFD skips dot-files) and renamed over the old one: readers see the old or the
new content, never half a file.

:func:`label_sink` picks the sink ``--labels-sink`` names: this one, or
:class:`agent.labels.nodefeature.NodeFeatureSink` (NFD's NodeFeature API).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Mapping, Protocol

from agent.config import Config
from agent.labels import format_labels

log = logging.getLogger(__name__)


class LabelSink(Protocol):
    """Destination for node labels."""

    #: where the labels go, for log lines (a directory, an object's kind and name)
    where: str

    def write(self, labels: Mapping[str, str]) -> bool:
        """Publish ``labels`` (the complete set); True if what was published changed."""
        ...

    def remove(self) -> None:
        """Withdraw the labels (clean shutdown). No error if nothing was written."""
        ...


class FeatureFileSink:
    """NFD feature file ``<features_dir>/<filename>``; rewritten only when labels change."""

    def __init__(self, features_dir: str, filename: str = "gpu-topology-agent") -> None:
        if not filename or "/" in filename or filename.startswith("."):
            raise ValueError(f"invalid feature file name {filename!r}")
        self.features_dir = features_dir
        self.filename = filename
        self.path = os.path.join(features_dir, filename)
        self.where = features_dir
        self._written: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we wrote

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _current(self) -> str | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, labels: Mapping[str, str]) -> bool:
        """Write ``labels`` atomically unless the file already holds exactly them.

        Compares against the file on disk (not a cached copy), so a file deleted or edited
        by someone else is restored. Raises ``OSError`` when the directory is unwritable.
        """
        text = format_labels(labels)
        if self._current() == text and self._identity() == self._written:
            return False
        os.makedirs(self.features_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.filename}.", dir=self.features_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; NFD may run as another user
            os.replace(tmp, self.path)
            self._written = self._identity()
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        log.info("wrote %d labels to %s", len(labels), self.path)
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
