"""Test helpers around the stand-in kubelet (which lives in :mod:`agent.demo.kubelet`, so
that ``gpu-topology-agent demo`` drives the agent the same way the tests do), plus small
hand-built topologies."""

from __future__ import annotations

import os

from agent.demo import kubelet as demo_kubelet
from agent.demo.kubelet import (  # noqa: F401  (re-exported for the tests)
    PluginClient,
    PodResourcesStub,
    Registration,
)


class KubeletStub(demo_kubelet.KubeletStub):
    """The demo's stand-in kubelet, plus what a kubelet restart looks like to a plugin."""

    def restart(self) -> None:
        """Streams end, the directory is cleared and a new ``kubelet.sock`` appears (a new
        inode, plugin sockets gone), as when the kubelet restarts: its device manager
        removes every socket in the directory at start (``removeContents``) and listens
        again."""
        self.stop()
        for name in os.listdir(self.kubelet_dir):
            os.unlink(os.path.join(self.kubelet_dir, name))
        self.start()

# ------------------------------------------------------------------ test machines
# Small hand-built topologies (Topology.build), for tests that do not need a simulated NVML.

def hgx8_topology(numa: bool = True, mig: bool = False):
    """8 GPUs on NVSwitch (18 NVLinks each pair), GPUs 0-3 on NUMA 0 and 4-7 on NUMA 1 (like
    a DGX H100). With ``mig``, GPUs 6 and 7 are in MIG mode: two 3g.40gb on 6, 1g.10gb x2 on 7."""
    from agent.topology.model import Gpu, Link, MigDevice, PcieLevel, Topology

    gpus = []
    for i in range(8):
        migs: tuple = ()
        if mig and i == 6:
            migs = tuple(MigDevice(f"MIG-6{j}aaaaaa-0000-0000-0000-00000000000{j}", 6, j, "3g.40gb", 40192, gi_id=j + 1, ci_id=0) for j in range(2))
        if mig and i == 7:
            migs = tuple(MigDevice(f"MIG-7{j}bbbbbb-0000-0000-0000-00000000000{j}", 7, j, "1g.10gb", 9856, gi_id=j + 7, ci_id=0) for j in range(2))
        gpus.append(
            Gpu(
                index=i, uuid=f"GPU-{i}0000000-1111-2222-3333-44444444444{i}", name="NVIDIA H100 80GB HBM3",
                memory_mib=81559, pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", minor_number=i,
                numa_node=(i // 4) if numa else None, mig_enabled=bool(migs), mig_devices=migs,
            )
        )
    links = [
        Link(a, b, nvlinks=18, pcie=PcieLevel.NODE if a // 4 == b // 4 else PcieLevel.SYS, nvswitch=True)
        for a in range(8) for b in range(a + 1, 8)
    ]
    return Topology.build(gpus, links, numa_cpulists={0: "0-55,112-167", 1: "56-111,168-223"} if numa else {},
                          source="test:hgx8")


def pcie4_topology():
    """4 PCIe GPUs, NVLink bridges on pairs (0,1) and (2,3); 0-1 on NUMA 0, 2-3 on NUMA 1."""
    from agent.topology.model import Gpu, Link, PcieLevel, Topology

    gpus = [
        Gpu(index=i, uuid=f"GPU-a{i}000000-1111-2222-3333-555555555555", name="NVIDIA A100 80GB PCIe",
            pci_bus_id=f"00000000:{0x17 + 0x20 * i:02X}:00.0", minor_number=i, numa_node=i // 2)
        for i in range(4)
    ]
    links = []
    for a in range(4):
        for b in range(a + 1, 4):
            same = a // 2 == b // 2
            links.append(Link(a, b, nvlinks=12 if same else 0, pcie=PcieLevel.PXB if same else PcieLevel.SYS))
    return Topology.build(gpus, links, source="test:pcie4")
