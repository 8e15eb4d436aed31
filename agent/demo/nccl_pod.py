"""The demo's NCCL section: a running 2-GPU pod's NCCL topology file beside the node's.

NCCL in the pod sees the GPUs it got, their nearest NICs and the path between them, as the
scheduler saw them (issue 24; docs/nccl.md).
"""

from __future__ import annotations

from typing import Any

from agent.config import Config
from agent.demo.shared_gpu import Teller
from agent.formats import GPU_RESOURCE
from agent.nccl.container_file import nccl_topology_xml
from agent.nccl.host_dir import NcclFiles, allocation_key
from agent.topology.model import Topology


def show_nccl(
    teller: Teller, topology: Topology, config: Config, running: dict[str, list[str]], table: bool
) -> dict[str, Any] | None:
    """Show the file Allocate mounted for the first running pod holding 2 GPUs, and return
    its facts; None when no pod holds 2 or the files are off."""
    files = NcclFiles.from_config(config)
    pods = sorted(pod for pod, ids in running.items() if len(ids) == 2)
    if files is None or not pods:
        return None
    path = files.path(allocation_key(GPU_RESOURCE, running[pods[0]]))
    # in place: the demo's kubelet called PreStartContainer, which waits for the file
    with open(path, encoding="ascii") as fh:
        pod_text = fh.read()
    node_lines = nccl_topology_xml(topology, range(topology.gpu_count), node_file=files.node_file).count("\n")
    if table:
        teller.heading("NCCL in a pod sees what the scheduler saw")
        teller.explain(
            f"{pods[0]} got 2 GPUs; Allocate mounted {config.nccl_mount_path} (NCCL_TOPO_FILE) from {path}:"
            " its GPUs, their nearest NICs, the PCIe switches between them, their NVLinks and CPUs"
            f" ({pod_text.count(chr(10))} lines; the node's whole file has {node_lines})."
        )
        lines = ["", *pod_text.splitlines()]  # long CPU masks cut to fit the columns
        teller.say("\n".join("  " + (x if len(x) <= 96 else x[:93] + "...") for x in lines))
    return {"pod": pods[0], "file": path, "pod_file": pod_text, "node_lines": node_lines}
