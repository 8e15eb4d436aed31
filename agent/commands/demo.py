"""``gpu-topology-agent demo [--simulate MACHINE] [--format table|json]``.

Runs the real agent (device-plugin servers, labels, metrics) on a simulated machine against
an in-process stand-in kubelet and tells what happens; see :mod:`agent.demo.story`.
"""

from __future__ import annotations

import argparse

from agent.commands._common import STDIN_LABEL, add_format_flag, add_simulate_flag, friendly_paths

DEFAULT_MACHINE = "dgx-h100"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the agent on a simulated machine against a stand-in kubelet and show the story",
        description=(
            "Run the real agent on a simulated machine against an in-process stand-in kubelet: "
            "topology, labels, a busy node's allocations (ours vs NVIDIA's go-gpuallocator, "
            "vs naive, the lowest free indices) and a "
            "/metrics excerpt with pod attribution. Everything lives in a temporary directory."
        ),
    )
    add_simulate_flag(p, default=DEFAULT_MACHINE)
    add_format_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.demo.story import run_demo
    from agent.discovery import load_spec

    load_spec(args.simulate)  # a bad machine name or file: one clear line, exit 2, before anything starts
    label = "-" if friendly_paths(args.simulate) == STDIN_LABEL else args.simulate
    return run_demo(args.simulate, args.format, label=label)
