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

``--in-use LIST`` renders what the agent publishes while prepared claims hold those devices
(GPU indices or UUIDs, MIG UUIDs, or DRA device names such as ``gpu-3`` and ``gpuset-4-mf``;
as a freshly started agent would, with nothing published before): the single GPUs and the
sets then follow the device plugin's choices on the free GPUs (:mod:`agent.dra.gpusets`); a GPU
held through a set has no single device then (the agent withdraws one it had published after
``dra.gpuSetWithdrawalGraceSeconds``; with 0 it keeps it).
``--server-version 1.36|1.37|...`` says which Kubernetes the API server runs (default: the
newest the agent knows); with the config's ``dra.gpuSets: auto`` it decides whether sets are
published, as the agent does, and the decision is said on stderr. A bad list or version
exits 2 with one line.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from typing import Any

from agent.commands._common import add_simulate_flag, load_topology, parse_list
from agent.config import default_environ, load_config
from agent.errors import UsageError
from agent.topology.model import Topology

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
    p.add_argument("--in-use", dest="in_use", default="", metavar="LIST",
                   help="devices prepared claims hold: GPU indices or UUIDs, MIG UUIDs or DRA device names"
                        " (gpu-3, gpuset-4-mf), comma-separated (default: none)")
    p.add_argument("--server-version", dest="server_version", default=None, metavar="MAJOR.MINOR",
                   help="the API server's Kubernetes version, e.g. 1.36 (default: the newest the agent knows,"
                        " 1.37); with dra.gpuSets auto it decides whether GPU sets are published")
    p.add_argument("--dynamic-mig", choices=("off", "on"), nargs="?", const="on", dest="dynamic_mig", default=None,
                   help="publish MIG profiles on placements of MIG-capable GPUs as devices (v1 only;"
                        " docs/dra/mig.md); --dynamic-mig alone is on (default: the config's dra.dynamicMig, off)")
    p.add_argument("--mig-placements-per-profile", metavar="N", dest="mig_placements_per_profile", default=None,
                   help="with --dynamic-mig, the placements of each profile published (default: the config's"
                        " dra.migPlacementsPerProfile, 1)")
    p.set_defaults(func=run)


def check_node_name(name: str) -> str:
    """A Kubernetes node name (a DNS subdomain, at most 253 characters) or UsageError."""
    if not name or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise UsageError(
            f"--node-name {name!r}: expected a Kubernetes node name (lowercase letters, digits, "
            "'-' and '.', at most 253 characters)"
        )
    return name


def parse_server_version(text: str) -> tuple[int, int]:
    """``1.36``, ``v1.37``, ``1.37.2`` -> (1, 37); UsageError otherwise."""
    found = re.match(r"^v?(\d{1,3})\.(\d{1,3})(?:\.\d{1,5})?$", text.strip())
    if not found:
        raise UsageError(f"--server-version {text!r}: expected a Kubernetes version such as 1.36 or 1.37")
    return int(found.group(1)), int(found.group(2))


def parse_in_use(text: str, topology: Topology, dynamic_mig: bool = False) -> dict[str, tuple[int, ...]]:
    """``--in-use``: device name -> its GPU indices, each GPU held once (or by MIG devices on
    placements that do not overlap); UsageError naming the first item that is none of this
    machine's GPUs or devices, or a device given twice (the list rule ``allocate --available``
    follows too). With ``dynamic_mig``, dynamic MIG device names (``gpu-0-mig-3g40gb-4``) too,
    and a MIG instance's UUID on a GPU offering them stands for its slot device (a claim holds it);
    the other instances there are made by hand (their slices taken, :mod:`agent.dra.migslots`)."""
    from agent.dra.devices import (
        DeviceRefs,
        device_name,
        gpus_of,
        mig_slot_name,
        parse_mig_slot_name,
    )
    from agent.dra.migslots import dynamic_gpus, resolve_slot

    geometries = dynamic_gpus(topology) if dynamic_mig else {}

    refs = DeviceRefs(topology, geometries)
    migs = {m.uuid: (g, m) for g in topology.gpus for m in g.mig_devices}

    def resolve(item: str) -> list[str]:
        gpu = topology.gpu_by_uuid(item) or (topology.gpus[int(item)] if item.isdigit()
                                            and int(item) < topology.gpu_count else None)
        if gpu is not None:
            return [device_name(gpu)]
        if item in migs:
            g, m = migs[item]
            if g.index in geometries and m.placement is not None:  # an instance held as its slot device
                return [mig_slot_name(g.index, m.profile, m.placement.start)]
            return [device_name(g, m)]
        if item in refs or resolve_slot(item, geometries) is not None:
            return [item]
        if parse_mig_slot_name(item) is not None:
            raise UsageError(f"--in-use: {item!r} is no placement this machine offers"
                             + ("" if dynamic_mig else " (dynamic MIG devices need --dynamic-mig)"))
        raise UsageError(f"--in-use: {item!r} is none of this machine's GPUs (indices 0-{topology.gpu_count - 1},"
                         " GPU or MIG UUIDs) or DRA devices (gpu-3, gpuset-4-mf, gpu-0-mig-3g40gb-4)")

    held: dict[str, tuple[int, ...]] = {}
    for name in parse_list(text, "--in-use", "device", resolve):
        slot = resolve_slot(name, geometries)
        held[name] = (slot.gpu,) if slot is not None else gpus_of(refs, name)
    _check_overlaps(held, refs, geometries)
    return held


def _check_overlaps(held: dict[str, tuple[int, ...]], refs: Any, geometries: Any) -> None:
    """UsageError for two held devices sharing a GPU, but MIG devices on disjoint slices."""
    from agent.dra.migslots import resolve_slot

    owner: dict[int, str] = {}
    slices: dict[int, dict[int, str]] = {}
    for name, gpus in held.items():
        slot = resolve_slot(name, geometries)
        if slot is not None:
            mine = slices.setdefault(slot.gpu, {})
            for i in slot.placement.slices:
                if mine.setdefault(i, name) != name:
                    raise UsageError(f"--in-use: {name} and {mine[i]} overlap on memory slice {i} of GPU {slot.gpu}")
            if slot.gpu in owner:
                raise UsageError(f"--in-use: GPU {slot.gpu} is held twice ({owner[slot.gpu]}, {name})")
            continue
        whole = all(p.mig is None for p in refs[name].parts)  # MIG devices of one GPU: several claims
        for g in gpus if whole else ():
            if owner.setdefault(g, name) != name or g in slices:
                other = owner[g] if owner[g] != name else next(iter(slices[g].values()))
                raise UsageError(f"--in-use: GPU {g} is held twice ({other}, {name}): no two claims hold one GPU")


def run(args: argparse.Namespace) -> int:
    from agent.dra.gpusets import NEWEST_KNOWN, gpu_sets_decision
    from agent.dra.slices import (
        API_VERSIONS,
        SETS_API_VERSIONS,
        Occupancy,
        render_slices,
    )
    from agent.dra.yaml_stream import dump_yaml

    if args.simulate == "list":
        from agent.hw.sim.machines import BUILTIN_MACHINES

        print("\n".join(BUILTIN_MACHINES))
        return 0
    if args.api_version not in API_VERSIONS:
        raise UsageError(f"--api-version {args.api_version!r}: expected one of {', '.join(API_VERSIONS)}")
    server = parse_server_version(args.server_version) if args.server_version is not None else NEWEST_KNOWN
    flags = {"dynamic_mig": args.dynamic_mig, "mig_placements_per_profile": args.mig_placements_per_profile}
    config = load_config(args.config, dict(default_environ()), flags)
    node = check_node_name(args.node_name or config.node_name or socket.gethostname().lower())
    topology = load_topology(args.simulate)
    dynamic_mig = config.dynamic_mig == "on"
    held = parse_in_use(args.in_use, topology, dynamic_mig)
    with_sets, why = gpu_sets_decision(config.gpu_sets, server)
    # as a freshly started agent renders: nothing in its pool yet, so (with a grace) a GPU held
    # through a set has no single device to withdraw and gets none
    fresh = () if config.gpu_set_withdrawal_grace_s > 0 else None
    slices = render_slices(topology, node_name=node, driver=config.driver_name, api_version=args.api_version,
                           occupancy=Occupancy(held, (), fresh, (), fresh), with_sets=with_sets,
                           dynamic_mig=dynamic_mig, mig_placements=config.mig_placements_per_profile)
    sys.stdout.write(dump_yaml(slices))
    if dynamic_mig:
        _say_dynamic_mig(topology, args.api_version)
    if args.api_version in SETS_API_VERSIONS and topology.gpu_count >= 2:
        print(f"note: GPU sets {'published' if with_sets else 'not published'}: {why}", file=sys.stderr)
    if args.api_version not in SETS_API_VERSIONS:
        print(f"note: resource.k8s.io/{args.api_version} has no partitionable devices: single GPUs "
              f"only, no GPU sets (they need {' or '.join(SETS_API_VERSIONS)})", file=sys.stderr)
    elif any("sharedCounters" in s["spec"] for s in slices):
        print("note: the GPU sets and their counters need an API server that keeps partitionable devices"
              " (feature gate DRAPartitionableDevices); where it drops them on write, the agent publishes"
              " the single GPUs only, says so once in its log and sets"
              ' gpu_agent_dra_api_feature{feature="DRAPartitionableDevices"} to 0', file=sys.stderr)
    return 0


def _say_dynamic_mig(topology: Topology, api_version: str) -> None:
    """Which GPUs offer MIG placements, on stderr."""
    from agent.dra.migslots import dynamic_gpus
    from agent.dra.slices import SETS_API_VERSIONS

    if api_version not in SETS_API_VERSIONS:
        print(f"note: dynamic MIG not published: resource.k8s.io/{api_version} has no partitionable devices",
              file=sys.stderr)
        return
    offering = sorted(dynamic_gpus(topology))
    print(f"note: dynamic MIG: GPUs {offering or 'none'} offer MIG placements (known MIG geometry; Hopper and"
          " newer, or MIG mode already on)", file=sys.stderr)
