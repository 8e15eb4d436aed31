"""``gpu-topology-agent labels``: print the node labels the agent would publish.

Output: ``key=value`` lines sorted by key, exactly the content of the NFD feature file
(``nvidia.com/gfd.timestamp`` is the time of this run, as in the file it is the time of the
write; ``--no-timestamp`` leaves it out of both), or with ``--format json`` one object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from agent.commands._common import add_simulate_flag, load_topology
from agent.config import Config, default_environ, load_config
from agent.labels import compute_labels, format_labels


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("labels", help="print the node labels (GFD-compatible + topology)")
    add_simulate_flag(p)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="device plugin config file (version: v1), YAML or JSON"
                        " (default: $CONFIG_FILE, else none)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="key=value lines as in the feature file, or one JSON object (default: text)")
    p.add_argument("--no-timestamp", action="store_true", dest="no_timestamp", default=None,
                   help="leave out the nvidia.com/gfd.timestamp label (default: include it;"
                        " env GFD_NO_TIMESTAMP)")
    p.set_defaults(func=run)


def load_effective_config(config_file: str | None, flags: dict[str, object] | None = None) -> Config:
    """The agent's configuration from ``config_file`` + environment (+ ``flags``), as ``run``
    reads it."""
    return load_config(config_file, dict(default_environ()), flags or {})


def run(args: argparse.Namespace) -> int:
    if args.simulate == "list":
        from agent.hw.sim.machines import BUILTIN_MACHINES

        print("\n".join(BUILTIN_MACHINES))
        return 0
    config = load_effective_config(args.config, {"no_timestamp": args.no_timestamp})
    topology = load_topology(args.simulate)
    labels = compute_labels(topology, config, time.time())
    if args.format == "json":
        json.dump(labels, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_labels(labels))
    return 0
