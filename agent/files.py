"""Files the agent writes for others to read (CDI specs, the claims checkpoint): written
atomically, so a reader sees the old file or the new one, never half of one.

A leaf: it imports nothing of the agent.
"""

from __future__ import annotations

import json
import os
import tempfile


def write_json_atomic(path: str, data: object, *, fsync: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n", fsync=fsync)


def write_text_atomic(path: str, text: str, *, fsync: bool = True) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never a
    partial one (temp file in the same directory, rename), creating the directory when it is
    missing. ``fsync`` also makes it durable against a power loss before the rename; a file
    the agent writes again anyway (a container's NCCL topology file) can go without."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    # the ".tmp" suffix keeps a container runtime, which reads *.json, off the half-written
    # file, and the leading dot keeps it out of directory listings of the agent's own files
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
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


def nearest_existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists (a link counts, dangling or not): where a
    directory that is still to be made would be made."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def remove_file(path: str) -> bool:
    """Remove ``path``; False when there was none (OSError for any other failure)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
