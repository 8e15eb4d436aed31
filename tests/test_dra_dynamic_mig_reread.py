"""Dynamic MIG across a topology re-read (SIGHUP) in a real agent process: discovery then sees
the MIG instances the agent cut and those made by hand (``GPU_AGENT_SIM_STATE`` keeps the
simulated GPUs' layout, as a GPU keeps it). The GPU stays a dynamic MIG GPU: the instance a
prepared claim holds is still published as that claim's slot device, consuming its memory
slices; no instance becomes a static ``gpu-<i>-mig-<n>`` device another claim could be given;
nothing overlapping an instance is offered; the instance made by hand is never touched and
said once in the log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from agent_run import reap
from mig_node import MigNode
from test_dra_daemon import ROOT
from waiting import eventually

SPEC = """\
name: mig-reread
gpu_defaults: {model: NVIDIA H100 80GB HBM3, mig_capable: true}
gpus:
  - {bus_id: "0000:17:00.0", numa_node: 0, mig: [1g.10gb, 3g.40gb]}   # made by hand before the agent ran
  - {bus_id: "0000:18:00.0", numa_node: 0, mig: []}
"""
DEVICE = "gpu-1-mig-3g40gb-4"
HAND_MADE = {0: {0}, 4: {4, 5, 6, 7}}  # the hand-made instances of GPU 0: start -> memory slices


class RereadNode(MigNode):
    def __init__(self) -> None:
        super().__init__(SPEC)
        self.log = os.path.join(self.root, "agent.log")

    def agent(self) -> subprocess.Popen[str]:
        with open(self.log, "w", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "agent", "run", *self.run_args()], cwd=ROOT, env=self.env(),
                                    stdout=subprocess.DEVNULL, stderr=log, text=True)
        self.kubelet_registers()
        return proc

    def logged(self) -> str:
        with open(self.log, encoding="utf-8") as fh:
            return fh.read()

    def published(self) -> dict[str, dict]:
        """Every device of the pool a new claim can be given, by name (one being withdrawn,
        tainted, aside: a claim the agent has not heard of yet may hold it)."""
        return {d["name"]: d for s in self.api.slices() for d in s["spec"].get("devices", [])
                if not any(t["key"] == "gpu.gpu-agent.io/withdrawn" for t in d.get("taints", []))}


def memory_slices(device: dict, gpu: int) -> set[int]:
    """The memory slices of GPU ``gpu`` a published MIG device sits on (its attributes)."""
    attrs = {k.rsplit("/", 1)[1]: next(iter(v.values())) for k, v in device.get("attributes", {}).items()}
    if attrs.get("type") != "mig" or attrs.get("parentIndex") != gpu:
        return set()
    return set(range(attrs["placementStart"], attrs["placementStart"] + attrs["placementSize"]))


def problems(devices: dict[str, dict], held: bool = True) -> list[str]:
    """What a claim could be given wrongly: a static MIG device of a dynamic GPU, a device
    overlapping an instance made by hand, and (``held``: DEVICE is prepared) one overlapping
    DEVICE or DEVICE itself missing."""
    out = [f"static MIG device {n}" for n in devices if n.count("-") == 3 and n.split("-")[2] == "mig"]
    taken = set().union(*HAND_MADE.values())
    out += [f"{n} overlaps an instance made by hand on GPU 0" for n, d in devices.items() if memory_slices(d, 0) & taken]
    if not held:
        return out
    mine = devices.get(DEVICE)
    if mine is None or memory_slices(mine, 1) != {4, 5, 6, 7}:
        out.append(f"{DEVICE} not published on memory slices 4-7")
    out += [f"{n} overlaps {DEVICE}" for n, d in devices.items() if n != DEVICE and memory_slices(d, 1) & {4, 5, 6, 7}]
    return out


@pytest.fixture
def node():
    n = RereadNode()
    yield n
    n.close()


@pytest.mark.timeout(180)
def test_after_sighup_a_held_mig_device_stays_published_as_its_slot_and_no_instance_becomes_a_static_device(node):
    claim = node.put_claim("mig", [DEVICE])
    uid = claim["metadata"]["uid"]
    proc = node.agent()
    try:
        assert node.api.wait_for(lambda s: any(d["name"].startswith("gpu-1-mig-")
                                               for o in s for d in o["spec"].get("devices", [])), 20.0)
        assert problems(node.published(), held=False) == [], \
            "before the prepare: nothing of GPU 0's hand-made instances offered, no static MIG device"
        assert any(memory_slices(d, 0) for d in node.published().values()), "GPU 0's free slices are offered"
        assert node.prepare(claim).claims[uid].error == ""
        assert eventually(lambda: problems(node.published()) == [], 10.0), problems(node.published())
        proc.send_signal(signal.SIGHUP)
        assert eventually(lambda: "reloaded; effective configuration" in node.logged(), 20.0)
        assert "topology changed since it was last read" in node.logged(), "the re-read saw the instance cut"
        deadline = time.monotonic() + 3.0  # the publisher re-renders within a second of a new topology
        while time.monotonic() < deadline:
            assert problems(node.published()) == []
            time.sleep(0.1)
        held = node.published()[DEVICE]
        assert {a: v for a, v in held["attributes"].items() if a.endswith(("/profile", "/placementStart"))} == {
            "gpu.gpu-agent.io/profile": {"string": "3g.40gb"}, "gpu.gpu-agent.io/placementStart": {"int": 4}}
        for static in ("gpu-0-mig-0", "gpu-1-mig-0"):  # the instance made by hand, the one cut for the claim
            other = node.put_claim(f"static-{static}", [static])
            error = node.prepare(other).claims[other["metadata"]["uid"]].error
            assert f"device '{static}' of pool 'node-1' (request 'gpus'): unknown" in error
        assert node.unprepare(claim).claims[uid].error == ""
        proc.terminate()
        proc.communicate(timeout=20)
    finally:
        reap(proc)
    assert node.logged().count("not made by the agent, left alone") == 1, "the hand-made instances: said once"


def test_slices_and_allocate_agree_on_a_gpu_with_instances_and_an_instance_held_is_its_slot_device(tmp_path, capsys):
    import json

    import yaml

    from agent import cli

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    assert cli.main(["discover", "--simulate", str(spec), "--format", "json"]) == 0
    one_g, _ = json.loads(capsys.readouterr().out)["gpus"][0]["mig_devices"]
    for in_use in ("", one_g["uuid"]):
        assert cli.main(["slices", "--simulate", str(spec), "--dynamic-mig", "--node-name", "n",
                         "--in-use", in_use]) == 0
        names = [d["name"] for s in yaml.safe_load_all(capsys.readouterr().out) for d in s["spec"].get("devices", ())]
        assert not [n for n in names if n.count("-") == 3], "no static MIG device on a dynamic GPU"
        # never offered: made by hand while nobody holds it; held, it is its slot device, which meets nothing
        # published (nothing overlaps it) and is left out
        assert "gpu-0-mig-1g10gb-0" not in names
        assert not [n for n in names if n.startswith("gpu-0-mig-") and n.endswith("-0")], "its slice stays taken"
        for profile in ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"):
            first = next((n for n in names if f"-mig-{profile.replace('.', '')}-" in n
                          and n != "gpu-0-mig-1g10gb-0"), None)
            code = cli.main(["allocate", "--simulate", str(spec), "--mig-profile", profile, "--in-use", in_use,
                             "--format", "json"])
            assert (code, json.loads(capsys.readouterr().out)["device"]) == (0 if first else 1, first), profile
