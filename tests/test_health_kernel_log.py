"""The kernel log as a fault source, on a running agent (``run --simulate dgx-h100
--kernel-log FILE``): a fault script appended to the file as NVRM ``Xid`` / NVSwitch ``SXid``
lines, seen through the device plugin's health (the stand-in kubelet's ListAndWatch),
``/metrics`` (``DCGM_EXP_XID_ERRORS_TOTAL``), the log, and the health state file; then the
agent restarted (a standing fault stays, a cleared one does not come back) and a reboot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import pytest
from agent_run import ROOT, AgentRun
from prometheus_client.parser import text_string_to_metric_families
from waiting import eventually

from tests.testbed.kubelet_stub import KubeletStub

RESOURCE = "nvidia.com/gpu"
# dgx-h100's GPUs by index: bus IDs as the driver prints them in Xid lines, and UUIDs
BUS = ["0000:1b:00", "0000:43:00", "0000:52:00", "0000:61:00", "0000:9d:00", "0000:c3:00", "0000:d1:00", "0000:df:00"]


def xid(gpu: int, number: int, text: str = "pid=4242, name=python3, Ch 00000008") -> str:
    return f"NVRM: Xid (PCI:{BUS[gpu]}): {number}, {text}\n"


class Node:
    """A directory holding the stand-in kubelet's, a kernel log file, a fake /proc (its boot
    ID) and the agent's health state file."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="hk", dir="/tmp")  # unix socket paths: keep it short
        self.kubelet_dir = os.path.join(self.root, "k")
        os.makedirs(self.kubelet_dir)
        self.kernel_log = os.path.join(self.root, "kmsg.log")
        open(self.kernel_log, "w").close()
        self.proc = os.path.join(self.root, "proc")
        os.makedirs(os.path.join(self.proc, "sys/kernel/random"))
        self.boot("boot-1")
        self.state_file = os.path.join(self.root, "health-state.json")
        self.config = os.path.join(self.root, "config.yaml")
        with open(self.config, "w", encoding="utf-8") as fh:
            fh.write("version: v1\nhealth:\n  recoverySeconds: 600\n  repeatedXids: {count: 3, windowSeconds: 3600}\n")
        self.kubelet = KubeletStub(self.kubelet_dir).start()
        self.runs = 0

    def boot(self, boot_id: str) -> None:
        with open(os.path.join(self.proc, "sys/kernel/random/boot_id"), "w", encoding="ascii") as fh:
            fh.write(boot_id + "\n")

    def write(self, *lines: str) -> None:
        with open(self.kernel_log, "a", encoding="utf-8") as fh:
            fh.write("".join(lines))

    def agent(self) -> AgentRun:
        self.runs += 1
        self.run = AgentRun(["--simulate", "dgx-h100", "--config", self.config, "--kubelet-dir", self.kubelet_dir,
                             "--features-dir", os.path.join(self.root, "features"), "--metrics-address", "127.0.0.1:0",
                             "--pod-resources-socket", os.path.join(self.root, "podres.sock"),
                             "--kernel-log", self.kernel_log, "--health-state-file", self.state_file,
                             "--proc-root", self.proc],
                            os.path.join(self.root, f"agent-{self.runs}.log"))
        return self.run

    def unhealthy(self) -> set[int]:
        latest = self.kubelet.latest(RESOURCE)
        if latest is None:
            return set()
        uuids = {d.ID: d.health for d in latest.devices}
        return {i for i, uuid in enumerate(self.uuids) if uuids.get(uuid) == "Unhealthy"}

    def xid_counts(self) -> dict[tuple[str, str], float]:
        try:
            port, _ = self.run.ports()  # the latest agent's
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        out = {}
        for family in text_string_to_metric_families(text):
            if family.name == "DCGM_EXP_XID_ERRORS_TOTAL":  # the parser names its samples *_total
                for s in family.samples:
                    out[(s.labels["gpu"], s.labels["xid"])] = s.value
        return out

    def standing(self) -> set[str]:
        try:
            with open(self.state_file, encoding="utf-8") as fh:
                return {f["key"] for f in json.load(fh)["faults"]}
        except (OSError, ValueError):
            return set()

    def close(self) -> None:
        self.kubelet.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def node():
    n = Node()
    out = subprocess.run([sys.executable, "-m", "agent", "discover", "--simulate", "dgx-h100", "--format", "json"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    gpus = json.loads(out.stdout)["gpus"]
    assert [g["pci_bus_id"][4:].lower()[:-2] for g in gpus] == BUS
    n.uuids = [g["uuid"] for g in gpus]
    yield n
    n.close()


def _registered(node: Node, agent: AgentRun) -> None:
    assert node.kubelet.wait_for(lambda: node.kubelet.latest(RESOURCE) is not None, 30.0), agent.log()[-3000:]


@pytest.mark.timeout(240)
def test_a_fault_script_through_the_kernel_log_raises_counts_and_clears_faults_and_survives_a_restart(node):
    agent = node.agent()
    try:
        _registered(node, agent)
        # XID 13 alone: an occurrence and a metric, the GPU stays healthy
        node.write(xid(0, 13))
        assert eventually(lambda: node.xid_counts().get(("0", "13")) == 1, 10.0), agent.log()[-3000:]
        # XID 31 on GPU 1 past the threshold (3 in the window): a fault
        node.write(xid(1, 31), xid(1, 31))
        assert eventually(lambda: node.xid_counts().get(("1", "31")) == 2, 10.0)
        assert node.unhealthy() == set()
        node.write(xid(1, 31))
        # XID 48 (double-bit ECC: reset the GPU), XID 79 (fallen off the bus: reboot), an SXid,
        # a malformed Xid line (twice), an XID outside the catalog (twice), in /dev/kmsg's spelling too
        node.write(xid(2, 48, "pid=77, Ch 00000010, DBE (0x1) detected"),
                   f"4,1200,98765432,-;NVRM: Xid (PCI:{BUS[3]}): 79, pid=1, GPU has fallen off the bus.\n",
                   "nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 44 sourcetrack timeout\n",
                   "NVRM: Xid (PCI:0000:zz:00): 79, garbled\n", "NVRM: Xid (PCI:0000:zz:00): 79, garbled\n",
                   xid(4, 999), xid(4, 999))
        assert eventually(lambda: node.unhealthy() == {1, 2, 3}, 10.0), (node.unhealthy(), agent.log()[-3000:])
        assert eventually(lambda: node.standing() == {"repeated-xid-31/gpu-1", "xid-48/gpu-2", "xid-79/gpu-3",
                                                      "sxid-24007/nvidia-nvswitch2"}, 10.0), node.standing()
        assert 0 not in node.unhealthy() and 4 not in node.unhealthy()
        assert len(agent.lines("RepeatedApplicationXID: XID 31 3 times")) == 1
        assert len(agent.lines("NodeRebootRequired: XID 79")) == 1
        assert len(agent.lines("GPUMemoryError: XID 48")) == 1
        assert len(agent.lines("node: GPUResetRequired: SXid 24007 on nvidia-nvswitch2")) == 1
        assert len(agent.lines("line that does not parse")) == 1
        assert len(agent.lines("XID 999 is not in the XID catalog")) == 1
        assert node.xid_counts()[("4", "999")] == 2
        # the driver initialises GPU 2 again (a reset): its fault clears, the others stand
        node.write(f"NVRM: GPU at PCI:{BUS[2]}: {node.uuids[2]}\n")
        assert eventually(lambda: node.unhealthy() == {1, 3}, 10.0), agent.log()[-3000:]
        assert eventually(lambda: "xid-48/gpu-2" not in node.standing(), 10.0)
        assert len(agent.lines("fault xid-48/gpu-2 cleared (the driver initialised GPU 2")) == 1
        assert agent.stop() == 0, agent.log()[-3000:]
    finally:
        agent.kill()

    # a restart: the standing faults stay, the cleared one is not raised again from the log
    again = node.agent()
    try:
        _registered(node, again)
        assert eventually(lambda: node.unhealthy() == {1, 3}, 10.0), again.log()[-3000:]
        node.write(xid(5, 13))  # a new line after the restart: read, counted
        assert eventually(lambda: node.xid_counts().get(("5", "13")) == 1, 10.0), again.log()[-3000:]
        assert ("2", "48") not in node.xid_counts() and ("0", "13") not in node.xid_counts()
        assert again.lines("fault xid-48/gpu-2") == [] and len(again.lines("stands since before this start")) == 3
        assert again.stop() == 0, again.log()[-3000:]
    finally:
        again.kill()

    # a reboot: a new boot ID and a new kernel log; the faults of the last boot are gone
    node.boot("boot-2")
    os.unlink(node.kernel_log)
    open(node.kernel_log, "w").close()
    rebooted = node.agent()
    try:
        _registered(node, rebooted)
        assert eventually(lambda: node.standing() == set(), 10.0), rebooted.log()[-3000:]
        assert node.unhealthy() == set()
        assert rebooted.stop() == 0, rebooted.log()[-3000:]
    finally:
        rebooted.kill()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


@pytest.mark.timeout(240)
def test_a_storm_of_ten_thousand_xid_95_lines_is_one_fault_one_log_line_and_steady_memory(node):
    agent = node.agent()
    try:
        _registered(node, agent)
        node.write(xid(6, 95))
        assert eventually(lambda: node.unhealthy() == {6}, 10.0), agent.log()[-3000:]
        before_kib = _rss_kib(agent.proc.pid)
        node.write(*(xid(6, 95, f"pid={i}, Ch 0000001a, uncontained") for i in range(10_000)))
        assert eventually(lambda: node.xid_counts().get(("6", "95")) == 10_001, 30.0), node.xid_counts()
        grown_kib = _rss_kib(agent.proc.pid) - before_kib
        assert node.unhealthy() == {6} and node.standing() == {"xid-95/gpu-6"}
        assert len(agent.lines("XID 95")) == 1, agent.lines("XID 95")[:5]
        assert grown_kib < 16 * 1024, f"RSS grew {grown_kib} KiB"
        assert agent.stop() == 0, agent.log()[-3000:]
    finally:
        agent.kill()


def test_a_bad_xid_override_is_one_clear_line_naming_the_field(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text('version: v1\nhealth:\n  xids: {"48": reboot, "13": rest}\n')
    out = subprocess.run([sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100", "--config", str(config)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"gpu-topology-agent run: error: {config}: health.xids.13: expected one of ignore, application, reset, reboot,"
        " memory, nvlink, support, got 'rest'"
    ], out.stderr
