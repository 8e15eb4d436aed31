"""NodePrepareResources / NodeUnprepareResources of claims that name GPU-set devices, over the
real unix socket (the plugin of test_dra_plugin.py, claims from the stand-in API server): one
CDI spec with every member's device nodes and the whole set's environment, several requests
in one claim, an unhealthy member, a restart between prepare and unprepare, and a GPU held by
another prepared claim (refused until that claim is unprepared; MIG devices of one GPU apart)."""

from __future__ import annotations

import os

import pytest
from test_dra_plugin import DRIVER, NODE, Node, claim_object, env_of, spec_of

from agent.dra.cdi import spec_path
from agent.dra.devices import set_name
from agent.dra.gpusets import SetPolicy
from tests.testbed.kubelet_stub import hgx8_topology


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def members(node, k, rank=0):
    """The GPUs of the ``rank``-th set of ``k`` the empty node publishes."""
    return SetPolicy(node.topology).sequence(range(node.topology.gpu_count), k, 4)[rank]


def name(node, k, rank=0):
    return set_name(members(node, k, rank))


def two_request_claim(name, results):
    """A claim allocated ``results``: (request, device) pairs, several requests."""
    c = claim_object(name, [])
    c["spec"]["devices"]["requests"] = [
        {"name": r, "exactly": {"deviceClassName": "x", "count": 1}} for r in dict.fromkeys(r for r, _ in results)]
    c["status"]["allocation"]["devices"]["results"] = [
        {"request": r, "driver": DRIVER, "pool": NODE, "device": d} for r, d in results]
    return c


def test_a_set_claim_prepares_every_member_gpu_in_one_cdi_spec(node):
    node.start()
    quad = members(node, 4)
    c = node.put_claim("train", [name(node, 4)])
    uid = c["metadata"]["uid"]
    got = node.prepare(c).claims[uid]
    assert got.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in got.devices] == [
        (["gpus"], NODE, name(node, 4), [f"{DRIVER}/gpu={uid}-{name(node, 4)}"])]
    spec = spec_of(node, uid)
    assert [(d["name"], [n["path"] for n in d["containerEdits"]["deviceNodes"]]) for d in spec["devices"]] == [
        (f"{uid}-{name(node, 4)}", [f"/dev/nvidia{i}" for i in quad])]
    env = env_of(spec)
    topo = node.topology
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(topo.gpus[i].uuid for i in quad)
    assert env["GPU_TOPOLOGY_GPU_INDICES"] == ",".join(map(str, quad))
    assert env["GPU_TOPOLOGY_NUMA_NODES"] == "0"
    assert env["GPU_TOPOLOGY_NVLINK_CONNECTED"] == "true"
    assert env["GPU_TOPOLOGY_SCORE"] == str(topo.set_score(list(quad)))
    assert len(node.plugin.checkpoint) == 1


def test_a_claim_with_a_set_and_single_gpus_in_several_requests_gets_them_all(node):
    node.start()
    pair = members(node, 2)
    single = next(i for i in range(8) if i not in pair)
    c = node.api.put_claim(two_request_claim("mixed", [("pair", name(node, 2)), ("one", f"gpu-{single}")]))
    uid = c["metadata"]["uid"]
    got = node.prepare(c).claims[uid]
    assert got.error == ""
    assert [(list(d.request_names), d.device_name) for d in got.devices] == [
        (["pair"], name(node, 2)), (["one"], f"gpu-{single}")]
    spec = spec_of(node, uid)
    assert [[n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]] == [
        [f"/dev/nvidia{i}" for i in pair], [f"/dev/nvidia{single}"]]
    assert env_of(spec)["GPU_TOPOLOGY_GPU_INDICES"] == ",".join(map(str, sorted([*pair, single])))


def test_a_set_with_an_unhealthy_member_is_refused_naming_it_and_the_other_claims_are_served(node):
    node.start()
    quad = members(node, 4)
    node.health.mark_unhealthy(quad[2], "XID 79")
    sick = node.put_claim("sick", [name(node, 4)])
    fine = node.put_claim("fine", [name(node, 4, 1)])
    resp = node.prepare(sick, fine)
    err = resp.claims[sick["metadata"]["uid"]].error
    gpu = node.topology.gpus[quad[2]]
    assert err.startswith(f"ResourceClaim default/sick (uid {sick['metadata']['uid']}): cannot prepare device"
                          f" '{name(node, 4)}' of pool 'node-1' (request 'gpus'):")
    assert f"a GPU set whose member GPU {quad[2]} ({gpu.uuid}) is unhealthy" in err
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, sick["metadata"]["uid"]))
    assert resp.claims[fine["metadata"]["uid"]].error == ""
    node.health.mark_healthy(quad[2])
    assert node.prepare(sick).claims[sick["metadata"]["uid"]].error == ""


def test_a_claim_naming_one_gpu_twice_is_refused(node):
    node.start()
    pair = members(node, 2)
    c = node.api.put_claim(two_request_claim("twice", [("pair", name(node, 2)), ("one", f"gpu-{pair[1]}")]))
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert (f"device 'gpu-{pair[1]}' holds GPU {pair[1]}, which device '{name(node, 2)}' of the same claim"
            " holds too") in err
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, c["metadata"]["uid"]))


def test_a_set_claim_is_answered_from_the_checkpoint_after_a_restart_and_unprepared_after_another(node):
    node.start()
    c = node.put_claim("c", [name(node, 8)])
    uid = c["metadata"]["uid"]
    first = node.prepare(c)
    assert first.claims[uid].error == ""
    node.restart()
    node.api.go_down()  # answered without the API server
    os.unlink(spec_path(node.config.cdi_dir, DRIVER, uid))  # and the spec written again
    assert node.prepare(c) == first
    assert [len(d["containerEdits"]["deviceNodes"]) for d in spec_of(node, uid)["devices"]] == [8]
    plugin = node.restart()
    assert len(plugin.checkpoint) == 1
    assert node.unprepare(c).claims[uid].error == ""
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid))
    assert len(plugin.checkpoint) == 0 and len(node.restart().checkpoint) == 0


@pytest.mark.parametrize("device", ["gpuset-4-0", "gpuset-4-m0f", "gpuset-3-mf", "gpuset-2-m300", "gpuset-4-MF"])
def test_a_set_name_that_is_no_set_of_this_node_is_refused(node, device):
    """Old rank names, a mask with a leading zero, a count that is not the mask's, a GPU the
    node lacks, upper case: none names a set of this node's GPUs."""
    node.start()
    c = node.put_claim("c", [device])
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert f"device {device!r} of pool 'node-1' (request 'gpus'): unknown, this node has gpu-0" in err


# ---------------------------------------------------------------------- one GPU, two claims
def test_a_claim_on_a_gpu_another_prepared_claim_holds_is_refused_until_that_claim_is_unprepared(node):
    """The defence for the scheduler's residual race (agent.dra.gpusets, "What remains"): a
    set claim holds GPUs 0..; a claim allocated one of them as a single GPU is refused, naming
    both claims and the devices, while another claim in the same call is served; once the
    set claim is unprepared it goes through."""
    node.start()
    pair = members(node, 2)
    held = node.put_claim("pair", [name(node, 2)])
    assert node.prepare(held).claims[held["metadata"]["uid"]].error == ""
    second = node.put_claim("second", [f"gpu-{pair[0]}"])
    other = next(i for i in range(8) if i not in pair)
    fine = node.put_claim("fine", [f"gpu-{other}"])
    resp = node.prepare(second, fine)
    uid = second["metadata"]["uid"]
    gpu = node.topology.gpus[pair[0]]
    assert resp.claims[uid].error == (
        f"ResourceClaim default/second (uid {uid}): cannot prepare device 'gpu-{pair[0]}' (request 'gpus'):"
        f" GPU {pair[0]} ({gpu.uuid}) is held by ResourceClaim default/pair (uid {held['metadata']['uid']})"
        f" through device '{name(node, 2)}' (prepared again once that claim is unprepared)")
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid))
    assert resp.claims[fine["metadata"]["uid"]].error == ""
    assert len(node.plugin.checkpoint) == 2
    # the kubelet retries: refused again while the pair is prepared
    assert "is held by ResourceClaim default/pair" in node.prepare(second).claims[uid].error
    assert node.unprepare(held).claims[held["metadata"]["uid"]].error == ""
    assert node.prepare(second).claims[uid].error == ""


def test_a_set_overlapping_a_prepared_single_gpu_is_refused_also_after_a_restart(node):
    node.start()
    pair = members(node, 2)
    single = node.put_claim("single", [f"gpu-{pair[1]}"])
    assert node.prepare(single).claims[single["metadata"]["uid"]].error == ""
    node.restart()  # the checkpoint is what the agent knows
    c = node.put_claim("set", [name(node, 2)])
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert (f"device '{name(node, 2)}' (request 'gpus'): GPU {pair[1]} ({node.topology.gpus[pair[1]].uuid}) is held"
            f" by ResourceClaim default/single (uid {single['metadata']['uid']}) through device 'gpu-{pair[1]}'") in err


def test_two_mig_devices_of_one_gpu_serve_two_claims_but_one_mig_device_serves_one(node):
    node.start(hgx8_topology(mig=True))
    a, b, again = (node.put_claim(n, [d])
                   for n, d in (("a", "gpu-7-mig-0"), ("b", "gpu-7-mig-1"), ("again", "gpu-7-mig-1")))
    resp = node.prepare(a, b)
    assert [resp.claims[c["metadata"]["uid"]].error for c in (a, b)] == ["", ""]
    err = node.prepare(again).claims[again["metadata"]["uid"]].error
    assert f"is held by ResourceClaim default/b (uid {b['metadata']['uid']}) through device 'gpu-7-mig-1'" in err


def test_a_mig_device_of_a_gpu_a_claim_holds_whole_is_refused_after_mig_was_enabled(node):
    """A claim prepared on GPU 7 whole; the agent restarts with MIG enabled on GPU 7 (the
    claim's pod still runs): a MIG device of GPU 7 is refused while that claim is prepared."""
    node.start()
    whole = node.put_claim("whole", ["gpu-7"])
    assert node.prepare(whole).claims[whole["metadata"]["uid"]].error == ""
    node.plugin.stop()
    node.start(hgx8_topology(mig=True))
    c = node.put_claim("mig", ["gpu-7-mig-0"])
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert f"is held by ResourceClaim default/whole (uid {whole['metadata']['uid']}) through device 'gpu-7'" in err


def test_of_claims_racing_for_one_gpu_exactly_one_is_prepared(node):
    """Eight calls at once, each a claim on GPU 3 (alone or in a set): one wins, seven are refused."""
    import threading

    node.start()
    claims = [node.put_claim(f"c{i}", ["gpu-3" if i % 2 else name(node, 8)]) for i in range(8)]
    errors: dict[str, str] = {}

    def prepare(c: dict) -> None:
        uid = c["metadata"]["uid"]
        errors[uid] = node.prepare(c).claims[uid].error

    threads = [threading.Thread(target=prepare, args=(c,)) for c in claims]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 8 and sorted(e == "" for e in errors.values()) == [False] * 7 + [True]
    assert all("is held by ResourceClaim default/c" in e for e in errors.values() if e)
    assert len(node.plugin.checkpoint) == 1
