"""Helpers shared by the one-shot subcommands (discover, allocate, labels)."""

from __future__ import annotations

import argparse

from agent.topology.model import Topology


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


def load_topology(simulate: str | None) -> Topology:
    """The topology of a simulated machine, or of this node through NVML + /sys."""
    if simulate:
        from agent.hw.machines import load_topology as load_simulated

        return load_simulated(simulate)
    from agent.hw.nvml import NvmlBackend
    from agent.hw.sysfs import SysfsReader

    backend = NvmlBackend(sysfs=SysfsReader("/sys"))
    backend.init()
    try:
        return backend.read_topology()
    finally:
        backend.shutdown()
