"""``gpu-topology-agent doctor`` through its command line: PASS on every built-in machine
(with a healthy stand-in kubelet directory), and the right FAIL or WARN line, exit code and
JSON for each fault the simulator and the stand-ins can inject."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from waiting import eventually

from agent.cli import main
from agent.hw.sim.machines import BUILTIN_MACHINES
from tests.testbed.kubelet_stub import KubeletStub, PodResourcesStub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What a simulated machine cannot show (no device nodes, no container toolkit): WARN, not FAIL.
SIMULATOR_WARNS = {"host.device_nodes", "host.container_toolkit"}
CONFIG_VARIABLES = ("CONFIG_FILE", "KUBECONFIG", "KUBERNETES_SERVICE_HOST", "MIG_STRATEGY", "AGENT_MODE",
                    "LABELS_SINK", "DEVICE_LIST_STRATEGY", "NODE_NAME")


@pytest.fixture(autouse=True)
def _no_agent_environment(monkeypatch):
    for var in CONFIG_VARIABLES:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def node(tmp_path):
    """A healthy stand-in kubelet: device-plugin dir with kubelet.sock, the pod-resources
    socket and a kubelet configuration file; yields the doctor flags pointing at them."""
    kubelet_dir = tmp_path / "device-plugins"
    kubelet = KubeletStub(str(kubelet_dir)).start()
    pod_resources = PodResourcesStub(str(tmp_path / "pod-resources.sock")).start()
    kubelet_config = tmp_path / "kubelet-config.yaml"
    kubelet_config.write_text(yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cpuManagerPolicy": "static", "topologyManagerPolicy": "best-effort"}))
    flags = ["--kubelet-dir", str(kubelet_dir), "--pod-resources-socket", str(tmp_path / "pod-resources.sock"),
             "--kubelet-config", str(kubelet_config), "--features-dir", str(tmp_path / "features.d"),
             "--cdi-dir", str(tmp_path / "cdi"), "--plugins-dir", str(tmp_path / "plugins"),
             "--plugins-registry-dir", str(tmp_path)]
    yield flags
    pod_resources.stop()
    kubelet.stop()


def doctor(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["doctor", "--format", "json", *args])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def by_check(report: dict) -> dict[str, dict]:
    return {c["check"]: c for c in report["checks"]}


def spec_file(tmp_path, **faults) -> str:
    """A 4-GPU machine (two NVLinked pairs) with ``faults``."""
    spec = {
        "name": "faulty", "driver_version": "550.54.15", "cuda_driver_version": 12040,
        "numa_nodes": {0: {"cpus": "0-15", "distances": [10, 20]}, 1: {"cpus": "16-31", "distances": [20, 10]}},
        "gpu_defaults": {"model": "NVIDIA A100-SXM4-80GB"},
        "gpus": [{"bus_id": f"0000:{b:02x}:00.0", "numa_node": i // 2, "host_bridge": f"pci0000:{b:02x}"}
                 for i, b in enumerate((0x17, 0x31, 0x97, 0xb1))],
        "nvlink": {"pairs": [[0, 1, 12], [2, 3, 12]]},
        "faults": faults,
    }
    path = tmp_path / "faulty.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


# ---------------------------------------------------------------- healthy machines
@pytest.mark.parametrize("machine", BUILTIN_MACHINES)
def test_doctor_passes_on_every_built_in_machine(capsys, node, machine):
    extra = ["--mig-strategy", "mixed"] if machine == "a100-mig" else []
    rc, report = doctor(capsys, "--simulate", machine, *node, *extra)
    checks = by_check(report)
    assert rc == 0 and report["exit_code"] == 0, report
    assert report["summary"]["fail"] == 0
    warned = {name for name, c in checks.items() if c["status"] == "WARN"}
    assert warned <= SIMULATOR_WARNS, [checks[n] for n in warned - SIMULATOR_WARNS]
    assert all("simulated machine" in checks[n]["found"] for n in warned)
    assert checks["kubelet.socket"]["status"] == "PASS" and "answers" in checks["kubelet.socket"]["found"]
    assert checks["kubelet.pod_resources"]["status"] == "PASS"


def test_the_table_is_one_line_per_check_with_what_to_do_when_not_pass(capsys, node):
    rc = main(["doctor", "--simulate", "single-gpu", *node])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert lines[0].startswith("PASS  nvml.library") and "driver 550" in lines[0]
    warn = next(line for line in lines if line.startswith("WARN  host.device_nodes"))
    assert " -> run without --simulate" in warn
    assert lines[-1].startswith("doctor: ") and " 0 FAIL in " in lines[-1]


# ---------------------------------------------------------------- NVML faults
def test_a_lost_gpu_fails_naming_the_gpu_and_its_bus_id(capsys, node, tmp_path):
    rc, report = doctor(capsys, "--simulate", spec_file(tmp_path, lost_gpus=[2]), *node)
    check = by_check(report)["nvml.gpus"]
    assert rc == 1 and report["exit_code"] == 1
    assert check["status"] == "FAIL"
    assert "GPU 2 (00000000:97:00.0 per sysfs) lost" in check["found"]
    assert "reset" in check["action"]


def test_a_critical_xid_fails_and_an_application_xid_warns(capsys, node, tmp_path):
    rc, report = doctor(capsys, "--simulate", spec_file(tmp_path, xids=[{"gpu": 1, "xid": 79}]), *node)
    check = by_check(report)["nvml.health"]
    assert rc == 1 and check["status"] == "FAIL" and "critical XID 79 on GPU 1" in check["found"]
    rc, report = doctor(capsys, "--simulate", spec_file(tmp_path, xids=[{"gpu": 3, "xid": 13}]), *node)
    check = by_check(report)["nvml.health"]
    assert rc == 0 and check["status"] == "WARN" and "application XID 13 on GPU 3" in check["found"]


def test_mig_mode_against_the_strategy(capsys, node):
    rc, report = doctor(capsys, "--simulate", "a100-mig", "--mig-strategy", "single", *node)
    check = by_check(report)["nvml.mig"]
    assert rc == 1 and check["status"] == "FAIL"
    assert "migStrategy single: GPUs [2] have MIG disabled" in check["found"] and "mixed" in check["action"]
    rc, report = doctor(capsys, "--simulate", "a100-mig", "--mig-strategy", "none", *node)
    check = by_check(report)["nvml.mig"]
    assert rc == 0 and check["status"] == "WARN" and "MIG enabled on GPUs [0, 1, 3]" in check["found"]


def test_nvml_that_does_not_load_fails_once_and_the_checks_needing_it_say_so(capsys, node, tmp_path):
    rc, report = doctor(capsys, "--simulate", spec_file(tmp_path, init_error="driver_not_loaded"), *node)
    checks = by_check(report)
    assert rc == 1
    assert checks["nvml.library"]["status"] == "FAIL"
    assert "the NVIDIA kernel driver is not loaded" in checks["nvml.library"]["found"]
    for name in ("nvml.gpus", "nvml.health", "nvml.mig", "host.sysfs"):
        assert checks[name]["status"] == "WARN" and "see nvml.library" in checks[name]["found"], name


# ---------------------------------------------------------------- kubelet faults
def test_a_missing_kubelet_socket_fails(capsys, node, tmp_path):
    empty = tmp_path / "no-kubelet"
    empty.mkdir()
    flags = [*node, "--kubelet-dir", str(empty)]
    rc, report = doctor(capsys, "--simulate", "single-gpu", *flags)
    check = by_check(report)["kubelet.socket"]
    assert rc == 1 and check["status"] == "FAIL"
    assert check["found"] == f"{empty}/kubelet.sock does not exist"
    assert "kubelet is not running" in check["action"]


LISTENER = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(8)
print("listening", flush=True)
time.sleep(60)
"""


def test_a_socket_of_the_agents_resource_held_by_another_server_fails(capsys, node, tmp_path):
    path = os.path.join(node[1], "nvidia-gpu.sock")  # NVIDIA's device plugin's name for nvidia.com/gpu
    program = tmp_path / "nvidia-device-plugin"
    program.write_text(LISTENER)
    other = subprocess.Popen([sys.executable, str(program), path], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "listening"
        rc, report = doctor(capsys, "--simulate", "single-gpu", *node)
    finally:
        other.kill()
        other.wait()
        other.stdout.close()
    check = by_check(report)["kubelet.other_plugins"]
    assert rc == 1 and check["status"] == "FAIL"
    assert f"nvidia-gpu.sock (nvidia.com/gpu) by pid {other.pid}" in check["found"]
    assert "nvidia-device-plugin" in check["found"]


def test_the_agent_serving_its_own_sockets_passes(capsys, node, tmp_path):
    from agent_run import AgentRun

    agent = AgentRun(["--simulate", "pcie-pairs", "--kubelet-dir", node[1], "--metrics-address", "127.0.0.1:0",
                      "--features-dir", str(tmp_path / "features.d")], str(tmp_path / "agent.log"))
    try:
        assert eventually(lambda: os.path.exists(os.path.join(node[1], "nvidia-gpu.sock")), timeout_s=30)
        rc, report = doctor(capsys, "--simulate", "pcie-pairs", *node)
    finally:
        agent.stop()
    check = by_check(report)["kubelet.other_plugins"]
    assert check["status"] == "PASS" and f"nvidia-gpu.sock served by the agent (pid {agent.proc.pid})" in check["found"]
    assert rc == 0


def test_single_numa_node_warns_about_requests_larger_than_one_numa_node(capsys, node, tmp_path):
    config = tmp_path / "single-numa.yaml"
    config.write_text("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
                      "topologyManagerPolicy: single-numa-node\n")
    rc, report = doctor(capsys, "--simulate", "dgx-h100", *node, "--kubelet-config", str(config))
    check = by_check(report)["kubelet.config"]
    assert rc == 0 and check["status"] == "WARN"
    assert "span 2 NUMA nodes" in check["found"] and "more than 4 GPUs" in check["action"]


def test_an_unwritable_cdi_directory_fails_in_dra_mode(capsys, node, tmp_path):
    not_a_dir = tmp_path / "cdi-file"
    not_a_dir.write_text("")
    rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--mode", "dra", "--cdi-dir", str(not_a_dir))
    check = by_check(report)["dra.directories"]
    assert rc == 1 and check["status"] == "FAIL" and "is not a directory" in check["found"]


@contextlib.contextmanager
def as_unprivileged_user():
    """Root writes anywhere: while root, the real user id becomes nobody's (the effective
    one stays root, to give it back), so that access checks answer as for a non-root agent."""
    if os.getuid() != 0:
        yield
        return
    os.setreuid(65534, 0)
    try:
        yield
    finally:
        os.setreuid(0, 0)


def test_a_cdi_directory_this_user_cannot_write_fails(capsys, node):
    top = tempfile.mkdtemp(prefix="doctor-dra-")  # pytest's own tmp dirs are root's alone (0700)
    try:
        os.chmod(top, 0o755)
        for name, mode in (("registry", 0o777), ("plugins", 0o777), ("cdi", 0o555)):
            os.mkdir(os.path.join(top, name))
            os.chmod(os.path.join(top, name), mode)
        cdi = os.path.join(top, "cdi")
        with as_unprivileged_user():
            rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--mode", "dra", "--cdi-dir", cdi,
                                "--plugins-registry-dir", os.path.join(top, "registry"),
                                "--plugins-dir", os.path.join(top, "plugins"))
    finally:
        shutil.rmtree(top)
    check = by_check(report)["dra.directories"]
    assert rc == 1 and check["status"] == "FAIL"
    assert check["found"] == f"--cdi-dir {cdi}: {cdi} is not writable by this user"


# ---------------------------------------------------------------- usage
def test_bad_usage_exits_2_with_one_line(capsys):
    assert main_exit(["doctor", "--format", "xml"]) == 2
    assert main_exit(["doctor", "--health-recovery-s", "-5", "--simulate", "single-gpu"]) == 2
    err = capsys.readouterr().err
    assert "health" in err and "Traceback" not in err


def main_exit(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_a_bad_config_file_is_a_finding_not_a_usage_error(capsys, node, tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("version: v1\nflags:\n  migStrategy: sometimes\n")
    rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--config", str(bad))
    check = by_check(report)["config.file"]
    assert rc == 1 and check["status"] == "FAIL" and str(bad) in check["found"] and "migStrategy" in check["found"]
    assert by_check(report)["nvml.gpus"]["status"] == "PASS"  # the rest still ran


TIME_SLICED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {{name: nvidia.com/gpu, replicas: {replicas}{rename}}}\n"


def gpu_in_compute_mode(tmp_path, mode: str) -> str:
    """The 4-GPU machine with GPU 1 in compute ``mode``."""
    with open(spec_file(tmp_path), encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    spec["gpus"][1]["compute_mode"] = mode
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def time_sliced(tmp_path, replicas: int, rename: str = "") -> str:
    config = tmp_path / f"time-sliced-{replicas}{rename}.yaml"
    config.write_text(TIME_SLICED.format(replicas=replicas, rename=f", rename: {rename}" if rename else ""))
    return str(config)


def agent_error(stderr: str, command: str) -> str:
    """The one error line of a refusing agent command, without its prefix."""
    prefix = f"gpu-topology-agent {command}: error: "
    [line] = [line for line in stderr.splitlines() if line.startswith(prefix)]
    return line[len(prefix):]


def test_a_time_sliced_gpu_in_exclusive_compute_mode_stops_the_agent_and_doctor_fails_with_its_words(
        capsys, node, tmp_path):
    machine, config = gpu_in_compute_mode(tmp_path, "Exclusive_Process"), time_sliced(tmp_path, 4)
    at = node.index("--kubelet-config")  # doctor's own flag
    agent = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--simulate", machine, "--config", config, *node[:at], *node[at + 2:],
         "--metrics-address", "127.0.0.1:0", "--log-level", "error"],
        cwd=ROOT, capture_output=True, text=True, timeout=30)
    refused = agent_error(agent.stderr, "run")
    assert agent.returncode == 2, agent.stderr
    assert "sharing.timeSlicing.resources[0]: GPU 1 is shared but its compute mode is Exclusive_Process" in refused
    rc, report = doctor(capsys, "--simulate", machine, *node, "--config", config)
    check = by_check(report)["config.sharing"]
    assert rc == 1 and check["status"] == "FAIL"
    assert check["found"] == f"the agent refuses the sharing settings: {refused}"


def test_doctor_and_the_agent_agree_on_the_compute_modes_time_slicing_refuses(capsys, node, tmp_path):
    answers = {}
    for mode, replicas, rename in (("Default", 4, ""), ("Exclusive_Process", 4, ""), ("Prohibited", 4, ""),
                                   ("Exclusive_Thread", 1, "gpu-whole")):
        machine, config = gpu_in_compute_mode(tmp_path, mode), time_sliced(tmp_path, replicas, rename)
        resource = f"nvidia.com/{rename}" if rename else "nvidia.com/gpu"
        served = main(["allocate", "--simulate", machine, "--config", config, "--resource", resource,
                       "--size", "1"])
        err = capsys.readouterr().err
        _, report = doctor(capsys, "--simulate", machine, *node, "--config", config)
        check = by_check(report)["config.sharing"]
        if served == 0:
            assert check["status"] == "PASS", (mode, check)
        else:
            assert check == {**check, "status": "FAIL",
                             "found": f"the agent refuses the sharing settings: {agent_error(err, 'allocate')}"}
        answers[mode] = check["status"]
    # one replica is one container at a time: any compute mode serves it
    assert answers == {"Default": "PASS", "Exclusive_Process": "FAIL", "Prohibited": "FAIL",
                       "Exclusive_Thread": "PASS"}


def test_mps_without_its_control_program_fails(capsys, node, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nsharing:\n  mps:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 2}\n")
    rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--config", str(config),
                        "--mps-control-binary", str(tmp_path / "no-such-mps-control"))
    check = by_check(report)["config.sharing"]
    assert rc == 1 and check["status"] == "FAIL" and "no-such-mps-control is not there" in check["found"]


def test_a_required_imex_channel_that_does_not_exist_fails(capsys, node):
    rc, report = doctor(capsys, "--simulate", "gb200-tray", *node, "--imex-channel-ids", "0", "--imex-required")
    check = by_check(report)["config.imex"]
    assert rc == 1 and check["status"] == "FAIL" and "IMEX channels [0]" in check["found"]


def test_a_check_that_hangs_is_a_warn_at_its_timeout():
    from agent.config import Config
    from agent.doctor.context import DoctorContext
    from agent.doctor.report import Check, passed, run_checks

    context = DoctorContext(Config(), simulate="single-gpu", env={}, kubelet_config="/nonexistent")
    started = time.monotonic()
    outcomes = run_checks([Check("slow", lambda c: time.sleep(5) or passed("late"), timeout_s=0.2),
                           Check("quick", lambda c: passed("done"))], context)
    assert time.monotonic() - started < 4  # not the hung check's 5 s: it was not waited for
    assert [(o.check, o.result.status) for o in outcomes] == [("slow", "WARN"), ("quick", "PASS")]
    assert outcomes[0].result.found == "did not finish within 0.2 s"


def test_a_check_that_raises_is_a_warn_saying_why():
    from agent.config import Config
    from agent.doctor.context import DoctorContext
    from agent.doctor.report import Check, run_checks

    def broken(context):
        raise OSError(5, "Input/output error")

    context = DoctorContext(Config(), simulate="single-gpu", env={}, kubelet_config="/nonexistent")
    [outcome] = run_checks([Check("broken", broken)], context)
    assert outcome.result.status == "WARN"
    assert outcome.result.found == "could not run: OSError: [Errno 5] Input/output error"


# ---------------------------------------------------------------- cluster (stand-in API server)
NS = "gpu-topology-agent"


def kubeconfig(tmp_path, api, token: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


def serve(objects, **kw):
    from tests.testbed.apiserver_auth import Access, service_account
    from tests.testbed.apiserver_stub import ApiServerStub

    access = Access(objects)
    access.add_token("node-1-agent", service_account(NS, "gpu-topology-agent", "node-1"))
    return ApiServerStub(access=access, **kw).start()


def cluster_checks(report: dict) -> dict[str, tuple[str, str]]:
    return {c["check"]: (c["status"], c["found"]) for c in report["checks"] if c["check"].startswith("cluster.")}


def test_the_nodefeature_sink_with_the_charts_rbac_passes(capsys, node, tmp_path):
    from tests.testbed.apiserver_auth import load_variant

    api = serve(load_variant("nodefeature"))
    try:
        rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--labels-sink", "nodefeature",
                            "--kubeconfig", kubeconfig(tmp_path, api, "node-1-agent"), "--pod-namespace", NS)
    finally:
        api.stop()
    checks = cluster_checks(report)
    assert rc == 0, report
    assert checks["cluster.api_server"][0] == "PASS" and "v1.37.0 reachable" in checks["cluster.api_server"][1]
    assert checks["cluster.access"] == ("PASS", "all 4 verbs the agent needs are allowed")
    assert checks["cluster.nodefeature_crd"] == ("PASS", "nfd.k8s-sigs.io/v1alpha1 nodefeatures served")
    assert api.count("POST", "selfsubjectaccessreviews") == 4
    assert not api.nodefeatures()  # read-only: nothing written


def test_a_forbidden_verb_fails_naming_it(capsys, node, tmp_path):
    from tests.testbed.apiserver_auth import load_variant

    objects = load_variant("nodefeature")
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"][0]["verbs"] = [v for v in role["rules"][0]["verbs"] if v != "delete"]
    api = serve(objects)
    try:
        rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--labels-sink", "nodefeature",
                            "--kubeconfig", kubeconfig(tmp_path, api, "node-1-agent"), "--pod-namespace", NS)
    finally:
        api.stop()
    check = by_check(report)["cluster.access"]
    assert rc == 1 and check["status"] == "FAIL"
    assert check["found"] == f"the agent's identity may not: delete nodefeatures.nfd.k8s-sigs.io in {NS}"


def test_nfd_not_installed_fails_for_the_nodefeature_sink(capsys, node, tmp_path):
    from tests.testbed.apiserver_auth import load_variant

    api = serve(load_variant("nodefeature"), nfd_installed=False)
    try:
        rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--labels-sink", "nodefeature",
                            "--kubeconfig", kubeconfig(tmp_path, api, "node-1-agent"), "--pod-namespace", NS)
    finally:
        api.stop()
    assert rc == 1 and cluster_checks(report)["cluster.nodefeature_crd"][0] == "FAIL"


@pytest.mark.parametrize("gate_off", [False, True])
def test_dra_mode_reads_back_partitionable_devices_with_a_dry_run(capsys, node, tmp_path, gate_off):
    from tests.testbed.apiserver_auth import load_variant

    api = serve(load_variant("dra"), disabled_features={"DRAPartitionableDevices"} if gate_off else ())
    try:
        rc, report = doctor(capsys, "--simulate", "dgx-h100", *node, "--mode", "dra", "--node-name", "node-1",
                            "--kubeconfig", kubeconfig(tmp_path, api, "node-1-agent"))
    finally:
        api.stop()
    checks = cluster_checks(report)
    # 8 for DRA, 5 for the GPUHealthy condition (auto, with a node name): nodes/status, events
    assert checks["cluster.access"] == ("PASS", "all 13 verbs the agent needs are allowed")
    assert checks["cluster.resource_api"][0] == "PASS" and "publishes v1" in checks["cluster.resource_api"][1]
    assert api.count("POST", "/resourceslices") == 1 and not api.slices()  # a dry run: nothing stored
    assert api.count("GET", "/apis/resource.k8s.io") == 1  # the served versions: discovered once per run
    if gate_off:
        assert rc == 1 and checks["cluster.partitionable_devices"][0] == "FAIL"
        assert "DRAPartitionableDevices is off" in checks["cluster.partitionable_devices"][1]
    else:
        assert rc == 0, report
        assert checks["cluster.partitionable_devices"][0] == "PASS"


def test_an_unreachable_api_server_fails_when_the_agent_needs_it(capsys, node, tmp_path):
    from tests.testbed.apiserver_auth import load_variant

    api = serve(load_variant("dra"))
    config = kubeconfig(tmp_path, api, "node-1-agent")
    api.stop()
    rc, report = doctor(capsys, "--simulate", "single-gpu", *node, "--mode", "dra", "--node-name", "node-1",
                        "--kubeconfig", config)
    status, found = cluster_checks(report)["cluster.api_server"]
    assert rc == 1 and status == "FAIL" and found.startswith("API server not reachable")


def test_the_verbs_doctor_asks_for_are_what_the_manifests_grant():
    from agent.doctor.cluster import (
        DRA_ACCESS,
        NODE_ACCESS,
        NODE_CONDITION_ACCESS,
        NODE_EVENTS_ACCESS,
        NODEFEATURE_ACCESS,
    )
    from tests.testbed.apiserver_auth import load_variant

    def granted(variant: str, kind: str) -> set[tuple[str, str]]:
        rules = [r for o in load_variant(variant) if o["kind"] == kind for r in o["rules"]]
        return {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}

    assert granted("dra", "ClusterRole") == set(DRA_ACCESS) | set(NODE_ACCESS) | set(NODE_CONDITION_ACCESS)
    assert granted("nodefeature", "ClusterRole") == set(NODE_CONDITION_ACCESS)
    assert granted("nodefeature", "Role") == set(NODEFEATURE_ACCESS) | set(NODE_EVENTS_ACCESS)
    assert {o["metadata"]["namespace"] for o in load_variant("dra") if o["kind"] == "Role"} == {"default"}


def test_an_nvlink_down_fails_naming_the_gpu(capsys, node, tmp_path):
    with open(spec_file(tmp_path), encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    spec["nvlink"]["pairs"] = [[0, 1, 12], [2, 3, 8]]  # GPUs 2 and 3: 4 of their 12 links inactive
    path = tmp_path / "link-down.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc, report = doctor(capsys, "--simulate", str(path), *node)
    check = by_check(report)["nvml.nvlink"]
    assert rc == 1 and check["status"] == "FAIL"
    assert check["found"] == ("GPU 2 has 8 of the 12 NVLinks its peers have active,"
                              " GPU 3 has 8 of the 12 NVLinks its peers have active")


def test_per_node_configs_resolve_as_the_agent_starts_with_them(capsys, node, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "default").write_text("version: v1\nflags:\n  migStrategy: mixed\n")
    (configs / "broken").write_text("version: v1\nflags:\n  migStrategy: sometimes\n")
    rc, report = doctor(capsys, "--simulate", "a100-mig", *node, "--config-file-srcdir", str(configs),
                        "--node-name", "node-1")
    check = by_check(report)["config.file"]
    failing = {c["check"] for c in report["checks"] if c["status"] == "FAIL"}
    assert rc == 1 and failing == {"cluster.api_server"}  # the label is read through the API server
    assert check["status"] == "PASS"
    assert check["found"].startswith(f"per-node config 'default' from {configs} (label unknown: API server not"
                                     " reachable, the default choice): migStrategy mixed")
    assert by_check(report)["nvml.mig"]["status"] == "PASS"  # the other checks use that config
    rc, report = doctor(capsys, "--simulate", "a100-mig", *node, "--config-file-srcdir", str(configs),
                        "--node-name", "node-1", "--default-config", "broken")
    check = by_check(report)["config.file"]
    assert rc == 1 and check["status"] == "FAIL" and "broken" in check["found"] and "migStrategy" in check["found"]


def test_the_node_label_picks_the_per_node_config_through_the_api_server(capsys, node, tmp_path):
    from tests.testbed.apiserver_stub import ApiServerStub

    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "default").write_text("version: v1\nflags:\n  migStrategy: mixed\n")
    (configs / "broken").write_text("version: v1\nflags:\n  migStrategy: sometimes\n")
    api = ApiServerStub().start()
    api.add_node("node-1", labels={"nvidia.com/device-plugin.config": "broken"})
    try:
        rc, report = doctor(capsys, "--simulate", "a100-mig", *node, "--config-file-srcdir", str(configs),
                            "--node-name", "node-1", "--kubeconfig", kubeconfig(tmp_path, api, "any"))
    finally:
        api.stop()
    check = by_check(report)["config.file"]
    assert rc == 1 and check["status"] == "FAIL"
    assert str(configs / "broken") in check["found"] and "migStrategy" in check["found"]
