"""``gpu-topology-agent labels``: print the node labels the agent would publish.

Output: ``key=value`` lines sorted by key, exactly the content of the NFD feature file.
"""

from __future__ import annotations

import argparse
import os
import sys

from agent.commands._common import add_simulate_flag, load_topology
from agent.config import Config, load_config
from agent.labels import compute_labels, format_labels


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("labels", help="print the node labels (GFD-compatible + topology)")
    add_simulate_flag(p)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="device plugin config file (version: v1), YAML or JSON")
    p.set_defaults(func=run)


def load_effective_config(config_file: str | None) -> Config:
    """The agent's configuration from ``config_file`` + environment, as ``run`` reads it."""
    return load_config(config_file, dict(os.environ), {})


def run(args: argparse.Namespace) -> int:
    if args.simulate == "list":
        from agent.hw.sim.machines import BUILTIN_MACHINES

        print("\n".join(BUILTIN_MACHINES))
        return 0
    config = load_effective_config(args.config)
    topology = load_topology(args.simulate)
    sys.stdout.write(format_labels(compute_labels(topology, config)))
    return 0
