"""Helpers shared by the one-shot subcommands (discover, allocate, labels)."""

from __future__ import annotations

import argparse

from agent.discovery import load_topology

__all__ = ["add_format_flag", "add_simulate_flag", "load_topology"]


def add_simulate_flag(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument(
        "--simulate",
        metavar="MACHINE",
        default=default,
        help=(
            "run on a simulated machine instead of NVML: a built-in name (see `discover "
            "--simulate list`), a machine spec file (YAML/JSON) or a file holding "
            "`nvidia-smi topo -m` output"
            + (f" (default: {default})" if default else " (default: the real GPUs via NVML)")
        ),
    )


def add_format_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format", choices=("table", "json"), default="table", help="output format (default: table)"
    )
