"""Our topology label family (``topology.gpu-agent.io/``), beside GFD's
(:mod:`agent.labels.gfd`).

Ours (``topology.gpu-agent.io/``): ``nvlink-fabric`` (nvswitch|mesh|bridge|none),
``nvlink-islands``, ``nvlink-largest-island``, ``nvlink-largest-clique``,
``nvlink-max-links-per-pair``, ``numa-nodes`` (NUMA nodes holding GPUs),
``max-gpus-per-numa-node``, ``rdma-nics``, ``gpu-nic-same-switch`` (every GPU has an RDMA
NIC behind the same PCIe switch complex: ``PIX`` or ``PXB`` in ``nvidia-smi topo -m``, a path
through PCIe switches only, never through a host bridge), ``gpu-models`` (distinct GPU
models on the node), ``gpu-count`` (all GPUs, whatever the model).

For gang schedulers (Kueue TAS, Volcano HyperNodes): ``nvlink-domain``, the fabric's cluster
UUID, exactly when ``nvidia.com/gpu.clique`` (which starts with it) is there: strictly nested.
With per-node configs, ``active-config`` names the config applied.
"""

from __future__ import annotations

from agent.topology.model import PcieLevel, Topology

TOPOLOGY_PREFIX = "topology.gpu-agent.io/"

#: NVLink ports of the GPUs with the most (H100/H200, B200); more links than this on one GPU
#: means NVSwitches.
MAX_NVLINK_PORTS_PER_GPU = 18

#: The node's NVLink domain (the fabric's cluster UUID), one level above GFD's clique.
NVLINK_DOMAIN_LABEL = TOPOLOGY_PREFIX + "nvlink-domain"

#: The per-node config applied (``config_file_srcdir``): the name its label chose.
ACTIVE_CONFIG_LABEL = TOPOLOGY_PREFIX + "active-config"



def known_model(name: str) -> bool:
    """A GPU record that names its model (not empty, not ``unknown``)."""
    return bool(name.strip()) and name.strip().lower() != "unknown"


def nvlink_fabric_kind(topology: Topology) -> str:
    """``nvswitch`` (NVLinks through NVSwitches), ``bridge`` (only NVLinked pairs),
    ``mesh`` (direct NVLinks joining three or more GPUs), ``none``."""
    if not topology.nvlink_islands:
        return "none"
    if any(link.nvswitch and link.nvlinks > 0 for link in topology.links):
        return "nvswitch"
    # A pasted `nvidia-smi topo -m` cannot say NVSwitch, but a GPU showing more NVLinks to
    # its peers than any GPU has ports (18, Hopper and Blackwell) must be switched: an H200
    # board shows NV18 to each of 7 peers.
    per_gpu = [0] * topology.gpu_count
    for link in topology.links:
        per_gpu[link.a] += link.nvlinks
        per_gpu[link.b] += link.nvlinks
    if max(per_gpu, default=0) > MAX_NVLINK_PORTS_PER_GPU:
        return "nvswitch"
    if all(len(island) == 2 for island in topology.nvlink_islands):
        return "bridge"
    return "mesh"



def topology_labels(topology: Topology) -> dict[str, str]:
    """Our labels for a node with GPUs (values may be empty, which the caller drops)."""
    p = TOPOLOGY_PREFIX
    numa_known = all(g.numa_node is not None for g in topology.gpus)
    numa_counts = [len(v) for k, v in topology.numa_groups.items() if k is not None]
    gpus_with_nic = {
        i
        for nic in topology.nics
        for i, level in enumerate(nic.levels)
        if level is not None and level <= PcieLevel.PXB
    }
    out = {
        p + "nvlink-fabric": nvlink_fabric_kind(topology),
        p + "nvlink-islands": str(len(topology.nvlink_islands)),
        p + "nvlink-largest-island": str(max((len(i) for i in topology.nvlink_islands), default=0)),
        p + "nvlink-largest-clique": str(max((len(c) for c in topology.nvlink_cliques), default=0)),
        p + "nvlink-max-links-per-pair": str(max((lk.nvlinks for lk in topology.links), default=0)),
        p + "rdma-nics": str(len(topology.nics)),
        p + "gpu-nic-same-switch": str(
            bool(topology.nics) and len(gpus_with_nic) == topology.gpu_count
        ).lower(),
        p + "gpu-count": str(topology.gpu_count),
    }
    if numa_known:  # a matrix without NUMA data states no NUMA node
        out[p + "numa-nodes"] = str(len(numa_counts))
        out[p + "max-gpus-per-numa-node"] = str(max(numa_counts, default=0))
    if all(known_model(g.name) for g in topology.gpus):
        out[p + "gpu-models"] = str(len({g.name for g in topology.gpus}))
    return out

