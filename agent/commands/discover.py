"""``gpu-topology-agent discover``: print the node's GPU topology.

The table looks like ``nvidia-smi topo -m`` (GPU and NIC rows, CPU/NUMA affinity) followed
by the derived facts; the JSON is DESIGN.md's contract. Both are drawn by :mod:`agent.render`,
which the demo shows too.
"""

from __future__ import annotations

import argparse
import json
import sys

from agent.commands._common import (
    MAX_COLUMNS,
    add_format_flag,
    add_simulate_flag,
    add_wide_flag,
    load_topology,
)
from agent.render import render_table, topology_to_json


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("discover", help="print the GPU topology (NVML, sysfs or a simulation)")
    add_simulate_flag(p)
    add_format_flag(p)
    add_wide_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.simulate == "list":
        from agent.hw.sim.machines import BUILTIN_MACHINES

        print("\n".join(BUILTIN_MACHINES))
        return 0
    topology = load_topology(args.simulate)
    if args.format == "json":
        json.dump(topology_to_json(topology), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_table(topology, None if args.wide else MAX_COLUMNS))
    return 0
