"""The DRA kubelet plugin under untrusted input and a careless operator (issue 20, defects 4
and 6), through its real unix socket: megabyte claim UIDs, names and namespaces from the
kubelet and megabyte device, pool, request and driver names from the API server give short
errors and short log lines; a checkpoint that cannot be written is named as such and leaves
no CDI spec behind. Each test failed before its fix."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from test_dra_plugin import DRIVER, Node, claim_object

from agent.dra.cdi import spec_path

MEGABYTE = "a" * (1 << 20)
#: An error or a log line about untrusted input: enough to recognise it, never megabytes.
SHORT = 1000


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def _logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("agent.dra")]


def _claim(namespace: str, name: str, uid: str) -> dict:
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid}}


def test_megabyte_claim_uid_name_and_namespace_from_the_kubelet_get_short_errors(node, caplog):
    node.start()
    cases = [
        (_claim("default", "c", MEGABYTE), "more than 128 characters"),
        (_claim("default", "c", "uid-bad/" + MEGABYTE), "not a claim UID"),
        (_claim("default", MEGABYTE, "uid-name"), "not a ResourceClaim name"),
        (_claim(MEGABYTE, "c", "uid-namespace"), "not a ResourceClaim name"),
    ]
    with caplog.at_level(logging.INFO, logger="agent.dra"):
        for claim, expected in cases:
            uid = claim["metadata"]["uid"]
            prepared = node.prepare(claim).claims[uid].error
            unprepared = node.unprepare(claim).claims[uid].error
            assert expected in prepared and len(prepared) < SHORT, prepared[:300]
            assert len(unprepared) < SHORT, unprepared[:300]
            assert prepared.startswith("ResourceClaim ") and "...(+" in prepared
    assert node.api.count("GET", "/resourceclaims/") == 0  # a name that cannot exist is not looked up
    logged = _logged(caplog)
    assert logged and all(len(m) < SHORT for m in logged), max(logged, key=len)[:300]


def test_megabyte_names_in_the_api_servers_claim_get_short_errors(node, caplog):
    node.start()
    claims = [
        (node.put_claim("device", ["gpu-" + MEGABYTE]), "unknown, this node has gpu-0"),
        (node.put_claim("pool", ["gpu-0"], pool=MEGABYTE, request=MEGABYTE), "from another pool"),
        (node.put_claim("driver", ["gpu-0"], driver=MEGABYTE + ".example.com"), "no device of driver"),
        (node.put_claim("many", [f"gpu-{i}-{MEGABYTE[:5000]}" for i in range(300)]), "unknown"),
    ]
    reborn = claim_object("reborn", ["gpu-0"])
    reborn["metadata"]["uid"] = "x" * 100_000  # the claim was deleted and created again
    node.api.put_claim(reborn)
    claims.append((_claim("default", "reborn", "uid-of-the-kubelet"), "the API server's claim has uid"))
    with caplog.at_level(logging.INFO, logger="agent.dra"):
        for claim, expected in claims:
            error = node.prepare(claim).claims[claim["metadata"]["uid"]].error
            assert expected in error and len(error) < SHORT, error[:300]
    logged = _logged(caplog)
    assert len(logged) >= len(claims) and all(len(m) < SHORT for m in logged), max(logged, key=len)[:300]


def test_a_checkpoint_that_cannot_be_written_is_named_and_no_cdi_spec_is_left(node, caplog):
    plugin = node.start()
    c = node.put_claim("c", ["gpu-0", "gpu-1"])
    uid = c["metadata"]["uid"]
    directory = plugin.checkpoint.directory
    shutil.rmtree(directory, ignore_errors=True)
    with open(directory, "w", encoding="utf-8") as f:  # a file where the checkpoint directory was
        f.write("moved away\n")
    with caplog.at_level(logging.ERROR, logger="agent.dra"):
        response = node.prepare(c)
    error = response.claims[uid].error
    assert f"cannot record it in the checkpoint {os.path.join(directory, uid + '.json')}: {directory}" in error
    assert "CDI" not in error and list(response.claims[uid].devices) == []
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid)), "a spec without its checkpoint"
    assert os.listdir(node.config.cdi_dir) == []
    assert any(error in m for m in _logged(caplog))
    os.unlink(directory)  # the operator puts it back: the kubelet's retry prepares the claim
    again = node.prepare(c).claims[uid]
    assert again.error == "" and [d.device_name for d in again.devices] == ["gpu-0", "gpu-1"]
    assert os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid))
    assert os.path.exists(os.path.join(directory, uid + ".json"))


def test_a_cdi_spec_that_cannot_be_written_is_named_with_its_path(node):
    node.start()
    c = node.put_claim("c", ["gpu-0"])
    uid = c["metadata"]["uid"]
    cdi_dir = node.config.cdi_dir
    shutil.rmtree(cdi_dir)
    with open(cdi_dir, "w", encoding="utf-8") as f:
        f.write("not a directory\n")
    error = node.prepare(c).claims[uid].error
    assert f"cannot write its CDI spec {spec_path(cdi_dir, DRIVER, uid)}: {cdi_dir}" in error
    assert "checkpoint" not in error
