"""Dynamic MIG is crash-safe (hypothesis over interleavings, in process): a sequence of
prepares and unprepares of claims with dynamic MIG devices, the agent "killed" at any step (a
MIG call before or after its effect, a checkpoint write or removal before or after it lands:
:class:`mig_double.Crash`), then a new agent over the same checkpoint directory and the same
GPUs. After its start: every instance on the GPUs is one a checkpoint record names or one
made by hand (untouched); once the kubelet's retries are through (the claims it was preparing
prepared, the rest unprepared), the GPUs hold exactly the prepared claims' placements and the
hand-made instances; unpreparing everything leaves only the hand-made ones."""

from __future__ import annotations

import os
import tempfile
import uuid as uuid_mod
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mig_double import Crash, MigDouble
from test_dra_dynamic_mig import double_for, mig_topology

import agent.dra.checkpoint as checkpoint_mod
from agent.config import Config
from agent.dra.checkpoint import CREATING, Checkpoint
from agent.dra.prepare import ClaimPreparer, ClaimRef
from agent.dra.view import DraView

DRIVER = "gpu.gpu-agent.io"
NODE = "node-1"
#: claim name -> its dynamic MIG devices; none overlaps another (the scheduler's counters)
CLAIMS = {
    "a": ("gpu-0-mig-3g40gb-0",),
    "b": ("gpu-0-mig-1g10gb-4", "gpu-1-mig-3g40gb-4"),
    "c": ("gpu-1-mig-3g40gb-0",),
    "d": ("gpu-2-mig-7g80gb-0",),
}
#: made by hand before the agent ran: GPU, profile, start
HAND_MADE = ((0, "1g.10gb", 6), (0, "1g.10gb", 5))


class Healthy:
    def is_healthy(self, index: int) -> bool:
        return True


class Claims:
    """The API server's claims (a ClaimReader)."""

    def __init__(self) -> None:
        self.objects = {
            name: {"metadata": {"namespace": "default", "name": name, "uid": str(uuid_mod.uuid4())},
                   "status": {"allocation": {"devices": {"results": [
                       {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]}}}}
            for name, devices in CLAIMS.items()
        }

    def get(self, namespace: str, name: str):
        return self.objects[name]

    def ref(self, name: str) -> ClaimRef:
        m = self.objects[name]["metadata"]
        return ClaimRef(m["namespace"], m["uid"], m["name"])


class Node:
    def __init__(self, root: str) -> None:
        self.topology = mig_topology(mig_on=(0, 1), cc=(9, 0))
        self.gpus = double_for(self.topology)
        self.claims = Claims()
        self.config = Config(mode="dra", node_name=NODE, dynamic_mig="on",
                             plugins_dir=os.path.join(root, "plugins"), cdi_dir=os.path.join(root, "cdi"))
        os.makedirs(self.config.cdi_dir)
        self.hand_made = {self.gpus.make_by_hand(*h) for h in HAND_MADE[:1]}

    def agent(self) -> ClaimPreparer:
        """A new agent process: its preparer over the checkpoint directory, recovered."""
        preparer = ClaimPreparer(DraView(self.topology), self.config, Healthy(), self.claims,
                                 Checkpoint(os.path.join(self.config.plugins_dir, "claims"), fsync=False),
                                 node_name=NODE, mig=self.gpus)
        preparer.recover()
        return preparer

    def instances(self):
        return {i for g in self.gpus.gpus.values() for i in g.instances.values()}


def crashing_writes(gpus: MigDouble):
    """The checkpoint's writes and removals count as steps too (before and after they land)."""
    write, remove = checkpoint_mod.write_json_atomic, checkpoint_mod.remove_file

    def counted(real):
        def step(*args, **kwargs):
            gpus._step()
            out = real(*args, **kwargs)
            gpus._step()
            return out
        return step

    return mock.patch.multiple(checkpoint_mod, write_json_atomic=counted(write), remove_file=counted(remove))


OPS = st.lists(st.tuples(st.sampled_from(["prepare", "unprepare"]), st.sampled_from(sorted(CLAIMS))),
               min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, crash_at=st.integers(min_value=1, max_value=40), hand_made_late=st.booleans())
def test_a_crash_at_any_step_leaks_no_mig_instance_and_destroys_none_the_agent_did_not_make(ops, crash_at,
                                                                                            hand_made_late):
    with tempfile.TemporaryDirectory(prefix="migcrash") as root:
        node = Node(root)
        gpus = node.gpus
        preparer = node.agent()
        wanted: dict[str, bool] = {}  # what the kubelet last asked for each claim: prepared or not
        gpus.crash_at = crash_at
        with crashing_writes(gpus):
            try:
                for op, name in ops:
                    wanted[name] = op == "prepare"
                    if op == "prepare":
                        assert preparer.prepare(node.claims.ref(name)).error == ""
                    else:
                        assert preparer.unprepare(node.claims.ref(name)) == ""
            except Crash:
                pass
        gpus.crash_at = None
        if hand_made_late:  # made by hand while the agent was down, on a GPU it had cut
            node.hand_made.add(gpus.make_by_hand(*HAND_MADE[1]))

        preparer = node.agent()  # the restart
        records = [m for c in preparer.checkpoint for m in c.mig]
        assert not [m for m in records if m.state == CREATING], "every intent settled at start"
        recorded = {(m.gpu, m.gi_id, m.uuid) for m in records}
        ours = {(i.parent_index, i.gi_id, i.uuid) for i in node.instances() - node.hand_made}
        assert ours == recorded, "every instance on the GPUs is a recorded one or made by hand"
        assert node.hand_made <= node.instances(), "nothing made by hand destroyed"

        # the kubelet's retries: each claim as it last asked
        for name, prepared in sorted(wanted.items()):
            if prepared:
                assert preparer.prepare(node.claims.ref(name)).error == ""
            else:
                assert preparer.unprepare(node.claims.ref(name)) == ""
        held = {(int(d.split("-")[1]), d.split("-")[3], int(d.split("-")[4]))
                for name, prepared in wanted.items() if prepared for d in CLAIMS[name]}
        on_gpus = {(i.parent_index, i.profile.replace(".", ""), i.placement.start)
                   for i in node.instances() - node.hand_made}
        assert on_gpus == held, "the GPUs hold exactly the prepared claims' placements"
        assert node.hand_made <= node.instances()

        for name in sorted(CLAIMS):
            assert preparer.unprepare(node.claims.ref(name)) == ""
        assert node.instances() == node.hand_made, "no leak"
        assert len(node.agent().checkpoint) == 0


def test_an_intent_whose_instance_was_made_is_adopted_at_start_and_destroyed_at_unprepare():
    """The kill point of the brief, deterministically: create_mig made the instance, the
    agent died before recording it."""
    with tempfile.TemporaryDirectory(prefix="migcrash") as root:
        node = Node(root)
        preparer = node.agent()
        node.gpus.crash_at = 3  # step 1: before the create, 2: GPU instance made, 3: compute instance made
        with pytest.raises(Crash):
            preparer.prepare(node.claims.ref("a"))
        (made,) = node.instances() - node.hand_made
        assert (made.profile, made.placement.start) == ("3g.40gb", 0)
        preparer = node.agent()
        (claim,) = list(preparer.checkpoint)
        assert [(m.state, m.gi_id, m.uuid) for m in claim.mig] == [("created", made.gi_id, made.uuid)]
        assert not claim.prepared
        assert preparer.unprepare(node.claims.ref("a")) == ""
        assert node.instances() == node.hand_made


def test_an_instance_made_by_hand_on_an_intents_placement_after_the_agent_destroyed_its_own_is_left():
    """A destroy landed, the agent died before dropping the record; meanwhile someone made an
    instance on the same placement (NVML may give it the same GPU instance id): the new
    agent's start destroys nothing (the UUID differs)."""
    with tempfile.TemporaryDirectory(prefix="migcrash") as root:
        node = Node(root)
        preparer = node.agent()
        assert preparer.prepare(node.claims.ref("a")).error == ""
        node.gpus.crash_at = node.gpus.steps + 2  # after the destroy's effect
        with pytest.raises(Crash):
            preparer.unprepare(node.claims.ref("a"))
        again = node.gpus.make_by_hand(0, "3g.40gb", 0)
        preparer = node.agent()
        assert len(preparer.checkpoint) == 0, "the interrupted unprepare finished at start"
        assert again in node.instances()
        assert replace(again) == node.gpus.gpus[0].instances[again.gi_id]


def test_a_gpu_instance_whose_compute_instance_the_crash_cut_short_is_destroyed_at_start_and_cut_again():
    with tempfile.TemporaryDirectory(prefix="migcrash") as root:
        node = Node(root)
        preparer = node.agent()
        node.gpus.crash_at = 2  # the GPU instance made, not its compute instance
        with pytest.raises(Crash):
            preparer.prepare(node.claims.ref("a"))
        (half,) = node.instances() - node.hand_made
        assert half.uuid is None
        preparer = node.agent()
        assert node.instances() == node.hand_made
        assert ("destroy_mig", 0, half.gi_id) in node.gpus.calls
        assert [c.mig for c in preparer.checkpoint] == [()]
        assert preparer.prepare(node.claims.ref("a")).error == ""
        assert node.gpus.layout(0) == {("3g.40gb", 0), ("1g.10gb", 6)}
