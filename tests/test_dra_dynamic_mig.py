"""Dynamic MIG over the real DRA socket: a ``gpu-<i>-mig-<profile>-<start>`` device is cut at
NodePrepareResources on exactly its placement (the MIG device's UUID in the CDI spec) and
destroyed at NodeUnprepareResources; a repeated prepare cuts nothing more; instances made by
hand are never touched; MIG mode is switched on only where NVML can without a reset; the
conflicts (overlapping placements, a whole GPU against a MIG device of it) are refused in one
line naming the claim, the request and the device. The GPUs are :class:`MigDouble` (its
state outlives an agent restart, as a GPU's does)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace

import pytest
from mig_double import MigDouble, SimGpu
from test_dra_plugin import DRIVER, NODE, Node, env_of, spec_of

from agent.dra.cdi import spec_path
from agent.dra.claims import KubernetesClaimReader
from agent.dra.plugin import DraPlugin
from agent.dra.view import DraView
from agent.hw.sim.mig_geometry import geometry_for
from agent.topology.model import Topology
from tests.testbed.kubelet_stub import hgx8_topology, pcie4_topology

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100 80GB PCIe"


def mig_topology(*, mig_on=(0, 1, 2, 3), base=None, cc=(9, 0)) -> Topology:
    """``base`` (an HGX H100 by default) with the GPUs' MIG geometry, MIG mode on for
    ``mig_on`` (no instance yet)."""
    base = base or hgx8_topology()
    gpus = [replace(g, compute_capability=cc, mig_capable=True, mig_geometry=geometry_for(g.name),
                    mig_enabled=g.index in mig_on) for g in base.gpus]
    return Topology.build(gpus, base.links, numa_cpulists=base.numa_cpulists, source="test:mig")


def double_for(topology: Topology, *, hopper: bool = True) -> MigDouble:
    return MigDouble({g.index: SimGpu(g.mig_geometry, mig_on=g.mig_enabled, hopper=hopper) for g in topology.gpus})


class MigNode(Node):
    """test_dra_plugin's node, its plugin handed the MIG double, dynamic MIG on."""

    def __init__(self, topology: Topology, mig: MigDouble) -> None:
        super().__init__()
        self.config = replace(self.config, dynamic_mig="on")
        self.topology = topology
        self.mig = mig

    def start(self, topology=None, config=None, poll_s=0.05, on_kubelet_restart=None) -> DraPlugin:
        self.topology = topology or self.topology
        reader = KubernetesClaimReader(self.api.api_client(), timeout_s=2.0)
        self.plugin = DraPlugin(config or self.config, DraView(self.topology), self.health, reader, poll_s=poll_s,
                                mig=self.mig)
        self.plugin.start()
        return self.plugin

    def error(self, claim) -> str:
        return self.prepare(claim).claims[claim["metadata"]["uid"]].error


@pytest.fixture
def node():
    topology = mig_topology()
    n = MigNode(topology, double_for(topology))
    yield n
    n.close()


def uid(claim) -> str:
    return claim["metadata"]["uid"]


def instance(node, gpu):
    (only,) = node.mig.gpus[gpu].instances.values()
    return only


# ---------------------------------------------------------------------- prepare, unprepare
def test_a_dynamic_mig_device_is_cut_on_exactly_its_placement_and_its_uuid_goes_into_the_cdi_spec(node):
    node.start()
    c = node.put_claim("mig", ["gpu-2-mig-3g40gb-4"])
    got = node.prepare(c).claims[uid(c)]
    assert got.error == ""
    assert [(d.device_name, list(d.cdi_device_ids)) for d in got.devices] == [
        ("gpu-2-mig-3g40gb-4", [f"{DRIVER}/gpu={uid(c)}-gpu-2-mig-3g40gb-4"])]
    assert node.mig.layout(2) == {("3g.40gb", 4)}
    made = instance(node, 2)
    assert (made.placement.start, made.placement.size) == (4, 4)
    spec = spec_of(node, uid(c))
    assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == made.uuid
    assert env_of(spec)["GPU_TOPOLOGY_GPU_INDICES"] == "2"
    assert [[n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]] == [["/dev/nvidia2"]]


def test_a_dynamic_mig_device_is_named_by_uuid_also_under_the_index_id_strategy(node):
    node.config = replace(node.config, device_id_strategy="index")
    node.start()
    c = node.put_claim("mig", ["gpu-1-mig-1g10gb-3"])
    assert node.error(c) == ""
    assert env_of(spec_of(node, uid(c)))["NVIDIA_VISIBLE_DEVICES"] == instance(node, 1).uuid


def test_unprepare_destroys_the_instance_and_removes_the_spec_and_the_checkpoint(node):
    node.start()
    c = node.put_claim("mig", ["gpu-0-mig-2g20gb-2"])
    assert node.error(c) == ""
    assert node.unprepare(c).claims[uid(c)].error == ""
    assert node.mig.layout(0) == set()
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid(c)))
    assert len(node.plugin.checkpoint) == 0 and len(node.restart().checkpoint) == 0
    assert node.unprepare(c).claims[uid(c)].error == "", "a second unprepare has nothing to do"
    assert [x[0] for x in node.mig.calls].count("destroy_mig") == 1


def test_a_repeated_prepare_answers_the_same_and_cuts_nothing_more_also_after_a_restart(node):
    node.start()
    c = node.put_claim("mig", ["gpu-3-mig-7g80gb-0"])
    first = node.prepare(c)
    assert first.claims[uid(c)].error == ""
    assert node.prepare(c) == first
    node.restart()
    os.unlink(spec_path(node.config.cdi_dir, DRIVER, uid(c)))  # the spec is written again
    assert node.prepare(c) == first
    assert env_of(spec_of(node, uid(c)))["NVIDIA_VISIBLE_DEVICES"] == instance(node, 3).uuid
    assert [x[0] for x in node.mig.calls].count("create_mig") == 1
    assert node.mig.layout(3) == {("7g.80gb", 0)}


def test_two_mig_devices_of_one_gpu_serve_two_claims_and_a_claim_with_devices_on_two_gpus_gets_both(node):
    node.start()
    a = node.put_claim("a", ["gpu-0-mig-3g40gb-0"])
    b = node.api.put_claim({**a, "metadata": {"namespace": "default", "name": "b"}, "status": {"allocation": {
        "devices": {"results": [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d}
                                for d in ("gpu-0-mig-3g40gb-4", "gpu-1-mig-1g10gb-6")]}}}})
    resp = node.prepare(a, b)
    assert [resp.claims[uid(c)].error for c in (a, b)] == ["", ""]
    assert node.mig.layout(0) == {("3g.40gb", 0), ("3g.40gb", 4)} and node.mig.layout(1) == {("1g.10gb", 6)}
    env = env_of(spec_of(node, uid(b)))
    assert env["NVIDIA_VISIBLE_DEVICES"].split(",") == [
        next(i.uuid for i in node.mig.gpus[0].instances.values() if i.placement.start == 4), instance(node, 1).uuid]
    assert node.unprepare(b).claims[uid(b)].error == ""
    assert node.mig.layout(0) == {("3g.40gb", 0)} and node.mig.layout(1) == set()


# ---------------------------------------------------------------------- what is never touched
def test_an_instance_made_by_hand_is_never_touched_and_a_placement_overlapping_it_is_refused(node, caplog):
    hand = node.mig.make_by_hand(0, "1g.10gb", 5)
    with caplog.at_level(logging.INFO, logger="agent.dra.mig_lifecycle"):
        node.start()
    assert [r.getMessage() for r in caplog.records if "not made by the agent" in r.getMessage()] == [
        f"GPU 0 ({node.topology.gpus[0].uuid}): 1 MIG instance(s) not made by the agent, left alone:"
        f" 1g.10gb on memory slices 5-5 (GPU instance {hand.gi_id})"]
    over = node.put_claim("over", ["gpu-0-mig-3g40gb-4"])
    assert node.error(over) == (
        f"ResourceClaim default/over (uid {uid(over)}): cannot prepare device 'gpu-0-mig-3g40gb-4' (request 'gpus'):"
        f" GPU 0 ({node.topology.gpus[0].uuid}): 3g.40gb on memory slices 4-7 overlaps MIG instance 1g.10gb on"
        f" memory slices 5-5 (GPU instance {hand.gi_id}, not made by the agent (left alone))")
    fine = node.put_claim("fine", ["gpu-0-mig-3g40gb-0"])
    assert node.error(fine) == ""
    assert node.unprepare(fine, over).claims[uid(fine)].error == ""
    node.restart()
    assert node.mig.gpus[0].instances == {hand.gi_id: hand}
    assert not any(x[0] == "destroy_mig" and x[2] == hand.gi_id for x in node.mig.calls)


# ---------------------------------------------------------------------- MIG mode
def test_an_ampere_gpu_with_mig_mode_off_is_refused_in_one_line_and_its_mode_left_alone():
    topology = mig_topology(mig_on=(), base=pcie4_topology(), cc=(8, 0))
    n = MigNode(topology, double_for(topology, hopper=False))
    try:
        n.start()
        c = n.put_claim("amp", ["gpu-1-mig-3g40gb-0"])
        gpu = topology.gpus[1]
        assert n.error(c) == (
            f"ResourceClaim default/amp (uid {uid(c)}): cannot prepare device 'gpu-1-mig-3g40gb-0' (request 'gpus'):"
            f" GPU 1 ({gpu.uuid}) has MIG mode off and switching it on needs a GPU reset ({A100}, compute capability"
            " 8.0), which the agent never does: switch MIG mode on by hand (nvidia-smi -i 1 -mig 1, then reset the"
            " GPU)")
        assert not any(x[0] in ("enable_mig", "create_mig") for x in n.mig.calls)
        assert not n.mig.gpus[1].mig_on
        assert not os.path.exists(spec_path(n.config.cdi_dir, DRIVER, uid(c)))
    finally:
        n.close()


def test_a_free_hopper_gpu_with_mig_mode_off_is_switched_on_not_while_held_whole_and_off_again_when_its_last_instance_goes():
    topology = mig_topology(mig_on=())
    n = MigNode(topology, double_for(topology))
    try:
        n.start()
        whole = n.put_claim("whole", ["gpu-5"])
        assert n.error(whole) == ""
        held = n.put_claim("held", ["gpu-5-mig-1g10gb-0"])
        assert n.error(held) == (
            f"ResourceClaim default/held (uid {uid(held)}): cannot prepare device 'gpu-5-mig-1g10gb-0' (request"
            f" 'gpus'): GPU 5 ({topology.gpus[5].uuid}) is held whole by ResourceClaim default/whole"
            f" (uid {uid(whole)}) through device 'gpu-5'")
        assert not n.mig.gpus[5].mig_on
        free = n.put_claim("free", ["gpu-4-mig-1g10gb-0"])
        assert n.error(free) == ""
        assert n.mig.gpus[4].mig_on and n.mig.layout(4) == {("1g.10gb", 0)}
        later = n.put_claim("later", ["gpu-4"])  # published whole from the topology read before
        assert n.error(later) == (
            f"ResourceClaim default/later (uid {uid(later)}): cannot prepare device 'gpu-4' (request 'gpus'): GPU 4"
            f" ({topology.gpus[4].uuid}) is in MIG mode (switched on for dynamic MIG): a whole GPU needs MIG mode off"
            " (nvidia-smi -i 4 -mig 0)")
        assert n.unprepare(free).claims[uid(free)].error == ""
        # its last instance gone, the GPU the agent switched on is switched off again: whole,
        # as its published full-GPU device says
        assert not n.mig.gpus[4].mig_on and ("disable_mig", 4) in n.mig.calls
        assert n.error(n.put_claim("later-again", ["gpu-4"])) == ""
        n.mig.gpus[6].busy = True
        busy = n.put_claim("busy", ["gpu-6-mig-1g10gb-0"])
        assert "GPU 6 (" in n.error(busy) and "has MIG mode off and runs processes" in n.error(busy)
    finally:
        n.close()


# ---------------------------------------------------------------------- conflicts
def test_overlapping_placements_of_two_claims_are_refused_naming_the_other_claim(node):
    node.start()
    a = node.put_claim("a", ["gpu-0-mig-4g40gb-0"])
    assert node.error(a) == ""
    b = node.put_claim("b", ["gpu-0-mig-3g40gb-0"])
    assert node.error(b) == (
        f"ResourceClaim default/b (uid {uid(b)}): cannot prepare device 'gpu-0-mig-3g40gb-0' (request 'gpus'):"
        f" its memory slices on GPU 0 ({node.topology.gpus[0].uuid}) overlap MIG device 'gpu-0-mig-4g40gb-0' of"
        f" ResourceClaim default/a (uid {uid(a)})")
    assert node.mig.layout(0) == {("4g.40gb", 0)}


def test_a_whole_gpu_or_a_set_holding_a_gpu_a_mig_device_was_cut_from_is_refused():
    topology = mig_topology(mig_on=(0,))
    n = MigNode(topology, double_for(topology))
    try:
        n.start()
        m = n.put_claim("m", ["gpu-0-mig-1g10gb-2"])
        assert n.error(m) == ""
        whole = n.put_claim("whole", ["gpu-0"])  # a stale allocation: gpu-0 is no device of a MIG-mode GPU
        assert "unknown" in n.error(whole)
        n.plugin.stop()
        n.start(mig_topology(mig_on=()))  # the topology read before MIG mode was on: gpu-0 a device
        err = n.error(whole)
        assert err == (f"ResourceClaim default/whole (uid {uid(whole)}): cannot prepare device 'gpu-0' (request"
                       f" 'gpus'): GPU 0 ({topology.gpus[0].uuid}) holds MIG device 'gpu-0-mig-1g10gb-2' of"
                       f" ResourceClaim default/m (uid {uid(m)})")
    finally:
        n.close()


@pytest.mark.parametrize(("device", "reason"), [
    ("gpu-9-mig-1g10gb-0", "this node has no GPU 9"),
    ("gpu-0-mig-5g50gb-0", f"GPU 0 (GPU-00000000-1111-2222-3333-444444444440, {H100}) has no MIG profile 5g50gb (it has 1g10gb, 1g10gb-me, 1g20gb, 2g20gb, 3g40gb, 4g40gb,"
                           " 7g80gb)"),
    ("gpu-0-mig-3g40gb-2", "MIG profile 3g.40gb of GPU 0 cannot start at memory slice 2 (it starts at 0, 4)"),
])
def test_a_dynamic_mig_name_that_is_no_slot_of_this_node_is_refused_saying_why(node, device, reason):
    node.start()
    c = node.put_claim("c", [device])
    assert node.error(c) == (f"ResourceClaim default/c (uid {uid(c)}): cannot prepare device {device!r} of pool"
                             f" 'node-1' (request 'gpus'): {reason}")
    assert node.mig.calls == [] or all(x[0] == "mig_instances" for x in node.mig.calls)


def test_dynamic_mig_names_are_refused_while_dynamic_mig_is_off(node):
    node.config = replace(node.config, dynamic_mig="off")
    node.start()
    c = node.put_claim("c", ["gpu-0-mig-1g10gb-0"])
    assert node.error(c).endswith("(request 'gpus'): a dynamic MIG device, and dynamic MIG is off on this node"
                                  " (dra.dynamicMig)")
    assert node.mig.layout(0) == set()


# ---------------------------------------------------------------------- checkpoint format
def test_a_checkpoint_of_format_1_still_answers_its_claim(node):
    """An agent before dynamic MIG wrote format 1 (no phase, no MIG records)."""
    node.start()
    c = node.put_claim("old", ["gpu-6"])
    first = node.prepare(c)
    node.plugin.stop()
    path = os.path.join(node.config.plugins_dir, DRIVER, "claims", uid(c) + ".json")
    with open(path, encoding="utf-8") as fh:
        claim = json.load(fh)["claim"]
    old = {k: v for k, v in claim.items() if k not in ("phase", "mig")}
    checksum = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"version": 1, "checksum": checksum, "claim": old}, fh)
    plugin = node.start()
    assert len(plugin.checkpoint) == 1
    node.api.go_down()
    assert node.prepare(c) == first


def test_a_fault_on_a_gpu_makes_the_dynamic_mig_device_cut_from_it_unhealthy_on_the_health_stream(node):
    from test_dra_health_stream import Subscriber

    from agent._proto import dra_health_v1beta1_pb2, dra_health_v1beta1_pb2_grpc

    plugin = node.start()
    c = node.put_claim("mig", ["gpu-2-mig-2g20gb-0"])
    assert node.error(c) == ""
    sub = Subscriber(node.channel(plugin.endpoint), dra_health_v1beta1_pb2, dra_health_v1beta1_pb2_grpc)
    assert sub.health(sub.next(5.0))["gpu-2-mig-2g20gb-0"] == "HEALTHY"
    node.health.mark_unhealthy(2, "XID 79")
    health = sub.health(sub.next(1.0))
    assert health["gpu-2-mig-2g20gb-0"] == "UNHEALTHY" and health["gpu-5"] == "HEALTHY"
