"""``gpu-topology-agent allocate``: which GPUs the agent would give a container.

``--size K [--available LIST] [--must-include LIST] [--simulate MACHINE]
[--format table|json] [--explain]``. LIST is comma-separated GPU indices or UUIDs (mixed is
fine); ``--available`` defaults to every GPU that is not lost. Without ``--simulate`` the
command asks this node's GPUs through NVML, as every subcommand does. JSON output is
``{"devices": [...uuids...], "indices": [...], "score": N}`` (plus ``"explanation"`` with
``--explain``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.commands._common import add_format_flag, add_simulate_flag, load_topology
from agent.errors import UsageError
from agent.topology.allocator import CRITERIA, AllocationEngine, Explanation
from agent.topology.model import Topology


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("allocate", help="show the preferred allocation for a request")
    p.add_argument(
        "--size", type=int, required=True, metavar="K", help="number of GPUs to allocate"
    )
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
        help="comma-separated GPU indices or UUIDs the answer must contain",
    )
    add_simulate_flag(p)
    add_format_flag(p)
    p.add_argument(
        "--explain",
        action="store_true",
        help="also show the runners-up and the criterion that separated them",
    )
    p.set_defaults(func=run)


def parse_gpu_list(text: str, topology: Topology, flag: str) -> list[int]:
    """``"0,3,GPU-ab..."`` -> GPU indices; raises UsageError naming the bad item."""
    out: list[int] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            if text.strip():
                raise UsageError(f"{flag}: empty item in {text!r}")
            continue
        if item.isdigit() or (item[0] in "+-" and item[1:].isdigit()):
            index = int(item)
            if index < 0 or index >= topology.gpu_count:
                raise UsageError(
                    f"{flag}: {item} is not a GPU of this machine: expected GPU indices "
                    f"0-{topology.gpu_count - 1} or GPU UUIDs"
                )
            out.append(index)
            continue
        gpu = topology.gpu_by_uuid(item)
        if gpu is None:
            raise UsageError(
                f"{flag}: {item!r} is neither a GPU index nor a GPU UUID of this machine"
            )
        out.append(gpu.index)
    return out


def explanation_to_json(e: Explanation) -> dict[str, Any]:
    def cand(c: Any) -> dict[str, Any]:
        return {
            "indices": list(c.indices),
            "anchor_criterion": c.anchor_score,
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


def run(args: argparse.Namespace) -> int:
    topology = load_topology(args.simulate)
    if topology.gpu_count == 0:
        raise UsageError("this machine has no GPUs")
    if args.available is None:
        available = [g.index for g in topology.gpus if not g.lost]
    else:
        available = parse_gpu_list(args.available, topology, "--available")
    must_include = parse_gpu_list(args.must_include, topology, "--must-include")
    allocator = AllocationEngine(topology)
    indices = allocator.best_set(available, must_include, args.size)
    explanation = allocator.explain(available, must_include, args.size) if args.explain else None
    devices = [topology.gpus[i].uuid for i in indices]
    score = topology.set_score(indices)
    if args.format == "json":
        doc: dict[str, Any] = {"devices": devices, "indices": indices, "score": score}
        if explanation is not None:
            doc["explanation"] = explanation_to_json(explanation)
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    best = allocator.best_score_for_size(args.size)
    lines = [
        f"machine   {topology.machine or topology.source or '-'}",
        f"request   size {args.size}, available {available}, must-include {must_include}",
        f"indices   {indices}",
        f"devices   {', '.join(devices)}",
        f"score     {score} (best possible for {args.size} GPUs on this machine: {best})",
    ]
    if explanation is not None:
        lines.append("")
        lines.extend(explanation.lines())
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
