"""Dynamic MIG against a real agent process SIGKILLed at the two points the write-ahead
exists for: after a MIG instance was created and before the checkpoint recorded it, and after
one was destroyed and before the checkpoint forgot it. The simulated GPUs keep their layout
across the kill (``GPU_AGENT_SIM_STATE``, as a real GPU keeps it); the kill point is held open
by :mod:`mig_pause_launcher` (the backend's create or destroy pauses once its effect is
done), so the kill lands there every time. After the restart: no instance leaked or made
twice, the one made by hand untouched; read back with ``discover`` over the same state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import grpc
import pytest
from agent_run import reap
from mig_node import MigNode
from test_dra_daemon import ROOT
from waiting import eventually

SPEC = """\
name: mig-kill
gpu_defaults: {model: NVIDIA H100 80GB HBM3, mig_capable: true}
gpus:
  - {bus_id: "0000:17:00.0", numa_node: 0, mig: [1g.10gb]}   # made by hand before the agent ran
  - {bus_id: "0000:18:00.0", numa_node: 0, mig: []}
"""
DEVICE = "gpu-1-mig-3g40gb-4"


class KillNode(MigNode):
    def __init__(self) -> None:
        super().__init__(SPEC)
        self.mark = os.path.join(self.root, "paused")

    def agent(self, pause: str = "") -> subprocess.Popen[str]:
        launcher = os.path.join(ROOT, "tests", "mig_pause_launcher.py")
        proc = subprocess.Popen([sys.executable, launcher, *self.run_args()],
                                cwd=ROOT, env=self.env(MIG_PAUSE=pause, MIG_PAUSE_MARK=self.mark), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.kubelet_registers()
        return proc

    def migs(self) -> dict[int, list[dict]]:
        """GPU index -> its MIG devices, as ``discover`` reads the simulated GPUs now."""
        out = subprocess.run([sys.executable, "-m", "agent", "discover", "--simulate", self.spec, "--format", "json"],
                             cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=60, check=True)
        return {g["index"]: g["mig_devices"] for g in json.loads(out.stdout)["gpus"]}

    def placements(self, gpu_uuid: str) -> list[tuple[str, list[int]]]:
        """(profile, [start, size]) of each GPU instance of a GPU, as the simulated NVML keeps them."""
        with open(self.state, encoding="utf-8") as fh:
            gpu = json.load(fh)["gpus"][gpu_uuid]
        return [(gi["profile"], gi["placement"]) for gi in gpu["gpu_instances"]]

    def gpu_uuid(self, index: int) -> str:
        out = subprocess.run([sys.executable, "-m", "agent", "discover", "--simulate", self.spec, "--format", "json"],
                             cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=60, check=True)
        return str(json.loads(out.stdout)["gpus"][index]["uuid"])

    def checkpointed(self) -> list[dict]:
        claims = os.path.join(self.dirs["plugins"], "gpu.gpu-agent.io", "claims")
        found = []
        for name in sorted(os.listdir(claims)):
            if name.endswith(".json"):
                with open(os.path.join(claims, name), encoding="utf-8") as fh:
                    found.append(json.load(fh)["claim"])
        return found


@pytest.fixture
def node():
    n = KillNode()
    yield n
    n.close()


def in_background(call) -> threading.Thread:
    """``call()`` on a thread (a gRPC call the kill will cut), its failure swallowed."""
    def run() -> None:
        try:
            call()
        except grpc.RpcError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(180)
def test_an_agent_killed_between_create_and_checkpoint_adopts_the_instance_at_restart_and_leaks_none(node):
    hand_made = node.migs()[0]
    assert [m["profile"] for m in hand_made] == ["1g.10gb"]
    claim = node.put_claim("mig", [DEVICE])
    uid = claim["metadata"]["uid"]
    proc = node.agent(pause="create")
    try:
        in_background(lambda: node.prepare(claim))
        assert eventually(lambda: os.path.exists(node.mark), 60.0), "the create never ran"
        proc.kill()
        proc.communicate(timeout=20)
    finally:
        reap(proc)
    (made,) = node.migs()[1]
    assert made["profile"] == "3g.40gb", "the GPU kept the instance the agent made"
    assert node.placements(node.gpu_uuid(1)) == [("3g.40gb", [4, 4])], "on exactly the allocated placement"
    (recorded,) = node.checkpointed()
    assert (recorded["phase"], [(m["state"], m["device"]) for m in recorded["mig"]]) == (
        "preparing", [("creating", DEVICE)]), "killed before the result was recorded"

    os.unlink(node.mark)
    proc = node.agent()
    try:
        got = node.prepare(claim).claims[uid]  # the kubelet retries
        assert got.error == ""
        assert [d.device_name for d in got.devices] == [DEVICE]
        assert node.migs()[1] == [made], "adopted, not made twice"
        with open(os.path.join(node.dirs["cdi"], f"gpu.gpu-agent.io-claim_{uid}.json"), encoding="utf-8") as fh:
            env = dict(e.split("=", 1) for e in json.load(fh)["containerEdits"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == made["uuid"]
        assert node.unprepare(claim).claims[uid].error == ""
        proc.terminate()
        _, stderr = proc.communicate(timeout=20)
    finally:
        reap(proc)
    assert f"adopted GPU instance 1 ({made['uuid']}) on GPU 1, 3g.40gb on memory slices 4-7" in stderr
    migs = node.migs()
    assert migs[1] == [] and migs[0] == hand_made, "no leak; the hand-made instance untouched"
    assert node.checkpointed() == []


@pytest.mark.timeout(180)
def test_an_agent_killed_between_destroy_and_checkpoint_finishes_the_unprepare_at_restart(node):
    hand_made = node.migs()[0]
    claim = node.put_claim("mig", [DEVICE])
    uid = claim["metadata"]["uid"]
    proc = node.agent(pause="destroy")
    try:
        assert node.prepare(claim).claims[uid].error == ""
        assert [m["profile"] for m in node.migs()[1]] == ["3g.40gb"]
        in_background(lambda: node.unprepare(claim))
        assert eventually(lambda: os.path.exists(node.mark), 60.0), "the destroy never ran"
        proc.kill()
        proc.communicate(timeout=20)
    finally:
        reap(proc)
    assert node.migs()[1] == [], "the GPU instance is gone"
    (recorded,) = node.checkpointed()
    assert (recorded["phase"], [m["state"] for m in recorded["mig"]]) == ("unpreparing", ["destroying"])

    proc = node.agent()
    try:
        assert node.checkpointed() == [], "the unprepare was finished at start, before serving"
        assert node.unprepare(claim).claims[uid].error == "", "the kubelet's retry finds nothing to do"
        proc.terminate()
        _, stderr = proc.communicate(timeout=20)
    finally:
        reap(proc)
    assert f"ResourceClaim default/mig (uid {uid}): its unprepare, interrupted, is done" in stderr
    migs = node.migs()
    assert migs[1] == [] and migs[0] == hand_made, "nothing else destroyed"
