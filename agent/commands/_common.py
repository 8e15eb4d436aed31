"""Helpers shared by the subcommands: the ``--simulate`` and ``--format`` flags, standard
input as a machine (``--simulate -``), comma-separated device lists and the width rule for
terminal output."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from typing import Callable, Iterable

from agent.discovery import load_topology
from agent.errors import InputFormatError, UsageError
from agent.formats import decode_text

__all__ = [
    "MAX_COLUMNS",
    "STDIN_LABEL",
    "add_format_flag",
    "add_simulate_flag",
    "friendly_paths",
    "load_topology",
    "parse_list",
    "simulate_value",
]

#: Terminal output is laid out to fit this many columns unless ``--wide`` is given.
MAX_COLUMNS = 100
#: How error messages name standard input read with ``--simulate -``.
STDIN_LABEL = "<stdin>"

# temp file holding standard input -> how messages should name it
_STDIN_PATHS: dict[str, str] = {}


def friendly_paths(message: str) -> str:
    """``message`` with the temp file that holds standard input named ``<stdin>``."""
    for path, label in _STDIN_PATHS.items():
        message = message.replace(f"topo-matrix:{path}", label).replace(path, label)
    return message


def _read_stdin_machine() -> str:
    """Standard input saved to a temp file (removed at exit), read once: the spec or pasted
    ``nvidia-smi topo -m`` that ``--simulate -`` names."""
    stream = getattr(sys.stdin, "buffer", None)
    raw = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    if not raw.strip():
        raise InputFormatError(
            "--simulate -: standard input is empty; expected a machine spec (YAML/JSON) or "
            "`nvidia-smi topo -m` output, e.g. `nvidia-smi topo -m | gpu-topology-agent "
            "discover --simulate -`"
        )
    decode_text(raw, "--simulate -", "standard input", "convert it to UTF-8 (e.g. iconv -t UTF-8)")
    folder = tempfile.mkdtemp(prefix="gta-stdin-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "stdin")
    with open(path, "wb") as fh:
        fh.write(raw)
    _STDIN_PATHS[path] = STDIN_LABEL
    return path


def simulate_value(value: str) -> str:
    """argparse ``type`` of ``--simulate``: rejects an empty value (it would otherwise mean
    "use NVML"); ``-`` reads standard input once, here, at start."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            "expected a built-in machine name (see `discover --simulate list`), a spec or "
            "`nvidia-smi topo -m` file, or - for standard input; got an empty value"
        )
    if value == "-":
        try:
            return _read_stdin_machine()
        except InputFormatError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("--simulate -: ")) from None
    return value


def add_simulate_flag(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument(
        "--simulate",
        metavar="MACHINE",
        default=default,
        type=simulate_value,
        help=(
            "run on a simulated machine instead of NVML: a built-in name (see `discover "
            "--simulate list`), a machine spec file (YAML/JSON), a file holding "
            "`nvidia-smi topo -m` output, or - to read either from standard input"
            + (f" (default: {default})" if default else " (default: the real GPUs via NVML)")
        ),
    )


def add_format_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format", choices=("table", "json"), default="table", help="output format (default: table)"
    )


def add_wide_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wide",
        action="store_true",
        help=f"do not fit the table to {MAX_COLUMNS} columns (default: fit)",
    )


def parse_list(text: str, flag: str, noun: str, resolve: Callable[[str], Iterable[str]],
               twice_label: str | None = None) -> dict[str, str]:
    """``flag``'s comma-separated ``text`` (``allocate --available``, ``slices --in-use``), each
    item resolved (``resolve``: an item -> the ``noun``s it names, or UsageError) -> each one
    named -> the item that named it, in order. UsageError for an empty item, or one named
    twice: by one item given twice, or by two that name it alike (``1`` and GPU 1's UUID).
    An empty ``text`` names nothing. ``twice_label`` (default ``flag``) starts the message of
    one named twice: ``allocate`` gives the device plugin's list name, so that the message is
    the one GetPreferredAllocation answers for the same list."""
    named: dict[str, str] = {}
    if not text.strip():
        return named
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise UsageError(f"{flag}: empty item in {text!r}")
        for thing in resolve(item):
            if thing in named:
                first = named[thing]
                raise UsageError(f"{twice_label or flag}: {noun} {thing!r} given twice"
                                 + ("" if first == item else f" ({first!r}, {item!r})"))
            named[thing] = item
    return named
