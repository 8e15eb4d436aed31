"""Harness cases of the conformance tier and how they run (the hooks are in conftest.py).

The installed agent against the kubelet's device manager and topology manager (Kubernetes
v1.32), through one of two backends (:data:`BACKENDS`), every test body against both:

- ``standin``: ``tests/dmharness_standin.py``, a Python stand-in for the two managers, run
  everywhere (CI included);
- ``dmharness``: the real managers, ``dmharness`` in the directory ``$GPU_AGENT_K8S_BINARIES``
  names (``tests/k8s_binaries.py``); its tests skip, saying why, where it is unset.

Both take the same command line and write the same JSON summary.

Every harness run ("case") is declared once in :data:`CASES`. Tests name the cases they
read with ``@pytest.mark.parametrize("case", [...])`` (or ``@pytest.mark.cases(...)``);
when collection is done, the cases the selected tests need are all started at once, at
most :data:`PARALLEL` at a time, and each test waits only for its own summaries. A harness
run takes a few seconds, mostly waiting.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from k8s_binaries import k8s_binary, missing_reason

DMHARNESS = k8s_binary("dmharness")
STANDIN = Path(__file__).resolve().parents[1] / "dmharness_standin.py"
#: the stand-in always, the real managers where GPU_AGENT_K8S_BINARIES has them
BACKENDS = ("standin", "dmharness")
#: the console script of the installed agent (next to the interpreter running the tests)
AGENT = Path(sys.executable).parent / "gpu-topology-agent"
PARALLEL = 4
RUN_TIMEOUT_S = 120

POLICIES = ("none", "best-effort", "restricted", "single-numa-node")
SCOPES = ("container", "pod")
#: built-in machine -> (NUMA node count for the harness, pod sizes)
MACHINES = {
    "single-gpu": (1, "1,1"),  # one NUMA node, one GPU
    "dgx-h100": (2, "1,2,4,1,2"),  # two NUMA nodes, 4 GPUs each
    "dgx-a100": (8, "1,2,4,1,2"),  # eight NUMA nodes, GPUs in pairs on 1, 3, 5, 7
}


def builtin_spec(name: str) -> dict[str, Any]:
    """The machine spec of built-in machine ``name`` as a mapping (to derive test machines)."""
    import agent

    path = next(Path(agent.__file__).parent.rglob(f"{name}.yaml"))
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _numa_unknown_for_gpu_7() -> dict[str, Any]:
    spec = builtin_spec("dgx-h100")
    spec["name"] = "dgx-h100-numa-hole"
    spec["gpus"][7]["numa_node"] = None
    return spec


def _lost_gpu_3() -> dict[str, Any]:
    spec = builtin_spec("dgx-h100")
    spec["name"] = "dgx-h100-lost-3"
    spec["faults"] = {"lost_gpus": [3]}
    return spec


def _mig_single() -> dict[str, Any]:
    spec = builtin_spec("a100-mig")
    spec["name"] = "a100-mig-single"
    for gpu in spec["gpus"]:
        gpu["mig"] = ["3g.20gb", "3g.20gb"]
    return spec


def _plugin_config(**plugin: object) -> dict[str, Any]:
    return {"version": "v1", "flags": {"plugin": plugin}}


@dataclass(frozen=True)
class Case:
    """One dmharness run: a machine (built-in name, or a spec mapping written to a file),
    the topology manager's settings, pods to admit, and the agent's configuration."""

    machine: str | None = "dgx-h100"
    spec: dict[str, Any] | None = None
    numa: int = 2
    policy: str = "single-numa-node"
    scope: str = "container"
    sizes: str = "1,2,4,1,2"
    resource: str = "nvidia.com/gpu"
    config: dict[str, Any] | None = None
    agent_first: str | None = None
    #: run the agent with relative paths, from the case's directory as working directory
    relative_paths: bool = False
    extra: tuple[str, ...] = field(default=())


CASES: dict[str, Case] = {}
for _machine, (_numa, _sizes) in MACHINES.items():
    for _policy in POLICIES:
        for _scope in SCOPES:
            CASES[f"{_policy}/{_scope}/{_machine}"] = Case(
                machine=_machine, numa=_numa, policy=_policy, scope=_scope, sizes=_sizes
            )
for _strategy in ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri"):
    CASES[f"strategy/{_strategy}"] = Case(
        sizes="1,2,4", config=_plugin_config(deviceListStrategy=[_strategy])
    )
CASES["strategy/all-with-device-specs"] = Case(
    sizes="1,2,4",
    config=_plugin_config(
        deviceListStrategy=["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"], passDeviceSpecs=True
    ),
)
CASES["time-slicing"] = Case(
    sizes="1,2,4,1,2",
    config={"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}},
)
CASES["mig/single"] = Case(
    machine=None, spec=_mig_single(), sizes="1,2,4,1", config={"version": "v1", "flags": {"migStrategy": "single"}}
)
CASES["mig/mixed/1g.5gb"] = Case(
    machine="a100-mig", sizes="1,2,4,1", resource="nvidia.com/mig-1g.5gb",
    config={"version": "v1", "flags": {"migStrategy": "mixed"}},
)
CASES["mig/mixed/gpu"] = Case(
    machine="a100-mig", sizes="1,1", resource="nvidia.com/gpu",
    config={"version": "v1", "flags": {"migStrategy": "mixed"}},
)
CASES["agent-first"] = Case(agent_first="5s")  # long enough for a loaded machine to have the agent up and waiting
CASES["agent-first/pod-scope/eight-numa"] = Case(machine="dgx-a100", numa=8, scope="pod", agent_first="5s")
CASES["defect/lost-gpu-at-start"] = Case(machine=None, spec=_lost_gpu_3(), sizes="1,1,1,1,1,1,1,1")
CASES["defect/numa-unknown-for-one-gpu"] = Case(machine=None, spec=_numa_unknown_for_gpu_7(), sizes="1,2,3,1")
CASES["defect/relative-paths"] = Case(relative_paths=True, sizes="1")


# ----------------------------------------------------------------------------- running


@dataclass
class Run:
    """What one harness run left: exit status, its output, the JSON summary, the agent log."""

    name: str
    case: Case
    backend: str
    workdir: str
    returncode: int
    output: str
    summary: dict[str, Any]
    agent_log: str

    def describe(self) -> str:
        return (
            f"case {self.name} on {self.backend} (harness exit {self.returncode}; files in {self.workdir})\n"
            f"--- harness output (tail)\n{self.output[-4000:]}\n--- agent log (tail)\n{self.agent_log[-3000:]}"
        )


def _command(case: Case, work: str, backend: str = "dmharness") -> tuple[list[str], str | None]:
    """The harness command line (``backend``'s) and the working directory to run it in."""
    machine = case.machine
    if case.spec is not None:
        machine = os.path.join(work, "machine.yaml")
        Path(machine).write_text(yaml.safe_dump(case.spec), encoding="utf-8")
    assert machine is not None
    agent = [str(AGENT), "run", "--simulate", machine, "--kubelet-dir", "{DIR}",
             "--metrics-address", "127.0.0.1:0", "--node-name", "n"]
    if case.relative_paths:
        agent += ["--features-dir", "feat", "--pod-resources-socket", "podres/kubelet.sock"]
    else:
        agent += ["--features-dir", f"{work}/feat", "--pod-resources-socket", f"{work}/podres.sock"]
    if case.config is not None:
        Path(work, "config.yaml").write_text(yaml.safe_dump(case.config), encoding="utf-8")
        agent += ["--config", "config.yaml" if case.relative_paths else f"{work}/config.yaml"]
    agent += list(case.extra)
    program = [sys.executable, str(STANDIN)] if backend == "standin" else [str(DMHARNESS)]
    harness = [*program, "-dir", f"{work}/d", "-log", f"{work}/h.log", "-json", f"{work}/s.json",
               "-policy", case.policy, "-scope", case.scope, "-numa", str(case.numa), "-sizes", case.sizes,
               "-resource", case.resource, "-timeout", "60s"]
    if case.agent_first:
        harness += ["-agent-first", case.agent_first]
    return harness + ["--"] + agent, work if case.relative_paths else None


#: The environment the harness runs get: the one at collection, before any test ran (they run
#: in background threads while other tests of this process set variables of their own).
_ENVIRON = dict(os.environ)


def run_case(name: str, case: Case, backend: str) -> Run:
    # unix socket paths must stay under 108 bytes: a short directory right under /tmp
    work = tempfile.mkdtemp(dir="/tmp", prefix="c")
    command, cwd = _command(case, work, backend)
    try:
        proc = subprocess.run(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=RUN_TIMEOUT_S, check=False, env=_ENVIRON,
        )
        returncode, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        returncode, output = -1, f"timed out after {RUN_TIMEOUT_S} s\n{exc.output or ''}"
    try:
        summary = json.loads(Path(work, "s.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    try:
        agent_log = Path(work, "h.log.agent").read_text(encoding="utf-8", errors="replace")
    except OSError:
        agent_log = ""
    return Run(name, case, backend, work, returncode, output, summary, agent_log)


@dataclass(frozen=True)
class SharedRuns:
    """Where the xdist workers of one test run share their harness runs, so that each case
    runs once per run, not once per worker (every worker collects every test, and a case's
    tests may land on any worker): the first worker to claim a case runs it and leaves its
    :class:`Run` there, the others wait for it. The last worker to finish removes the runs'
    directories (a worker may still read a case's files after the one that ran it is done)."""

    directory: str
    workers: int
    me: str

    @classmethod
    def of_worker(cls, workerinput: dict[str, Any]) -> SharedRuns:
        directory = os.path.join(tempfile.gettempdir(), f"conformance-{workerinput['testrunuid'][:16]}")
        os.makedirs(directory, exist_ok=True)
        return cls(directory, int(workerinput["workercount"]), str(workerinput["workerid"]))

    def run(self, name: str, backend: str) -> Run:
        stem = os.path.join(self.directory, f"{backend}~{name.replace('/', '~')}")
        try:
            os.close(os.open(stem + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            claimed = True
        except FileExistsError:  # another worker runs it
            claimed = False
        if not claimed:
            deadline = time.monotonic() + RUN_TIMEOUT_S + 30
            while not os.path.exists(stem + ".run"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"case {name} on {backend}: the worker running it left no result")
                time.sleep(0.05)
            return pickle.loads(Path(stem + ".run").read_bytes())
        run = run_case(name, CASES[name], backend)
        Path(stem + ".tmp").write_bytes(pickle.dumps(run))
        os.replace(stem + ".tmp", stem + ".run")
        return run

    def done(self) -> None:
        Path(self.directory, f"done~{self.me}").touch()
        if sum(n.startswith("done~") for n in os.listdir(self.directory)) < self.workers:
            return
        if not os.environ.get("CONFORMANCE_KEEP"):
            for entry in Path(self.directory).glob("*.run"):
                shutil.rmtree(pickle.loads(entry.read_bytes()).workdir, ignore_errors=True)
        shutil.rmtree(self.directory, ignore_errors=True)


class Harness:
    """Runs the selected cases through ``backend`` in the background; :meth:`run` waits for one.
    With ``shared``, the xdist workers of one run share each case's run (:class:`SharedRuns`)."""

    def __init__(self, backend: str, shared: SharedRuns | None = None) -> None:
        self.backend = backend
        self.shared = shared
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="dmharness")
        self._futures: dict[str, Future[Run]] = {}
        self._lock = threading.Lock()

    def start(self, names: list[str]) -> None:
        for name in names:
            self._submit(name)

    def _submit(self, name: str) -> Future[Run]:
        with self._lock:
            if name not in self._futures:
                if self.shared is not None:
                    self._futures[name] = self._pool.submit(self.shared.run, name, self.backend)
                else:
                    self._futures[name] = self._pool.submit(run_case, name, CASES[name], self.backend)
            return self._futures[name]

    def run(self, name: str) -> Run:
        return self._submit(name).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.shared is not None:
            self.shared.done()
            return
        if os.environ.get("CONFORMANCE_KEEP"):
            return
        for future in self._futures.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                shutil.rmtree(future.result().workdir, ignore_errors=True)


def skip_reason(backend: str = "standin") -> str | None:
    """Why ``backend`` (or, for ``standin``, the agent alone) cannot run here; None: it can."""
    missing = missing_reason("dmharness") if backend == "dmharness" else None
    if missing is not None:
        return f"conformance tier: {missing}"
    if not AGENT.is_file():
        return f"conformance tier runs the installed agent; {AGENT} is missing (pip install -e .)"
    return None

