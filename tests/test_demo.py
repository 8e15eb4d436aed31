"""``gpu-topology-agent demo``: the README's first command runs the real agent end to end."""

from __future__ import annotations

import io
import json
import logging
import re
import shlex
from pathlib import Path

import pytest

from agent import cli
from agent._proto.deviceplugin_v1beta1_pb2 import Device
from agent.demo.busy_node import BusyNode, Step, busy_node_trace
from agent.demo.story import run_demo

TOPO = Path(__file__).parent / "fixtures" / "topo"


def demo(machine: str, fmt: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    assert run_demo(machine, fmt, out, err) == 0
    return out.getvalue(), err.getvalue()


def test_demo_tells_the_whole_story_within_100_columns():
    out, err = demo("dgx-h100", "table")
    for section in ("Topology of dgx-h100", "Node labels", "The kubelet's view",
                    "A busy node", "NCCL in a pod sees what the scheduler saw", "/metrics excerpt",
                    SHARED[3:], "Done"):
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
            # ours is never worse than go-gpuallocator's choice on the same free GPUs
            assert row["score"] >= row["gpuallocator"]["score"]
            assert row["score"] >= row["naive"]["score"]
        elif row["event"] == "leave":
            held -= set(owner.pop(row["pod"]))
    assert arrivals >= 5
    attributed = {m["labels"]["pod"] for m in facts["metrics"] if "pod" in m["labels"]}
    assert attributed and attributed <= set(owner)
    # a 2-GPU pod's NCCL topology file: its 2 GPUs, as NCCL's reader takes it
    import nccl_standin

    assert len(nccl_standin.load(facts["nccl"]["pod_file"]).gpus) == 2
    assert facts["nccl"]["pod"] in owner and facts["nccl"]["node_lines"] > facts["nccl"]["pod_file"].count("\n")


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


MACHINES = ["dgx1-v100", "dgx2", "dgx-a100", "dgx-h100", "pcie-pairs", "pcie-4gpu",
            "gb200-tray", "a100-mig", "single-gpu"]


def test_the_machine_list_above_is_every_built_in_machine():
    from agent.hw.sim.machines import BUILTIN_MACHINES

    assert sorted(MACHINES) == sorted(BUILTIN_MACHINES)


@pytest.mark.parametrize("machine", MACHINES)
def test_the_suggested_next_command_works_on_the_machine_just_shown(machine, capsys):
    out, _ = demo(machine, "table")
    done = out.split("== Done", 1)[1]
    suggested = [c for c in re.findall(r"`([^`]+)`", done) if c.startswith("gpu-topology-agent ")]
    assert suggested, f"the demo suggests no command: {done}"
    for command in suggested:
        argv = shlex.split(command)[1:]
        assert argv[argv.index("--simulate") + 1] == machine
        capsys.readouterr()
        assert cli.main(argv) == 0, f"{command}: {capsys.readouterr().err}"
        assert capsys.readouterr().out


def test_the_demo_explains_each_term_the_first_time_it_uses_it():
    out, _ = demo("dgx-h100", "table")
    explained = {
        "gpuallocator": "gpuallocator = NVIDIA's go-gpuallocator",
        "naive": "naive = the lowest free indices",
        "score": "score = the sum over every two GPUs",
        "NVLink island": "NVLink island = GPUs that",
        "NVLink clique": "NVLink clique = GPUs",
        "NUMA": "NUMA group = GPUs",
        "single-NUMA": "1: single-NUMA",
        "NFD": "NFD (Node Feature Discovery)",
        "ListAndWatch": "ListAndWatch is its stream",
        "stand-in kubelet": "stand-in kubelet (an",
        "dcgm-exporter": "dcgm-exporter's (NVIDIA's GPU metrics exporter)",
        "placement quality": "placement quality 1.0 = ",
    }
    flat = " ".join(out.split())  # explanations are wrapped
    for term, explanation in explained.items():
        assert explanation in flat, term
        assert flat.index(term) >= flat.index(explanation) - len(term) - 5, (
            f"{term!r} is used before it is explained"
        )


class FakeClient:
    """GetPreferredAllocation and a container's start (Allocate) as the lowest free IDs, for
    the replay alone."""

    def preferred(self, available, must, size):
        return list(available[:size])

    def start_containers(self, ids):
        class Response:
            container_responses = [type("C", (), {"envs": {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}})()]

        return Response()


def replay(steps, machine="pcie-4gpu"):
    from agent.discovery import load_topology

    topology = load_topology(machine)
    devices = [Device(ID=g.uuid, health="Healthy") for g in topology.gpus]
    lines: list[str] = []
    node = BusyNode(topology, devices, FakeClient(), lines.append, lambda _: None)
    for step in steps:
        node.play(step)
    return node, lines


def test_a_waiting_pod_is_placed_once_enough_gpus_free_up_oldest_first():
    node, lines = replay([
        Step("arrive", "a", 2), Step("arrive", "b", 2),
        Step("arrive", "big", 4), Step("arrive", "small", 1),
        Step("leave", "a"),          # 2 free: big (4) still waits, small (1) fits
        Step("leave", "b"),          # 3 free: big fits now
    ])
    events = [(r["event"], r["pod"]) for r in node.rows]
    assert events == [("arrive", "a"), ("arrive", "b"), ("wait", "big"), ("wait", "small"),
                      ("leave", "a"), ("arrive", "small"), ("leave", "b")]
    placed = [r["pod"] for r in node.rows if r["event"] == "arrive" and r["waited"]]
    assert placed == ["small"], "small fitted after a left; big needs 4 and only 3 are free"
    assert node.still_waiting() == [{"pod": "big", "size": 4, "free": 3}]
    node.play(Step("leave", "small"))
    assert [r["pod"] for r in node.rows if r["event"] == "arrive" and r["waited"]] == ["small", "big"]
    assert node.still_waiting() == []
    assert any(line.startswith("* big (4)") for line in lines)


def test_a_pod_that_leaves_while_waiting_says_how_many_gpus_it_never_got():
    node, lines = replay([Step("arrive", "a", 4), Step("arrive", "b", 2), Step("leave", "b")])
    assert node.rows[-1] == {"event": "gives up", "pod": "b", "size": 2, "most_free": 0}
    assert "gives up waiting: 2 GPUs asked, at most 0 were free" in lines[-1]


def test_pods_still_waiting_at_the_end_are_named_with_the_reason():
    out, _ = demo("single-gpu", "table")
    assert "infer-12 still waiting at the end: 1 GPU asked, 0 free" in out
    assert "* infer-5 (1)" in out, "a waiting pod is placed when the GPU frees up"
    facts = json.loads(demo("single-gpu", "json")[0])
    assert {"pod": "infer-12", "size": 1, "free": 0} in facts["still_waiting"]


def test_on_standard_input_the_suggested_command_reads_standard_input_too(monkeypatch, capsys):
    matrix = (TOPO / "l40s-4gpu-2socket-2nic.txt").read_bytes()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(matrix)))
    assert cli.main(["demo", "--simulate", "-"]) == 0
    out = capsys.readouterr().out
    assert "== Topology of standard input" in out
    command = re.search(r"Next: `([^`]+)`", out)
    assert command and "gta-stdin" not in out
    argv = shlex.split(command.group(1))[1:]
    assert argv[argv.index("--simulate") + 1] == "-"
    assert "(with the same input on standard input)" in out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(matrix)))
    assert cli.main(argv) == 0


# ---------------------------------------------------------------- one GPU, two pods
SHARED = "== One GPU, two pods: time-slicing and per-pod use"
MPS = "== One GPU, two pods: MPS"
SERIES_RE = re.compile(r'^(\w+)\{gpu="(\d+)",pod="(\w+)",container="(\w+)"\} ([\d.]+)$')


def test_the_demo_shows_two_pods_on_one_time_sliced_gpu_with_their_own_figures(capsys):
    assert cli.main(["demo", "--simulate", "pcie-4gpu"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    section = out.split(SHARED, 1)[1].split(MPS, 1)[0]
    got = re.findall(r"demo/(\w+) +container (\w+) +got (GPU-[0-9a-f-]+)::(\d)", section)
    assert [(pod, container) for pod, container, _, _ in got] == \
        [("trainer", "main"), ("notebook", "jupyter")]
    assert len({uuid for _, _, uuid, _ in got}) == 1, "both pods hold a replica of one GPU"
    assert {replica for *_, replica in got} == {"0", "1"}
    value: dict[tuple[str, str], float] = {}
    gpus = set()
    for line in section.splitlines():
        m = SERIES_RE.match(line)
        if m:
            name, gpu, pod, _, v = m.groups()
            value[(name, pod)] = float(v)
            gpus.add(gpu)
    assert gpus == {"0"}
    for own, dcgm in (("gpu_agent_pod_sm_utilization_percent", "DCGM_FI_DEV_GPU_UTIL"),
                      ("gpu_agent_pod_framebuffer_used_mib", "DCGM_FI_DEV_FB_USED")):
        assert value[(own, "trainer")] != value[(own, "notebook")], f"{own}: each pod its own"
        assert value[(dcgm, "trainer")] == value[(dcgm, "notebook")], f"{dcgm}: the GPU's"
        assert value[(own, "trainer")] + value[(own, "notebook")] == value[(dcgm, "trainer")]
    flat = " ".join(section.split())
    assert "give every pod holding a shared GPU the whole GPU's figure" in flat


def test_the_demo_json_tells_the_same_shared_gpu_facts(capsys):
    assert cli.main(["demo", "--simulate", "dgx-a100", "--format", "json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    shared = facts["shared_gpu"]
    assert shared["replicas"] == 2 and shared["resource"] == "nvidia.com/gpu"
    assert shared["model"] == facts["topology"]["gpus"][0]["name"], "the machine's GPU model"
    trainer, notebook = shared["pods"]
    assert (trainer["pod"], notebook["pod"]) == ("trainer", "notebook")
    assert trainer["uuid"] == notebook["uuid"] and trainer["gpu"] == notebook["gpu"] == "0"
    assert trainer["device"] != notebook["device"]
    assert {p["device"] for p in shared["pods"]} == {trainer["uuid"] + "::0", trainer["uuid"] + "::1"}
    for own, dcgm in (("sm_util_pct", "dcgm_gpu_util_pct"), ("fb_used_mib", "dcgm_fb_used_mib")):
        assert trainer[own] != notebook[own]
        assert trainer[dcgm] == notebook[dcgm] == trainer[own] + notebook[own]
    assert {(m["name"], m["labels"]["pod"]) for m in shared["metrics"]} == {
        (name, pod) for name in ("gpu_agent_pod_sm_utilization_percent", "DCGM_FI_DEV_GPU_UTIL",
                                 "gpu_agent_pod_framebuffer_used_mib", "DCGM_FI_DEV_FB_USED")
        for pod in ("trainer", "notebook")
    }


# ---------------------------------------------------------------- one GPU, two pods, MPS


def test_the_demo_shows_an_mps_shared_gpu_advertised_once_its_daemon_answers(capsys):
    assert cli.main(["demo", "--simulate", "pcie-4gpu"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert out.index(SHARED) < out.index(MPS) < out.index("== Done"), "beside time-slicing"
    section = out.split(MPS, 1)[1].split("== Done", 1)[0]
    told = section.split("when the agent registered:", 1)[1].split("ListAndWatch", 1)[0]
    assert re.search(r"^  set_default_device_pinned_mem_limit 0 \d+M$", told, re.M)
    assert "  set_default_active_thread_percentage 50 -> 50.0" in told
    assert "  get_default_active_thread_percentage -> 50.0" in told, "it answered first"
    assert "ListAndWatch: 2 nvidia.com/gpu devices, 2 healthy" in section
    got = re.findall(r"demo/(\w+) +container \w+ +got (GPU-[0-9a-f-]+)::(\d)", section)
    assert [pod for pod, _, _ in got] == ["trainer", "notebook"]
    assert len({uuid for _, uuid, _ in got}) == 1 and {r for *_, r in got} == {"0", "1"}
    limit = re.search(r"set_default_device_pinned_mem_limit 0 (\d+M)", told).group(1)
    for line in ("  CUDA_MPS_PIPE_DIRECTORY=/mps/nvidia.com/gpu/pipe",
                 "  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
                 f"  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={limit}",
                 "  mount /mps/nvidia.com/gpu/pipe from <mpsRoot>/nvidia.com/gpu/pipe",
                 "  mount /dev/shm from <mpsRoot>/shm"):
        assert line in section.splitlines(), line


def test_the_demo_json_tells_what_an_mps_replica_gets(capsys):
    assert cli.main(["demo", "--simulate", "dgx-a100", "--format", "json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    mps = facts["mps"]
    gpu = facts["topology"]["gpus"][0]
    assert mps["model"] == gpu["name"] and mps["replicas"] == 2
    assert mps["resource"] == "nvidia.com/gpu" and mps["devices"] == mps["healthy"] == 2
    half = f"{gpu['memory_mib'] // 2}M"
    assert mps["daemon_told"] == [
        {"command": f"set_default_device_pinned_mem_limit 0 {half}", "answer": ""},
        {"command": "set_default_active_thread_percentage 50", "answer": "50.0"},
        {"command": "get_default_active_thread_percentage", "answer": "50.0"},
    ]
    trainer, notebook = mps["pods"]
    assert (trainer["pod"], notebook["pod"]) == ("trainer", "notebook")
    assert trainer["device"] != notebook["device"]
    assert trainer["device"].split("::")[0] == notebook["device"].split("::")[0]
    root = mps["mps_root"]
    for pod in mps["pods"]:
        envs = pod["envs"]
        assert envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu/pipe"
        assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={half}"
        assert envs["NVIDIA_VISIBLE_DEVICES"] == pod["device"].split("::")[0]
        assert {(m["container_path"], m["host_path"]) for m in pod["mounts"]} == {
            ("/mps/nvidia.com/gpu/pipe", f"{root}/nvidia.com/gpu/pipe"),
            ("/dev/shm", f"{root}/shm"),
        }


def test_the_demo_leaves_the_agents_log_lines_as_it_found_them(caplog):
    caplog.set_level(logging.INFO)  # as `run --log-level INFO` sets up the root logger
    demo("single-gpu", "json")
    caplog.clear()
    logging.getLogger("agent.daemon").info("after the demo")
    assert [r.getMessage() for r in caplog.records] == ["after the demo"], (
        "the demo quiets the agent while it tells its story, and only then")
