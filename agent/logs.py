"""The agent's log lines: text (the default) or one JSON object per line, at the configured
level, on stderr. Set up once at start and again on SIGHUP."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

from agent.config import Config


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (+ exception)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(config: Config, stream: TextIO | None = None) -> None:
    """Replace the root handlers with one writing ``config.log_format`` at ``config.log_level``."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    if config.log_format == "json":
        formatter = JsonFormatter()
        formatter.converter = time.gmtime  # the "Z" in the time field
        handler.setFormatter(formatter)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(config.log_level)
