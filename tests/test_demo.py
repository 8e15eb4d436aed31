"""``gpu-topology-agent demo``: the README's first command runs the real agent end to end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from agent import cli
from agent.demo.story import busy_node_trace, run_demo

TOPO = Path(__file__).parent / "fixtures" / "topo"


def demo(machine: str, fmt: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    assert run_demo(machine, fmt, out, err) == 0
    return out.getvalue(), err.getvalue()


def test_demo_tells_the_whole_story_within_100_columns():
    out, err = demo("dgx-h100", "table")
    for section in ("Topology of dgx-h100", "Node labels", "The kubelet's view",
                    "A busy node", "/metrics excerpt", "Done"):
        assert section in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "registered nvidia.com/gpu (API v1beta1" in out
    assert "ListAndWatch: 8 devices, 8 healthy, NUMA nodes [0, 1]" in out
    excerpt = out.split("/metrics excerpt", 1)[1]
    assert 'pod="' in excerpt, "metrics carry pod attribution"
    assert 'gpu_agent_registrations_total{resource="nvidia.com/gpu"} 1' in excerpt
    assert "gpu_agent_preferred_allocation_seconds_count" in excerpt
    assert "demo: waiting for the agent to register" in err, "progress is shown while it runs"


def test_demo_json_gives_the_same_facts_and_every_allocation_is_valid():
    out, _ = demo("dgx1-v100", "json")
    facts = json.loads(out)
    assert facts["registration"]["devices"] == 8 and facts["registration"]["preferred_allocation"]
    assert facts["labels"]["nvidia.com/gpu.count"] == "8"
    assert len(facts["topology"]["gpus"]) == 8
    held: set[int] = set()
    owner: dict[str, list[int]] = {}
    arrivals = 0
    for row in facts["allocations"]:
        if row["event"] == "arrive":
            arrivals += 1
            gpus = row["gpus"]
            assert len(gpus) == row["size"] == len(set(gpus))
            assert not held & set(gpus), "a GPU is never given to two running pods"
            held |= set(gpus)
            owner[row["pod"]] = gpus
            # ours is never worse than the anchor's choice on the same free GPUs
            assert row["score"] >= row["anchor"]["score"]
            assert row["score"] >= row["naive"]["score"]
        elif row["event"] == "leave":
            held -= set(owner.pop(row["pod"]))
    assert arrivals >= 5
    attributed = {m["labels"]["pod"] for m in facts["metrics"] if "pod" in m["labels"]}
    assert attributed and attributed <= set(owner)


def test_demo_runs_on_a_pasted_topology_matrix():
    out, _ = demo(str(TOPO / "l40s-4gpu-2socket-2nic.txt"), "table")
    assert "ListAndWatch: 4 devices, 4 healthy" in out


def test_busy_node_trace_is_deterministic_and_fits_the_node():
    assert busy_node_trace(8) == busy_node_trace(8)
    assert all(s.size <= 4 for s in busy_node_trace(4) if s.kind == "arrive")
    assert {s.size for s in busy_node_trace(1) if s.kind == "arrive"} == {1}


def test_demo_with_an_unknown_machine_is_one_clear_line_and_exit_2(capsys):
    assert cli.main(["demo", "--simulate", "no-such-machine"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unknown machine" in err


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_demo_subcommand_exits_0(fmt, capsys):
    assert cli.main(["demo", "--simulate", "pcie-4gpu", "--format", fmt]) == 0
    assert capsys.readouterr().out
