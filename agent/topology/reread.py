"""The topology to serve after a re-read (kubelet restart, SIGHUP): what is read now, never
forgetting what the previous read knew."""

from __future__ import annotations

from dataclasses import replace

from agent.topology.model import Topology


def merge_reread(previous: Topology, current: Topology) -> Topology:
    """The topology to serve after a re-read (kubelet restart, SIGHUP): ``current`` as read
    now, except that it never forgets what ``previous`` knew.

    - A GPU lost now (NVML cannot read it: ``GPU-unknown-N``, no name, no NUMA node) keeps
      its previous record, hence its device ID and its labels; it is Unhealthy through the
      health state, which is not part of the topology.
    - For the GPUs read now, a fact the re-read lacks (NUMA node, CPU affinity, a link's PCIe
      level, a NIC's distance) keeps its previous value; what the re-read does know wins
      (a replaced GPU, MIG reconfigured).
    - A GPU first seen lost (a ``GPU-unknown-N`` placeholder) keeps that placeholder while
      it stays lost, and takes its real record once it is read.

    Both must have the same GPU count (the caller checks). Returns ``previous`` itself when
    nothing but the notes differ, so an unchanged node is not served again.
    """
    kept = {g.index for g in current.gpus if g.lost and not previous.gpus[g.index].lost}
    gpus = []
    for old, new in zip(previous.gpus, current.gpus):
        if old.index in kept:
            gpus.append(old)
            continue
        same_gpu = old.uuid == new.uuid
        fill = {
            name: getattr(old, name)
            for name in ("numa_node", "cpu_affinity", "numa_affinity", "memory_numa_node", "pci_class")
            if same_gpu and getattr(new, name) is None and getattr(old, name) is not None
        }
        gpus.append(replace(new, **fill) if fill else new)
    links = []
    for old_link, new_link in zip(previous.links, current.links):
        if old_link.a in kept or old_link.b in kept:
            links.append(old_link)
        elif new_link.pcie is None and old_link.pcie is not None:
            links.append(replace(new_link, pcie=old_link.pcie, nvlinks=max(new_link.nvlinks, old_link.nvlinks)))
        else:
            links.append(new_link)
    old_nics = {n.pci_bus_id: n for n in previous.nics}
    nics = []
    for nic in current.nics:
        before = old_nics.get(nic.pci_bus_id)
        if before is not None and len(before.levels) == len(nic.levels):
            levels = tuple(
                b if (i in kept or lv is None) else lv for i, (b, lv) in enumerate(zip(before.levels, nic.levels))
            )
            numa = nic.numa_node if nic.numa_node is not None else before.numa_node
            nic = replace(nic, levels=levels, numa_node=numa)
        nics.append(nic)
    merged = Topology.from_facts(replace(
        current.facts,
        gpus=tuple(gpus),
        links=tuple(links),
        nics=tuple(nics),
        numa_distances=dict(current.numa_distances or previous.numa_distances),
        numa_cpulists=dict(current.numa_cpulists or previous.numa_cpulists),
        driver_version=current.driver_version or previous.driver_version,
        cuda_driver_version=current.cuda_driver_version or previous.cuda_driver_version,
        machine=current.machine or previous.machine,
    ))
    return previous if replace(merged, notes=previous.notes) == previous else merged
