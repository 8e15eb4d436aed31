"""``gpu-topology-agent slices``: print the node's ResourceSlice objects as YAML.

Exactly the objects the DRA publisher sends (``agent.dra.slices.render_slices``), for pool
generation 1; the publisher adds the Node owner reference once it has read the Node's UID from
the API server. With ``--api-version v1`` (the default) that is the counter slice, the single
GPUs and the GPU-set devices; ``v1beta2`` and ``v1beta1`` have no partitionable devices, so
they render the single GPUs only, and the command says so on stderr. In ``v1`` it notes on
stderr that a cluster whose API server drops the counter fields (``DRAPartitionableDevices``
off) gets the single GPUs only from the agent, which logs it and reports it as
``gpu_agent_dra_api_feature{feature="DRAPartitionableDevices"} 0``. Pipe into
``kubectl apply --dry-run=server -f -`` to check them against a cluster.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys

from agent.commands._common import add_simulate_flag, load_topology
from agent.config import default_environ, load_config
from agent.errors import UsageError

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent.dra.slices import API_VERSIONS

    p = sub.add_parser("slices", help="print the DRA ResourceSlices the agent would publish (YAML)")
    add_simulate_flag(p)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="agent config file, as for `run`; the DRA driver name and the sharing settings come"
                        " from it (default: none, the built-in defaults)")
    p.add_argument("--node-name", metavar="NAME", dest="node_name", default=None,
                   help="node (and pool) name (default: $NODE_NAME, else the host name)")
    p.add_argument("--api-version", dest="api_version", default="v1", metavar="VERSION",
                   help=f"resource.k8s.io version to render: {' | '.join(API_VERSIONS)} (default: v1;"
                        " GPU sets only in v1)")
    p.set_defaults(func=run)


def check_node_name(name: str) -> str:
    """A Kubernetes node name (a DNS subdomain, at most 253 characters) or UsageError."""
    if not name or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise UsageError(
            f"--node-name {name!r}: expected a Kubernetes node name (lowercase letters, digits, "
            "'-' and '.', at most 253 characters)"
        )
    return name


def run(args: argparse.Namespace) -> int:
    from agent.dra.slices import API_VERSIONS, SETS_API_VERSIONS, dump_yaml, render_slices

    if args.simulate == "list":
        from agent.hw.sim.machines import BUILTIN_MACHINES

        print("\n".join(BUILTIN_MACHINES))
        return 0
    if args.api_version not in API_VERSIONS:
        raise UsageError(f"--api-version {args.api_version!r}: expected one of {', '.join(API_VERSIONS)}")
    config = load_config(args.config, dict(default_environ()), {})
    node = check_node_name(args.node_name or config.node_name or socket.gethostname().lower())
    topology = load_topology(args.simulate)
    slices = render_slices(topology, node_name=node, driver=config.driver_name,
                           api_version=args.api_version)
    sys.stdout.write(dump_yaml(slices))
    if args.api_version not in SETS_API_VERSIONS:
        print(f"note: resource.k8s.io/{args.api_version} has no partitionable devices: single GPUs "
              f"only, no GPU sets (they need {' or '.join(SETS_API_VERSIONS)})", file=sys.stderr)
    elif any("sharedCounters" in s["spec"] for s in slices):
        print("note: the GPU sets and their counters need an API server that keeps partitionable devices"
              " (feature gate DRAPartitionableDevices); where it drops them on write, the agent publishes"
              " the single GPUs only, says so once in its log and sets"
              ' gpu_agent_dra_api_feature{feature="DRAPartitionableDevices"} to 0', file=sys.stderr)
    return 0
