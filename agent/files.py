"""Files the agent writes for others to read (CDI specs, the claims checkpoint): written
atomically, so a reader sees the old file or the new one, never half of one.

The temp file of ``<dir>/<name>`` is ``<dir>/.<name>.<random>.tmp``: a process killed between
writing it and its rename leaves it behind, so each owner of a directory removes its own at
start (:func:`remove_stale_temps`, by the names of the files it writes there; never another
tool's files in a directory it shares, such as the CDI directory).

A leaf: it imports nothing of the agent.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from typing import Callable

#: The suffix of :func:`write_text_atomic`'s temp files.
TEMP_SUFFIX = ".tmp"
#: The most of a file's name its temp file's name repeats (file names have 255 bytes).
_MAX_TEMP_STEM = 200
#: A temp file's name: a dot, the file's name (older versions: none), a dot, mkstemp's eight
#: random characters, the suffix.
_TEMP_NAME = re.compile(r"\.(?:(.+)\.)?[a-z0-9_]{8}\.tmp\Z")


def temp_prefix(name: str) -> str:
    """The start of the temp file names of a file named ``name``: ``.<name>.``."""
    return f".{name[:_MAX_TEMP_STEM]}."


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
    # file, the leading dot keeps it out of directory listings of the agent's own files, and
    # the target's name in it tells whose it is (remove_stale_temps)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(os.path.basename(path)), suffix=TEMP_SUFFIX, dir=directory)
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


def remove_stale_temps(directory: str, owns: Callable[[str], bool] | None = None) -> int:
    """Remove the temp files killed writes left in ``directory``; the number removed. With
    ``owns``, only those of the files ``owns(name)`` claims (a directory shared with other
    tools); without, every temp file of :func:`write_text_atomic`'s naming, older unnamed ones
    (``.<random>.tmp``) included (a directory the caller alone writes in). Only regular files;
    call it before writing there (at start): a write in flight has a temp file too. A
    directory that is missing or cannot be listed holds none; a file that cannot be removed
    is left."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = _TEMP_NAME.match(name)
        if match is None or (owns is not None and not (match.group(1) and owns(match.group(1)))):
            continue
        path = os.path.join(directory, name)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


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
