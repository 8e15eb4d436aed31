"""A stand-in ``nvidia-smi`` that prints a simulated machine, for the real-GPU kit's run in
the test suite (``bench/real_gpu/run.py --nvidia-smi "python tests/fake_nvidia_smi.py"``).

The machine is ``$FAKE_NVIDIA_SMI_MACHINE`` (a built-in name or a spec file). Like the real
tool it asks NVML (here the simulator's fake ``pynvml``, :class:`agent.hw.sim.nvml.FakeNvml`,
called directly, never through the agent's ``agent.hw.nvml`` code the kit checks) and prints
in the formats of nvidia-smi 550 (driver R550, the version the built-in machines state):

- ``topo -m``: the tab-separated matrix, ``X`` on the diagonal, ``NV#`` for # bonded NVLinks
  else the PCIe level (NVML's common ancestor; NIC cells from the PCIe places the simulator
  gives the NICs, by the simulator's one PCIe rule ``agent.hw.pcie.pcie_level``, as real
  nvidia-smi derives them from the PCI tree), then ``CPU Affinity``, ``NUMA Affinity`` and
  ``GPU NUMA ID`` (``N/A`` where unknown), the legend and the NIC legend;
- ``-q``: the ``==============NVSMI LOG==============`` report, only the keys the kit reads
  (Driver Version, CUDA Version, Attached GPUs, per ``GPU <bus id>``: Product Name, GPU UUID,
  Minor Number, MIG Mode/Current, FB Memory Usage/Total and Used in MiB, Compute Mode), with
  nvidia-smi's indentation and ``key : value`` alignment at column 45;
- ``--query-gpu=F,... --format=csv,noheader,nounits``: fields ``index``, ``uuid``, ``name``,
  ``pci.bus_id``, ``memory.total``, ``memory.used`` (MiB), ``utilization.gpu`` (%),
  ``temperature.gpu`` (C), ``power.draw`` (W, two decimals), ``compute_cap``,
  ``driver_version``, ``mig.mode.current``; ``[N/A]`` where NVML says NotSupported;
- ``--query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits``;
- ``pmon -c 1 -s u``: the ``# gpu pid type sm mem enc dec jpg ofa command`` table;
- ``compute-policy -i <GPU UUID> --set-timeslice <n>`` (also ``--set-timeslice=<n>``; n 0-3,
  as NVIDIA's DRA driver runs it): prints nvidia-smi's confirmation; a UUID that is no GPU of
  the machine is "No devices were found" with exit status 6, a value out of 0-3 exit 2, as
  the real tool answers.

Every run is appended to ``$FAKE_NVIDIA_SMI_RECORD`` when set (one JSON list of its
arguments a line), so tests see what was asked. ``$FAKE_NVIDIA_SMI_FAIL`` naming a command
(``compute-policy``) makes it fail as an unprivileged user's run does ("Insufficient
Permissions", exit status 4).
- ``mig -lgi [-i N]``: the GPU instances table (name, profile id, instance id,
  ``start:size``), from the simulator's MIG state file (``GPU_AGENT_SIM_STATE``) where one
  is kept, so that it sees the instances the agent made in another process.

``$FAKE_NVIDIA_SMI_DRIVER`` replaces the driver version it prints (a test's way to make the
tool and the agent disagree, so that the kit's comparison is seen to catch it).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

from agent.formats import parse_cpulist
from agent.hw.pcie import PciePlace, pcie_level
from agent.hw.sim.machines import load_spec
from agent.hw.sim.mig_state_file import STATE_ENV
from agent.hw.sim.nvml import FakeNvml
from agent.hw.sim.sysfs_tree import placement_path

_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except FakeNvml.NVMLError:
        return None


class Smi:
    def __init__(self, machine: str) -> None:
        self.spec = load_spec(machine)
        self.nvml = FakeNvml(self.spec)
        if os.environ.get(STATE_ENV):  # the simulated GPUs' MIG layout, as the agent left it
            self.nvml.keep_mig_state(os.environ[STATE_ENV])
        self.nvml.nvmlInit()
        self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())]

    def driver(self) -> str:
        return os.environ.get("FAKE_NVIDIA_SMI_DRIVER") or _call(self.nvml.nvmlSystemGetDriverVersion) or "N/A"

    # ------------------------------------------------------------------ topo -m
    def _nvlinks(self, a: int, b: int) -> int:
        n = self.nvml
        count = 0
        for k in range(n.NVML_NVLINK_MAX_LINKS):
            if _call(n.nvmlDeviceGetNvLinkState, self.handles[a], k) != n.NVML_FEATURE_ENABLED:
                continue
            remote = _call(n.nvmlDeviceGetNvLinkRemotePciInfo, self.handles[a], k)
            if remote is not None and remote.busId == self.spec.gpus[b].bus_id:
                count += 1
        sw = self.spec.nvswitch
        if sw is not None and a in (sw.gpus or range(len(self.handles))) and b in (sw.gpus or range(len(self.handles))):
            ok = _call(n.nvmlDeviceGetP2PStatus, self.handles[a], self.handles[b], n.NVML_P2P_CAPS_INDEX_NVLINK)
            if ok == n.NVML_P2P_STATUS_OK:
                count += sw.links_per_gpu
        return count

    def _places(self) -> list[PciePlace]:
        places = []
        for g in self.spec.gpus:
            cpus = frozenset(parse_cpulist(g.cpulist)) if g.cpulist else None
            places.append(PciePlace(placement_path(g.host_bridge, g.switches, g.bus_id), g.numa_node, cpus))
        for nic in self.spec.nics:
            cpulist = nic.cpulist or (self.spec.numa_nodes.get(nic.numa_node, ("", ()))[0]
                                      if nic.numa_node is not None else None)
            cpus = frozenset(parse_cpulist(cpulist)) if cpulist else None
            places.append(PciePlace(placement_path(nic.host_bridge, nic.switches, nic.bus_id), nic.numa_node, cpus))
        return places

    def topo(self) -> str:
        gpus, nics = len(self.handles), len(self.spec.nics)
        names = [f"GPU{i}" for i in range(gpus)] + [f"NIC{i}" for i in range(nics)]
        places = self._places()
        numa_count = len(self.spec.numa_nodes)
        # the real one underlines its header (ESC[4m ... ESC[0m), to a pipe as well (seen on
        # driver 580.159.04: tests/fixtures/topo/h200-1gpu-vm-ansi-header.txt)
        lines = ["\t\x1b[4m" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m"]
        for r, row in enumerate(names):
            cells = []
            for c in range(len(names)):
                if r == c:
                    cells.append(" X ")
                    continue
                links = self._nvlinks(r, c) if r < gpus and c < gpus else 0
                if links:
                    cells.append(f"NV{links}")
                    continue
                if r < gpus and c < gpus:
                    level = _call(self.nvml.nvmlDeviceGetTopologyCommonAncestor, self.handles[r], self.handles[c])
                else:
                    found = pcie_level(places[r], places[c], numa_count)
                    level = int(found) if found is not None else None
                cells.append(_LEVELS.get(level, "SYS") if level is not None else "SYS")
            if r < gpus:
                g = self.spec.gpus[r]
                numa = "N/A" if g.numa_node is None else str(g.numa_node)
                gpu_numa = "N/A" if g.gpu_numa_id is None else str(g.gpu_numa_id)
                tail = [g.cpulist or "N/A", numa, "", gpu_numa]
            else:
                tail = ["", "", "", ""]
            lines.append(row + "\t" + "\t".join(cells) + "\t" + "\t".join(tail))
        out = "\n".join(lines) + "\n" + LEGEND
        if nics:
            out += "\nNIC Legend:\n\n" + "\n".join(f"  NIC{i}: {n.name}" for i, n in enumerate(self.spec.nics)) + "\n"
        return out

    # ------------------------------------------------------------------ -q
    def query(self) -> str:
        n = self.nvml
        cuda = _call(n.nvmlSystemGetCudaDriverVersion_v2)

        def kv(indent: int, key: str, value: object) -> str:
            return f"{' ' * indent}{key:<{42 - indent}}: {value}"

        out = ["", "==============NVSMI LOG==============", "", kv(0, "Timestamp", "Sat Nov 28 18:00:00 2026"),
               kv(0, "Driver Version", self.driver()),
               kv(0, "CUDA Version", f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "N/A"), "",
               kv(0, "Attached GPUs", len(self.handles))]
        for i, h in enumerate(self.handles):
            g = self.spec.gpus[i]
            mig = _call(n.nvmlDeviceGetMigMode, h)
            memory = _call(n.nvmlDeviceGetMemoryInfo, h, n.nvmlMemory_v2)
            mode = _call(n.nvmlDeviceGetComputeMode, h)
            out += [f"GPU {g.bus_id}", kv(4, "Product Name", _call(n.nvmlDeviceGetName, h) or "N/A"),
                    kv(4, "GPU UUID", g.uuid), kv(4, "Minor Number", g.minor_number if g.minor_number is not None else "N/A"),
                    "    MIG Mode",
                    kv(8, "Current", "N/A" if mig is None else ("Enabled" if mig[0] else "Disabled")),
                    kv(8, "Pending", "N/A" if mig is None else ("Enabled" if mig[1] else "Disabled")),
                    "    FB Memory Usage",
                    kv(8, "Total", f"{memory.total >> 20} MiB" if memory else "N/A"),
                    kv(8, "Reserved", f"{memory.reserved >> 20} MiB" if memory else "N/A"),
                    kv(8, "Used", f"{memory.used >> 20} MiB" if memory else "N/A"),
                    kv(8, "Free", f"{memory.free >> 20} MiB" if memory else "N/A"),
                    kv(4, "Compute Mode", {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited",
                                           3: "Exclusive_Process"}.get(mode, "N/A"))]
        return "\n".join(out) + "\n"

    def query_gpu(self, fields: list[str]) -> str:
        n = self.nvml
        rows = []
        for i, h in enumerate(self.handles):
            g = self.spec.gpus[i]
            memory = _call(n.nvmlDeviceGetMemoryInfo, h, n.nvmlMemory_v2)
            util = _call(n.nvmlDeviceGetUtilizationRates, h)
            power = _call(n.nvmlDeviceGetPowerUsage, h)
            cc = _call(n.nvmlDeviceGetCudaComputeCapability, h)
            mig = _call(n.nvmlDeviceGetMigMode, h)
            values = {
                "index": i, "uuid": g.uuid, "name": _call(n.nvmlDeviceGetName, h), "pci.bus_id": g.bus_id,
                "memory.total": memory.total >> 20 if memory else None,
                "memory.used": memory.used >> 20 if memory else None,
                "utilization.gpu": util.gpu if util else None,
                "temperature.gpu": _call(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                "power.draw": f"{power / 1000:.2f}" if power is not None else None,
                "compute_cap": f"{cc[0]}.{cc[1]}" if cc else None, "driver_version": self.driver(),
                "mig.mode.current": None if mig is None else ("Enabled" if mig[0] else "Disabled"),
            }
            unknown = [f for f in fields if f not in values]
            if unknown:
                raise SystemExit(f'Field "{unknown[0]}" is not a valid field to query.')
            rows.append(", ".join("[N/A]" if values[f] is None else str(values[f]) for f in fields))
        return "\n".join(rows) + "\n"

    def compute_apps(self) -> str:
        rows = []
        for i, h in enumerate(self.handles):
            for p in _call(self.nvml.nvmlDeviceGetComputeRunningProcesses, h) or ():
                rows.append(f"{p.pid}, {self.spec.gpus[i].uuid}, {p.usedGpuMemory >> 20}")
        return "\n".join(rows) + ("\n" if rows else "")

    def pmon(self) -> str:
        lines = ["# gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command",
                 "# Idx           #    C/G      %      %      %      %      %      %    name"]
        for i, g in enumerate(self.spec.gpus):
            if not g.processes:
                lines.append(f"{i:>5}          -     -      -      -      -      -      -      -    -")
            for p in g.processes:
                lines.append(f"{i:>5} {p.pid:>10}     C {p.sm_util:>6} {p.mem_util:>6}      -      -      -      -    python")
        return "\n".join(lines) + "\n"

    def mig_lgi(self, only: int | None) -> tuple[str, int]:
        """``mig -lgi [-i N]``: the GPU instances of the MIG-enabled GPUs (exit 6 and
        ``No GPU instances found`` when there are none)."""
        n = self.nvml
        rows = []
        for i, h in enumerate(self.handles):
            mode = _call(n.nvmlDeviceGetMigMode, h)
            if (only is not None and i != only) or not mode or not mode[0]:
                continue
            for constant in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
                info = _call(n.nvmlDeviceGetGpuInstanceProfileInfo, h, constant)
                if info is None:
                    continue
                handles = (n.c_nvmlGpuInstance_t * info.instanceCount)()
                count = ctypes.c_uint(info.instanceCount)
                if _call(n.nvmlDeviceGetGpuInstances, h, info.id, handles, ctypes.byref(count)) is None:
                    continue
                for gi in handles[: count.value]:
                    gi_info = n.nvmlGpuInstanceGetInfo(gi)
                    rows.append((i, info.name, info.id, gi_info.id, gi_info.placement.start, gi_info.placement.size))
        if not rows:
            return "No GPU instances found: Not Found\n", 6
        lines = ["+-------------------------------------------------------+",
                 "| GPU instances:                                        |",
                 "| GPU   Name             Profile  Instance   Placement  |",
                 "|                          ID       ID       Start:Size |",
                 "|=======================================================|"]
        for i, name, profile_id, gi_id, start, size in sorted(rows):
            lines.append(f"|   {i:<3}{name:<22}{profile_id:>3}{gi_id:>9}{start:>10}:{size:<6}|")
            lines.append("+-------------------------------------------------------+")
        return "\n".join(lines) + "\n", 0


def compute_policy(machine: str, argv: list[str]) -> int:
    """``compute-policy -i <uuid> --set-timeslice <n>``."""
    args = [a for arg in argv for a in (arg.split("=", 1) if arg.startswith("--set-timeslice=") else [arg])]
    if len(args) != 5 or args[1] != "-i" or args[3] != "--set-timeslice":
        print(f"fake nvidia-smi: not implemented: {' '.join(argv)}", file=sys.stderr)
        return 2
    uuid, value = args[2], args[4]
    if os.environ.get("FAKE_NVIDIA_SMI_FAIL") == "compute-policy":
        print("Insufficient Permissions", file=sys.stderr)
        return 4
    smi = Smi(machine)
    if uuid not in [smi.nvml.nvmlDeviceGetUUID(h) for h in smi.handles]:
        print("No devices were found")
        return 6
    if value not in ("0", "1", "2", "3"):
        print(f'Invalid timeslice value "{value}": expected 0 (DEFAULT), 1 (SHORT), 2 (MEDIUM) or 3 (LONG)')
        return 2
    print(f"Set timeslice to {value} for GPU {uuid}")
    return 0


def main(argv: list[str]) -> int:
    machine = os.environ.get("FAKE_NVIDIA_SMI_MACHINE")
    if not machine:
        print("fake nvidia-smi: set FAKE_NVIDIA_SMI_MACHINE", file=sys.stderr)
        return 2
    if record := os.environ.get("FAKE_NVIDIA_SMI_RECORD"):
        with open(record, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(argv) + "\n")
    if argv[:1] == ["compute-policy"]:
        return compute_policy(machine, argv)
    smi = Smi(machine)
    if argv[:2] == ["topo", "-m"]:
        sys.stdout.write(smi.topo())
    elif argv[:1] == ["-q"]:
        sys.stdout.write(smi.query())
    elif argv and argv[0].startswith("--query-gpu="):
        sys.stdout.write(smi.query_gpu(argv[0].split("=", 1)[1].split(",")))
    elif argv and argv[0].startswith("--query-compute-apps="):
        sys.stdout.write(smi.compute_apps())
    elif argv[:1] == ["pmon"]:
        sys.stdout.write(smi.pmon())
    elif argv[:2] == ["mig", "-lgi"]:
        text, rc = smi.mig_lgi(int(argv[3]) if argv[2:3] == ["-i"] else None)
        sys.stdout.write(text)
        return rc
    else:
        print(f"fake nvidia-smi: not implemented: {' '.join(argv)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
