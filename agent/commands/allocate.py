"""``gpu-topology-agent allocate``: which GPUs the agent would give a container.

``--size K [--available LIST] [--must-include LIST] [--simulate MACHINE]
[--format table|json] [--explain]``. LIST is comma-separated GPU indices or UUIDs (mixed is
fine); ``--available`` defaults to every GPU that is not lost. Without ``--simulate`` the
command asks this node's GPUs through NVML, as every subcommand does. JSON output is
``{"devices": [...uuids...], "indices": [...], "score": N}`` (plus ``"explanation"`` and
``"nccl"`` with ``--explain``: the nearest NICs and the NCCL topology file Allocate would
mount, with its text).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace
from typing import Any

from agent.commands._common import (
    MAX_COLUMNS,
    add_format_flag,
    add_simulate_flag,
    add_wide_flag,
    load_topology,
    parse_list,
)
from agent.commands.allocate_mig import run_mig
from agent.config import Config, TimeSlicingResource, default_environ, load_config
from agent.config_values import MIG_STRATEGIES
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.resources import PluginResource, ResourceKind, build_resources
from agent.errors import UsageError
from agent.formats import GPU_RESOURCE
from agent.nccl.container_file import nccl_topology_xml, nearest_nics
from agent.nccl.host_dir import NcclFiles, allocation_key
from agent.records import REPLICA_POLICIES
from agent.topology.allocator import CRITERIA, Explanation
from agent.topology.model import Topology


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("allocate", help="show the preferred allocation for a request")
    p.add_argument(
        "--size", type=int, default=None, metavar="K",
        help="number of devices to allocate (no default: required unless --mig-profile is given)",
    )
    _add_mig_flags(p)
    p.add_argument(
        "--available",
        metavar="LIST",
        default=None,
        help="comma-separated GPU indices or UUIDs that are free (default: all)",
    )
    p.add_argument(
        "--must-include",
        metavar="LIST",
        default="",
        help="comma-separated GPU indices or UUIDs the answer must contain (default: none)",
    )
    add_simulate_flag(p)
    add_format_flag(p)
    p.add_argument(
        "--config", metavar="FILE", default=None,
        help="device plugin config file (version: v1): MIG strategy and time-slicing as the"
             " running agent reads them (default: $CONFIG_FILE, else none)",
    )
    p.add_argument(
        "--mig-strategy", choices=MIG_STRATEGIES, dest="mig_strategy", default=None,
        help="how MIG devices are advertised; overrides the config (default: none)",
    )
    p.add_argument(
        "--replicas", type=int, metavar="N", default=None,
        help="share every GPU as N replicas (sharing.timeSlicing, or sharing.mps with --sharing mps,"
             " for nvidia.com/gpu; overrides the config's sharing) (default: no sharing)",
    )
    p.add_argument(
        "--sharing", choices=("time-slicing", "mps"), default=None,
        help="how --replicas shares the GPUs (default: time-slicing)",
    )
    p.add_argument(
        "--shared-devices-allocation-policy", choices=REPLICA_POLICIES,
        dest="shared_devices_allocation_policy", default=None,
        help="how replicas are spread over GPUs (default: distributed)",
    )
    p.add_argument(
        "--resource", metavar="NAME", default=None,
        help="the extended resource to allocate from, e.g. nvidia.com/mig-1g.10gb"
             " (default: the node's only resource, else nvidia.com/gpu)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="also show the runners-up and the criterion that separated them, the nearest NICs and"
             " the NCCL topology file Allocate would mount (default: off)",
    )
    add_wide_flag(p)
    p.set_defaults(func=run)


def _add_mig_flags(p: argparse.ArgumentParser) -> None:
    """Dynamic MIG's question (:mod:`agent.commands.allocate_mig`)."""
    p.add_argument(
        "--mig-profile", dest="mig_profile", metavar="PROFILE", default=None,
        help="explain where dynamic MIG would cut one MIG device of PROFILE (e.g. 3g.40gb) for the"
             " devices --in-use holds (docs/dra/mig.md) (default: whole GPUs)",
    )
    p.add_argument(
        "--in-use", dest="in_use", metavar="LIST", default="",
        help="with --mig-profile: devices prepared claims hold, as `slices --in-use` takes them"
             " (gpu-0-mig-3g40gb-4, gpu-2, gpuset-2-m30) (default: none)",
    )


def _gpu_index(item: str, topology: Topology, flag: str) -> int | None:
    """The GPU an item names by index or UUID, None when it names none of them; UsageError for
    an index outside the machine."""
    if item.isdigit() or (item[0] in "+-" and item[1:].isdigit()):
        index = int(item)
        if not 0 <= index < topology.gpu_count:
            raise UsageError(
                f"{flag}: {item} is not a GPU of this machine: expected GPU indices "
                f"0-{topology.gpu_count - 1} or GPU UUIDs"
            )
        return index
    gpu = topology.gpu_by_uuid(item)
    return None if gpu is None else gpu.index


def explanation_to_json(e: Explanation) -> dict[str, Any]:
    def cand(c: Any) -> dict[str, Any]:
        return {
            "indices": list(c.indices),
            "gpuallocator_criterion": c.gpuallocator_score,
            "score": c.score,
            "numa_nodes": c.numa_nodes,
            "cut": c.cut,
        }

    return {
        "chosen": cand(e.chosen),
        "runners_up": [{**cand(c), "lost_on": CRITERIA[i]} for c, i in e.runners_up],
        "exact": e.exact,
        "engine": e.implementation,
    }


def effective_config(args: argparse.Namespace) -> Config:
    """The configuration the running agent would have with ``--config`` and these flags."""
    if args.sharing is not None and args.replicas is None:
        raise UsageError("--sharing: says how --replicas shares the GPUs; give --replicas N too")
    least = 2 if args.sharing == "mps" else 1
    if args.replicas is not None and args.replicas < least:
        raise UsageError(
            f"--replicas: expected a whole number of at least {least}{' with --sharing mps' if least > 1 else ''},"
            f" got {args.replicas}"
        )
    flags = {
        "mig_strategy": args.mig_strategy,
        "shared_devices_allocation_policy": args.shared_devices_allocation_policy,
    }
    config = load_config(args.config, dict(default_environ()), flags)
    if args.replicas is not None:
        shared = (TimeSlicingResource(replicas=args.replicas),)
        if args.sharing == "mps":
            # what a file's sharing.mps gives: no time-slicing, one replica per request
            config = replace(config, mps=shared, time_slicing=(), fail_requests_greater_than_one=True)
        else:
            config = replace(config, time_slicing=shared, mps=())
    return config


def _pick_resource(resources: tuple[PluginResource, ...], name: str | None) -> PluginResource:
    names = [r.name for r in resources]
    if name is None:
        if len(resources) == 1:
            return resources[0]
        for r in resources:
            if r.name == GPU_RESOURCE:
                return r
        raise UsageError(f"this node serves several resources ({', '.join(names)}); pick one with --resource")
    for r in resources:
        if r.name == name:
            return r
    raise UsageError(
        f"--resource: no {name!r} on this node with this configuration"
        f" (it serves {', '.join(names) or 'nothing'})"
    )


def parse_device_list(text: str, topology: Topology, resource: PluginResource, flag: str,
                      whole_gpus: bool) -> list[str]:
    """``"0,GPU-ab..,MIG-..,GPU-cd..::1"`` -> device IDs. A GPU index or UUID stands for every
    device of the resource on that GPU when ``whole_gpus`` (--available), else only where
    that GPU has exactly one device (--must-include); any other item is taken as a device ID,
    which the request's one check (the device plugin's) accepts or names."""

    def resolve(item: str) -> list[str]:
        index = None if item in resource.by_id else _gpu_index(item, topology, flag)
        if index is None:
            return [item]
        on_gpu = [d.id for d in resource.devices if d.gpu_index == index]
        if not on_gpu:
            raise UsageError(
                f"{flag}: GPU {item} has no {resource.name} device with this configuration"
                f" (MIG-enabled GPUs are served as MIG devices)"
            )
        if not whole_gpus and len(on_gpu) > 1:
            raise UsageError(
                f"{flag}: GPU {item} has {len(on_gpu)} {resource.name} devices; name the device"
                f" IDs (e.g. {on_gpu[0]})"
            )
        return on_gpu

    return list(parse_list(text, flag, "device ID", resolve, twice_label=flag.removeprefix("--")))


def run(args: argparse.Namespace) -> int:
    """The running device plugin's own answer: its request handler checks the request (the
    same messages as over gRPC) and asks its engine."""
    if args.size is None and args.mig_profile is None:
        raise UsageError("--size K is required (or --mig-profile PROFILE)")
    topology = load_topology(args.simulate)
    if topology.gpu_count == 0:
        raise UsageError("this machine has no GPUs")
    if args.mig_profile is not None:
        return run_mig(args, topology)
    if args.in_use:
        raise UsageError("--in-use goes with --mig-profile; whole GPUs take --available")
    config = effective_config(args)
    resource = _pick_resource(build_resources(topology, config), args.resource)
    if args.explain and resource.kind is not ResourceKind.GPU:
        raise UsageError(
            f"--explain explains whole-GPU allocations; {resource.name} holds {resource.kind.value} devices")
    if args.available is None:
        available = [d.id for d in resource.devices if not topology.gpus[d.gpu_index].lost]
    else:
        available = parse_device_list(args.available, topology, resource, "--available", whole_gpus=True)
    must_include = parse_device_list(args.must_include, topology, resource, "--must-include", whole_gpus=False)
    handler = RequestHandler(resource, topology, config)
    request = handler.request(available, must_include, args.size)
    devices = handler.answer(request)
    indices = [resource.by_id[d].gpu_index for d in devices]
    if resource.kind is not ResourceKind.GPU:
        return _print_devices(args, topology, handler, devices, indices, len(available), must_include)
    explanation = handler.engine.explain(handler.table, request) if args.explain else None
    score = topology.set_score(indices)
    nccl = _nccl_plan(topology, config, resource.name, devices, indices) if args.explain else None
    if args.format == "json":
        doc: dict[str, Any] = {"devices": devices, "indices": indices, "score": score}
        if explanation is not None:
            doc["explanation"] = explanation_to_json(explanation)
            doc["nccl"] = nccl
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    requested = [resource.by_id[d].gpu_index for d in available]
    must = [resource.by_id[d].gpu_index for d in must_include]
    best = handler.engine.best_score_for_size(args.size)
    lines = [
        f"machine   {topology.machine or topology.source or '-'}",
        f"request   size {args.size}, available {requested}, must-include {must}",
        f"indices   {indices}",
        f"devices   {', '.join(devices)}",
        f"score     {score} (best possible for {args.size} GPUs on this machine: {best})",
    ]
    if explanation is not None and nccl is not None:
        lines.append(f"nics      {', '.join(nccl['nics']) or 'none known near these GPUs'}")
        if nccl["file"]:
            lines.append(f"nccl      {nccl['file']} mounted read-only at {nccl['mount_path']} (NCCL_TOPO_FILE)")
        else:
            lines.append("nccl      no file (nccl.topologyFile: off)")
        lines.append("")
        lines.extend(explanation.lines())
    _write(args, lines)
    return 0


def _nccl_plan(topology: Topology, config: Config, resource: str, devices: list[str],
               indices: list[int]) -> dict[str, Any]:
    """What Allocate would hand NCCL for these devices: the nearest NICs, the host file
    (named by the allocation) and where it is mounted, and its text; nothing is written."""
    nics = nearest_nics(topology, indices)
    files = NcclFiles.from_config(config)
    return {
        "nics": [n.name for n in nics],
        "file": files.path(allocation_key(resource, devices)) if files is not None else None,
        "mount_path": config.nccl_mount_path if files is not None else None,
        "topology": nccl_topology_xml(topology, indices, nics, files.node_file) if files is not None else None,
    }


def _write(args: argparse.Namespace, lines: list[str]) -> None:
    if not args.wide:
        lines = [
            part
            for line in lines
            for part in (textwrap.wrap(line, MAX_COLUMNS, subsequent_indent=" " * 10,
                                       break_on_hyphens=False) or [""])
        ]
    sys.stdout.write("\n".join(lines) + "\n")


def _print_devices(args: argparse.Namespace, topology: Topology, handler: RequestHandler,
                   devices: list[str], indices: list[int], n_available: int,
                   must_include: list[str]) -> int:
    """MIG devices and replicas (time-sliced, or MPS with what the container gets)."""
    resource = handler.resource
    score = topology.set_score(sorted(set(indices)))
    sharing = resource.sharing.strategy if resource.sharing is not None else "none"
    # an MPS replica's client settings, as Allocate hands them to the container
    envs = handler.allocate(devices).envs if sharing == "mps" else {}
    mps = {k: v for k, v in envs.items() if k.startswith("CUDA_MPS_")}
    if args.format == "json":
        doc: dict[str, Any] = {"devices": devices, "indices": indices, "score": score, "resource": resource.name,
                               "sharing": sharing}
        if mps:
            doc["mps"] = mps
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    how = {"mps": ", shared through MPS", "time-slicing": ", time-sliced"}.get(sharing, "")
    _write(args, [
        f"machine   {topology.machine or topology.source or '-'}",
        f"resource  {resource.name} ({len(resource.devices)} {resource.kind.value} devices{how})",
        f"request   size {args.size}, {n_available} available, must-include {must_include}",
        f"on GPUs   {indices}",
        f"devices   {', '.join(devices)}",
        f"score     {score} (of the GPUs they are on)",
        *([f"mps       {' '.join(f'{k}={v}' for k, v in mps.items())}"] if mps else []),
    ])
    return 0
