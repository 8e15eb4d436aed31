"""Files the agent writes for others to read (CDI specs, the claims checkpoint): written
atomically, so a reader sees the old file or the new one, never half of one.

A leaf: it imports nothing of the agent.
"""

from __future__ import annotations

import json
import os
import tempfile


def write_json_atomic(path: str, data: object, *, fsync: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` so that readers see the old file or the new one,
    never a partial one (temp file in the same directory, rename). ``fsync`` also makes it
    durable against a power loss before the rename."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    # the ".tmp" suffix keeps a container runtime, which reads *.json, off the half-written file
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=False)
            fh.write("\n")
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_file(path: str) -> bool:
    """Remove ``path``; False when there was none (OSError for any other failure)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
