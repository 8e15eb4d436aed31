"""README.md and the documentation site (docs/) are the operator's manual: everything they show
must be true of the code. "The docs" below means README.md and every page under docs/.

- Every command in a code block of the docs is classified: run here (``gpu-topology-agent ...``
  through ``python -m agent``, ``python bench/...`` with its quickest flags, a ``pytest``
  run of one test file (collected only: the suite runs those tests itself, and running them
  again here would double their time; collecting checks the command selects tests and
  imports under the environment it sets), ``kubectl kustomize daemonset/`` or ``daemonset/dra`` where kubectl
  exists, ``helm template`` or ``helm lint`` where helm exists), or listed
  in :data:`NOT_RUNNABLE` with the reason. A command that is neither fails the test, and so
  does a listed command the docs no longer show.
- Commands in ``sh`` blocks must exit 0. In ``console`` blocks (``$ command`` then its
  output) the shown lines must appear in the command's output (stdout and stderr), in
  order; ``...`` elides lines, a line ending in ``...`` matches by prefix, and a following
  ``$ echo $?`` gives the expected exit code (0 otherwise).
- Inline ``gpu-topology-agent ...`` commands in the text are run too.
- The README's two quick-start commands are checked against ``.ci/run``: the test command
  must be exactly the line CI runs, the demo command must share its install part.
- The configuration, label and metric tables are checked against the code (every ``run``
  flag, environment variable and config file key, with defaults; every label with its
  example value; every metric with its type), wherever in the docs they live.
- Links between the docs resolve: to a file that exists and, with ``#anchor``, to a heading
  of that page (GitHub's anchors, which ``mkdocs.yml`` makes the site's too).

Code blocks may only be ``sh``, ``console``, ``yaml``, ``json`` or ``text``; commands live
in the first two.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
#: README.md and the site's pages: path relative to the root -> text
DOCS: dict[str, str] = {
    p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
    for p in [README, *sorted((ROOT / "docs").rglob("*.md"))]
}

COMMAND_TIMEOUT_S = 120
BLOCK_LANGS = {"sh", "console", "yaml", "json", "text"}
COMMAND_LANGS = {"sh", "console"}

#: Commands the docs show that cannot run here, with the reason. Exact text.
NOT_RUNNABLE: dict[str, str] = {
    ".venv/bin/python bench/real_gpu/run.py --out real-gpu-report": (
        "needs NVIDIA GPUs and nvidia-smi; tests/test_real_gpu_kit.py runs the same script on a"
        " simulated machine with tests/fake_nvidia_smi.py"
    ),
    "kubectl exec -n gpu-topology-agent ds/gpu-topology-agent -- gpu-topology-agent doctor": (
        "needs a cluster running the agent; the same doctor runs on a simulated machine in the"
        " console block below it and in tests/test_doctor.py"
    ),
    "docker build -t gpu-topology-agent:0.1.0 .": (
        "minutes with a Docker engine: the image tier (tests/test_image.py, marker image, run by "
        ".ci/run) builds this Dockerfile unchanged"
    ),
    "docker tag gpu-topology-agent:0.1.0 registry.example.com/gpu-topology-agent:0.1.0": (
        "needs a Docker engine and the image built above"
    ),
    "docker push registry.example.com/gpu-topology-agent:0.1.0": (
        "needs a Docker engine, a registry and the network"
    ),
    "kubectl create namespace gpu-topology-agent": "changes a live cluster",
    "kubectl label namespace gpu-topology-agent pod-security.kubernetes.io/enforce=privileged": (
        "changes a live cluster"
    ),
    "helm install gpu-topology-agent daemonset/helm/gpu-topology-agent --namespace gpu-topology-agent "
    "--set image.repository=registry.example.com/gpu-topology-agent": (
        "changes a live cluster (tests/test_helm.py renders the chart with the same values)"
    ),
    "kubectl apply -k daemonset/": "changes a live cluster",
    "kubectl -n gpu-topology-agent rollout status daemonset/gpu-topology-agent": (
        "needs a live cluster"
    ),
    ".venv/bin/python -m pytest -q": "the whole test suite, this test included (.ci/run runs it)",
    ".venv/bin/python -m pytest -q tests/test_readme.py": "this test",
    '.venv/bin/python -m pytest -q -m "not slow and not image"': (
        "the suite's fast tier, this test included (--strict-markers in addopts refuses an unregistered marker)"
    ),
    "GPU_AGENT_K8S_BINARIES=/path/to/k8s-v1.32 .venv/bin/python -m pytest -q tests/conformance tests/test_dra_draalloc.py": (
        "needs dmharness and draalloc, built from Kubernetes source and never shipped "
        "(the tests skip without them, tests/k8s_binaries.py)"
    ),
    ".venv/bin/python -m pytest -q -n 0 -m image tests/test_image.py": (
        "the image tier: minutes of docker build (.ci/run runs it)"
    ),
    ".venv/bin/mkdocs build --strict --site-dir /tmp/gpu-topology-agent-site": (
        "tests/test_docs_site.py runs the same strict build into a temporary directory"
    ),
    ".venv/bin/mkdocs serve": "serves the site until stopped",
    # the recipe of an old build beside this one (docs/benchmarks/device-plugin.md); its last
    # step, bench_allocate.py --compare-old, runs with the quick flags like any bench
    **dict.fromkeys(
        [
            "git archive HEAD | tar -x -C /tmp/old-src",
            "git archive 184c7a4 ext/_topo.pyx agent/topology/allocator.py "
            "agent/topology/engine.py agent/topology/_pure.py | tar -x -C /tmp/old-src",
            ".venv/bin/pip wheel --no-deps /tmp/old-src -w /tmp/old-whl",
            "mkdir /tmp/old-pkg && unzip -q /tmp/old-whl/*.whl -d /tmp/old-pkg",
        ],
        "builds the engine of commit 184c7a4, a recorded recipe for a past comparison",
    ),
}


#: The quickest flags of each benchmark (what the test runs instead of the shown flags).
BENCH_QUICK: dict[str, list[str]] = {
    "bench/bench_allocate.py": ["--quick", "--json", "{tmp}/allocate.json"],
    "bench/quality.py": ["--events", "60"],
    "bench/quality_dra.py": ["--events", "30", "--machines", "dgx-h100,dgx1-v100"],
    "bench/bench_dra_scheduler.py": ["--nodes", "10", "--gpus", "8", "--pods", "10", "--states", "2"],
    "bench/quality_mig.py": ["--quick"],
    "bench/bench_dra_mig_scheduler.py": ["--quick"],
    "bench/bench_deviceplugin.py": ["--machines", "dgx-h100", "--calls", "20", "--no-process"],
    "bench/bench_metrics.py": ["--scrapes", "10", "--duration-s", "1"],
    "bench/bench_nccl.py": ["--calls", "20", "--json", "{tmp}/nccl.json"],
    "bench/bench_pod_metrics.py": ["--rounds", "3", "--requests", "10", "--agent-seconds", "1"],
    "bench/bench_node_health.py": ["--trials", "2", "--storm-lines", "1000", "--storm-s", "1"],
    "bench/soak.py": ["--seconds", "2", "--scrapers", "4", "--slow-clients", "2", "--streams", "2",
                      "--grpc-clients", "1", "--restart-every", "1"],
}

AGENT_PREFIXES = ("gpu-topology-agent", ".venv/bin/gpu-topology-agent")
PYTHON_PREFIXES = ("python", "python3", ".venv/bin/python")


# --------------------------------------------------------------------------- docs parsing
@dataclasses.dataclass
class Command:
    text: str  # as shown (continuations joined)
    lang: str  # "sh", "console" or "inline"
    line: int  # line number in its file
    output: list[str] | None = None  # console: the shown output lines
    exit_code: int = 0  # console: from a following `$ echo $?`
    source: str = "README.md"  # the file showing it

    @property
    def id(self) -> str:
        short = self.text if len(self.text) <= 70 else self.text[:67] + "..."
        return f"{self.source}:L{self.line}: {short}"


@dataclasses.dataclass
class Block:
    lang: str
    lines: list[str]
    line: int  # line number of the first content line
    source: str = "README.md"


def code_blocks(text: str, source: str = "README.md") -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^( *)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(r"^ *```\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        assert j < len(lines), f"{source} line {i + 1}: code block never closed"
        blocks.append(Block(lang, body, i + 2, source))
        i = j + 1
    return blocks


def _join_continuations(lines: list[tuple[int, str]], source: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, line in lines:
        if pending is not None:
            n, line = pending[0], pending[1] + " " + line.strip()
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (n, line.rstrip()[:-1].rstrip())
            continue
        out.append((n, line.strip()))
    assert pending is None, f"{source} line {pending[0]}: continuation at the end of a block"
    return out


def block_commands(block: Block) -> list[Command]:
    numbered = [(block.line + k, line) for k, line in enumerate(block.lines)]
    where = block.source
    if block.lang == "sh":
        return [
            Command(text, "sh", n, source=where)
            for n, text in _join_continuations(numbered, where)
            if text and not text.startswith("#")
        ]
    commands: list[Command] = []
    for n, line in numbered:
        if line.startswith("$ "):
            text = line[2:].strip()
            if text == "echo $?":
                commands.append(Command(text, "echo", n, output=[], source=where))
            else:
                commands.append(Command(text, "console", n, output=[], source=where))
        else:
            assert commands, f"{where} line {n}: console output before any `$ ` command"
            assert commands[-1].output is not None
            commands[-1].output.append(line.rstrip())
    # fold `$ echo $?` into the command before it
    folded: list[Command] = []
    for cmd in commands:
        if cmd.lang == "echo":
            assert folded, f"{where} line {cmd.line}: `echo $?` with no command before it"
            shown = [x for x in cmd.output or [] if x.strip()]
            assert len(shown) == 1 and shown[0].strip().isdigit(), (
                f"{where} line {cmd.line}: `echo $?` must be followed by one exit code"
            )
            folded[-1].exit_code = int(shown[0])
        else:
            folded.append(cmd)
    return folded


def inline_agent_commands(text: str, source: str = "README.md") -> list[Command]:
    """``gpu-topology-agent ...`` in inline code outside code blocks that is a complete
    command (no synopsis placeholders)."""
    out: list[Command] = []
    in_block = False
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"^ *```", line):
            in_block = not in_block
            continue
        if in_block:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if not span.startswith("gpu-topology-agent "):
                continue
            if re.search(r"[\[\]{}|<>]|\.\.\.|\b(MACHINE|LIST|FILE|K)\b", span):
                continue  # a synopsis, not a command
            out.append(Command(span, "inline", n, source=source))
    return out


BLOCKS = [b for source, text in DOCS.items() for b in code_blocks(text, source)]
COMMANDS = [c for b in BLOCKS if b.lang in COMMAND_LANGS for c in block_commands(b)]
INLINE = [c for source, text in DOCS.items() for c in inline_agent_commands(text, source)]


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", TEXT, re.S | re.M)
    assert m, f"README has no section '## {title}'"
    return m.group(1)


# --------------------------------------------------------------------------- .ci/run
def _ci_command() -> str:
    lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return lines[-1]


CI_COMMAND = _ci_command()
INSTALL = CI_COMMAND.rsplit(" && ", 1)[0]


def _quick_start_commands() -> list[str]:
    return [c.text for b in code_blocks(_section("Quick start")) for c in block_commands(b)]


def test_quick_start_matches_ci() -> None:
    demo, tests = _quick_start_commands()
    assert tests == CI_COMMAND, "the README's test command must be exactly what .ci/run runs"
    assert INSTALL == "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'"
    assert demo == INSTALL + " && .venv/bin/gpu-topology-agent demo"


# --------------------------------------------------------------------------- classification
def _split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    return env, argv


def classify(text: str) -> tuple[str, object]:
    """("run", (argv, env)), ("bench", (script, env)), ("pytest", (argv, env)), ("kubectl", argv),
    ("helm", argv), ("skip", reason) or ("unknown", None)."""
    if text in NOT_RUNNABLE:
        return "skip", NOT_RUNNABLE[text]
    if text.startswith(INSTALL + " && "):
        # a quick-start command: its install part is checked by test_quick_start_matches_ci
        return classify(text[len(INSTALL) + 4 :])
    env, argv = _split_env(shlex.split(text))
    if not argv:
        return "unknown", None
    if argv[0] in AGENT_PREFIXES:
        return "run", ([sys.executable, "-m", "agent", *argv[1:]], env)
    if argv[0] in PYTHON_PREFIXES and argv[1:3] == ["-m", "agent"]:
        return "run", ([sys.executable, *argv[1:]], env)
    if argv[0] in PYTHON_PREFIXES and len(argv) >= 2 and argv[1] in BENCH_QUICK:
        return "bench", (argv[1], env)
    if (
        argv[0] in PYTHON_PREFIXES
        and argv[1:3] == ["-m", "pytest"]
        and argv[-1].startswith("tests/test_")
        and argv[-1] != "tests/test_readme.py"
    ):
        return "pytest", ([sys.executable, *argv[1:], "--collect-only", "-p", "no:cacheprovider"], env)
    if argv in (["kubectl", "kustomize", "daemonset/"], ["kubectl", "kustomize", "daemonset/dra"]):
        return "kubectl", argv
    if argv[0] == "helm" and argv[1:2] in (["template"], ["lint"]):
        return "helm", argv  # offline: renders the chart, changes nothing
    return "unknown", None


def test_the_docs_have_commands_and_only_known_blocks() -> None:
    assert len(COMMANDS) >= 10
    assert {c.source for c in COMMANDS} > {"README.md"}, "the pages under docs/ show no command"
    for b in BLOCKS:
        assert b.lang in BLOCK_LANGS, f"{b.source} line {b.line}: code block language {b.lang!r}"
        if b.lang not in COMMAND_LANGS:
            for k, line in enumerate(b.lines):
                assert not re.match(
                    r"^\s*(\$ |gpu-topology-agent |kubectl |docker |python|\.venv/)", line
                ), f"{b.source} line {b.line + k}: a command in a {b.lang!r} block"


def test_every_command_is_run_or_listed() -> None:
    unknown = [c.id for c in COMMANDS + INLINE if classify(c.text)[0] == "unknown"]
    assert not unknown, f"commands in the docs neither run by this test nor listed: {unknown}"
    shown = {c.text for c in COMMANDS}
    stale = [t for t in NOT_RUNNABLE if t not in shown]
    assert not stale, f"NOT_RUNNABLE lists commands the docs no longer show: {stale}"


# --------------------------------------------------------------------------- running
def _nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


def _run(argv: list[str], extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    from agent.config import ENV_FIELDS

    env = dict(os.environ)
    env.pop("AGENT_PUREPYTHON", None)  # the docs' outputs are the default engine's
    env.pop("TMPDIR", None)  # and the default temporary directory's (tests/conftest.py may set it)
    # the docs' outputs are the defaults': no configuration from the caller's environment
    for name in (*ENV_FIELDS, "CONFIG_FILE", "DP_DISABLE_HEALTHCHECKS", "DP_ENABLE_HEALTHCHECKS"):
        env.pop(name, None)
    env.update(extra_env)
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


def _match_output(shown: list[str], actual: str) -> str | None:
    """None when every shown line (``...`` aside) appears in ``actual``, in order."""
    lines = [line.rstrip() for line in actual.splitlines()]
    pos = 0
    for want in shown:
        if want.strip() in ("", "..."):
            continue
        prefix = want.endswith("...")
        target = want[:-3] if prefix else want
        while pos < len(lines) and not (
            lines[pos].startswith(target) if prefix else lines[pos] == target
        ):
            pos += 1
        if pos == len(lines):
            return f"shown line not found (in order) in the output:\n  {want!r}"
        pos += 1
    return None


_BENCH_RUNS: dict[tuple[str, tuple[tuple[str, str], ...]], subprocess.CompletedProcess[str]] = {}


def _bench_run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``script`` run once with its quick flags (:data:`BENCH_QUICK`) per environment: the docs
    show some benches more than once (with flags the quick run replaces), and the same quick
    run would only be repeated."""
    key = (script, tuple(sorted(env.items())))
    if key not in _BENCH_RUNS:
        tmp = tempfile.mkdtemp(prefix="bench-")
        try:
            flags = [f.replace("{tmp}", tmp) for f in BENCH_QUICK[script]]
            _BENCH_RUNS[key] = _run([sys.executable, script, *flags], env)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _BENCH_RUNS[key]


RUNNABLE = [
    # a benchmark's quick run takes seconds to a minute: the slow tier
    pytest.param(c, id=c.id, marks=[pytest.mark.slow] if classify(c.text)[0] == "bench" else [])
    for c in COMMANDS + INLINE if classify(c.text)[0] != "skip"
]


@pytest.mark.parametrize("cmd", RUNNABLE)
def test_command(cmd: Command, tmp_path: Path) -> None:
    kind, detail = classify(cmd.text)
    if kind == "unknown":
        pytest.fail(f"not a command this test knows how to run: {cmd.text}")
    if kind == "kubectl":
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            pytest.skip("kubectl is not installed here")
        result = _run([kubectl, "kustomize", detail[2]], {})  # type: ignore[index]
        assert result.returncode == 0, result.stderr
        assert "kind: DaemonSet" in result.stdout
        return
    if kind == "helm":
        helm = shutil.which("helm") or str(ROOT / ".tools" / "bin" / "helm")
        if not os.access(helm, os.X_OK):
            pytest.skip("helm is not installed here (.ci/run puts it in .tools/bin)")
        homes = {n: str(tmp_path / n.lower()) for n in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}
        result = _run([helm, *detail[1:]], homes)  # type: ignore[index]
        assert result.returncode == 0, result.stderr
        if detail[1] == "template":  # type: ignore[index]
            assert "kind: DaemonSet" in result.stdout
        return
    if kind == "pytest":
        argv, env = detail  # type: ignore[misc]
        result = _run(argv, env)
        collected = re.search(r"^(\d+) tests? collected", result.stdout, re.M)
        assert result.returncode == 0 and collected and int(collected.group(1)) > 0, (
            f"{cmd.text}: collects no test (exit {result.returncode})\n{(result.stdout + result.stderr)[-3000:]}"
        )
        return
    if kind == "bench":
        script, env = detail  # type: ignore[misc]
        result = _bench_run(script, env)
    else:
        argv, env = detail  # type: ignore[misc]
        if (
            argv[1:3] == ["-m", "agent"]
            and "--simulate" not in argv
            and "demo" not in argv
            and cmd.exit_code != 0
            and _nvml_present()
        ):
            pytest.skip("this machine has NVML: the docs show the driverless answer")
        result = _run(argv, env)
    combined = result.stdout + result.stderr
    assert result.returncode == cmd.exit_code, (
        f"{cmd.text}: exit {result.returncode}, {cmd.source} says {cmd.exit_code}\n{combined[-3000:]}"
    )
    if cmd.output:
        problem = _match_output(cmd.output, combined)
        assert problem is None, f"{cmd.text}: {problem}\n--- output ---\n{combined[-4000:]}"


# --------------------------------------------------------------------------- tables
def _tables(header: str) -> list[list[list[str]]]:
    """Every markdown table of the docs whose header row is ``header``: rows of cells."""
    tables: list[list[list[str]]] = []
    for text in DOCS.values():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.strip() != header:
                continue
            rows: list[list[str]] = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]]
                rows.append(cells)
            tables.append(rows)
    assert tables, f"the docs have no table with header {header!r}"
    return tables


def _ticks(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _first_tick(cell: str) -> str | None:
    found = _ticks(cell)
    return found[0] if found else None


SETTINGS_HEADER = "| Flag | Environment | Config file key | Default | Meaning |"


def _run_parser() -> argparse.ArgumentParser:
    from agent.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _format_default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _settings_rows() -> list[dict[str, str | None]]:
    (rows,) = _tables(SETTINGS_HEADER)
    assert len(rows) >= 10, "the settings table lost its rows: the checks reading it would pass on none"
    out = []
    for cells in rows:
        flag, env, key, default, meaning = cells
        out.append(
            {
                "flag": (_first_tick(flag) or "").split(" ")[0] or None,
                "env": _first_tick(env),
                "key": _first_tick(key),
                "default_cell": default,
                "default": _first_tick(default),
            }
        )
    return out


def test_settings_table_lists_every_flag_and_variable() -> None:
    from agent.config import ENV_FIELDS

    rows = _settings_rows()
    flags = {
        opt
        for action in _run_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }
    assert {r["flag"] for r in rows if r["flag"]} == flags
    extra_env = {"CONFIG_FILE", "DP_DISABLE_HEALTHCHECKS", "DP_ENABLE_HEALTHCHECKS"}
    expected_env = set(ENV_FIELDS) | extra_env
    assert {r["env"] for r in rows if r["env"]} == expected_env
    # the loader really reads the three that are not in ENV_FIELDS
    source = (ROOT / "agent" / "config.py").read_text(encoding="utf-8")
    for name in expected_env - set(ENV_FIELDS):
        assert f'"{name}"' in source


def test_settings_defaults_and_mappings() -> None:
    from agent.config import ENV_FIELDS, Config

    dests = {
        opt: action.dest
        for action in _run_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--")
    }
    defaults = Config()
    fields = {f.name for f in dataclasses.fields(Config)}
    for row in _settings_rows():
        where = row["flag"] or row["env"] or row["key"]
        field = dests.get(row["flag"]) if row["flag"] else ENV_FIELDS.get(row["env"] or "")
        if row["flag"] and row["env"] and row["env"] in ENV_FIELDS:
            assert ENV_FIELDS[row["env"]] == field, f"{where}: flag and variable differ"
        if field in fields:
            expected = _format_default(getattr(defaults, field))
            if expected == "":
                assert "empty" in (row["default_cell"] or ""), f"{where}: default is empty"
            else:
                assert row["default"] == expected, (
                    f"{where}: documented default {row['default']!r}, code {expected!r}"
                )
        elif row["flag"] in ("--config", "--simulate"):
            assert row["default_cell"] == "none"


def _load_doc(doc: dict, tmp_path: Path):
    from agent.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return load_config(str(path), {}, {})


def _nested(key: str, value: object) -> dict:
    doc: dict = {"version": "v1"}
    node = doc
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return doc


def test_documented_config_file_defaults_are_the_codes(tmp_path: Path) -> None:
    """Setting every documented file key (and variable) to its documented default changes
    nothing: the key is accepted and the default is the code's."""
    from agent.config import ENV_FIELDS, Config, load_config

    for row in _settings_rows():
        if row["key"]:
            value = yaml.safe_load(row["default"] or "")
            config = _load_doc(_nested(row["key"], value), tmp_path)
            assert dataclasses.replace(config, config_file=None) == Config(), row["key"]
        if row["env"] in ENV_FIELDS and row["default"]:
            config = load_config(None, {row["env"]: row["default"]}, {})
            assert config == Config(), row["env"]


CONFIG_SECTIONS = {
    "": {"version": "v1", "zz_unknown": 1},
    "flags": {"version": "v1", "flags": {"zz_unknown": 1}},
    "flags.plugin": {"version": "v1", "flags": {"plugin": {"zz_unknown": 1}}},
    "sharing": {"version": "v1", "sharing": {"zz_unknown": 1}},
    "sharing.timeSlicing": {"version": "v1", "sharing": {"timeSlicing": {"zz_unknown": 1}}},
    "sharing.timeSlicing.resources[]": {
        "version": "v1",
        "sharing": {"timeSlicing": {"resources": [{"zz_unknown": 1}]}},
    },
    "health": {"version": "v1", "health": {"zz_unknown": 1}},
    "metrics": {"version": "v1", "metrics": {"zz_unknown": 1}},
}


def _allowed_keys(section: str, tmp_path: Path) -> list[str]:
    from agent.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _load_doc(CONFIG_SECTIONS[section], tmp_path)
    m = re.search(r"unknown key \(expected one of ([^)]*)\)", str(info.value))
    assert m, str(info.value)
    return [k.strip() for k in m.group(1).split(",")]


def test_every_config_file_key_is_documented(tmp_path: Path) -> None:
    tokens = {t for text in DOCS.values() for t in re.findall(r"`([^`\s]+)`", text)}
    for section in CONFIG_SECTIONS:
        if section == "sharing.timeSlicing.resources[]":
            continue
        for key in _allowed_keys(section, tmp_path):
            path = f"{section}.{key}" if section else key
            documented = any(t == path or t.startswith(path + ".") for t in tokens)
            assert documented, f"config file key {path} is not in the docs"
    (entry_rows,) = _tables("| Key | Default | Meaning |")
    documented = {_first_tick(cells[0]) for cells in entry_rows}
    assert documented == set(_allowed_keys("sharing.timeSlicing.resources[]", tmp_path))


# --------------------------------------------------------------------------- labels
def _labels(machine: str, env: dict[str, str]) -> dict[str, str]:
    from agent.config import load_config
    from agent.discovery import load_topology
    from agent.labels import compute_labels

    return compute_labels(load_topology(machine), load_config(None, env, {}))


def _label_rows() -> dict[str, str]:
    rows: dict[str, str] = {}
    for table in _tables("| Label | Meaning | Example |"):
        for cells in table:
            key, example = _first_tick(cells[0]), _first_tick(cells[2])
            assert key and example, f"label row without key or example: {cells}"
            assert key not in rows, f"label {key} listed twice"
            rows[key] = example
    return rows


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(re.escape("<profile>"), r".+") + "$")


def test_labels_table_matches_the_code() -> None:
    rows = _label_rows()
    h100 = _labels("dgx-h100", {})
    for key, value in h100.items():
        assert key in rows, f"label {key} (labels --simulate dgx-h100) is not in the docs"
        assert rows[key] == value, f"{key}: documented example {rows[key]!r}, the code gives {value!r}"
    others = {**_labels("a100-mig", {"MIG_STRATEGY": "mixed"}), **_labels("gb200-tray", {})}
    for key, example in rows.items():
        if key in h100:
            continue
        pattern = _pattern(key)
        values = [v for k, v in others.items() if pattern.match(k)]
        assert values, f"documented label {key} is produced by none of the example machines"
        assert example in values, f"{key}: documented example {example!r}, the code gives {values}"
    for key in others:
        assert any(_pattern(k).match(key) for k in rows), f"label {key} is not in the docs"


# --------------------------------------------------------------------------- metrics
def _exported_types() -> dict[str, str]:
    from prometheus_client import CollectorRegistry

    from agent.discovery import load_topology
    from agent.metrics.collector import GpuCollector, render_text
    from agent.metrics.self_metrics import AgentMetrics

    registry = CollectorRegistry()
    agent_metrics = AgentMetrics(registry, backend=types.SimpleNamespace(error_counts={"nvmlDeviceGetCount": 1}))
    agent_metrics.devices_offered([("nvidia.com/gpu", "GPU-0", True)])  # what the device plugin offers
    registry.register(GpuCollector(load_topology("dgx-h100"), hostname="node"))
    text = render_text(registry).decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_metrics_tables_match_the_code() -> None:
    from agent.metrics.fields import DCGM_METRICS

    (dcgm_rows,) = _tables("| Metric | Type | Unit | NVML source |")
    documented = {_first_tick(c[0]): c[1] for c in dcgm_rows}
    assert documented == {m.name: m.kind for m in DCGM_METRICS}
    (own_rows,) = _tables("| Metric | Type | Unit | Labels | Meaning |")
    ours = {_first_tick(c[0]): c[1] for c in own_rows}
    exported = {k: v for k, v in _exported_types().items() if not k.startswith("DCGM_")}
    assert ours == exported


# --------------------------------------------------------------------------- links
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as ``-``."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    # headings inside code blocks are not headings
    outside = "\n".join(line for b in code_blocks(text) for line in b.lines)
    headings = [
        m.group(1) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M) if m.group(0) not in outside
    ]
    return {_slug(h) for h in headings}


def test_links_between_the_docs_resolve() -> None:
    checked = 0
    for source, text in DOCS.items():
        here = (ROOT / source).parent
        for target in re.findall(r"\]\((?!https?://)([^)]+)\)", text):
            checked += 1
            path, _, anchor = target.partition("#")
            page = (here / path).resolve() if path else ROOT / source
            assert page.exists(), f"{source} links to {target}: {path} does not exist"
            if anchor:
                assert page.suffix == ".md", f"{source} links to {target}: an anchor in no page"
                assert anchor in _anchors(page.read_text(encoding="utf-8")), (
                    f"{source} links to {target}: no such heading"
                )
    assert checked >= 20, f"only {checked} links between the docs: is DOCS reading the pages?"


def test_the_readme_links_into_the_docs_site() -> None:
    linked = {t.split("#")[0] for t in re.findall(r"\]\((docs/[^)]+)\)", TEXT)}
    assert "docs/index.md" in linked and len(linked) >= 10


def _heading_section(text: str, title: str) -> str | None:
    """The text under the heading ``title`` (any level) up to the next heading of the same or
    a higher level outside code blocks; None without such a heading."""
    lines = text.splitlines()
    in_block, level, body = False, 0, []
    for line in lines:
        if re.match(r"^ *```", line):
            in_block = not in_block
        m = None if in_block else re.match(r"^(#{1,6}) (.+)$", line)
        if level and m and len(m.group(1)) <= level:
            break
        if level:
            body.append(line)
        elif m and m.group(2).strip() == title:
            level = len(m.group(1))
    return "\n".join(body) if level else None


def test_the_machine_spec_example_is_read_by_the_one_schema_and_runs(tmp_path: Path) -> None:
    from agent.discovery import load_topology
    from agent.hw.sim.spec import machine_spec_from_dict

    found = [s for text in DOCS.values() if (s := _heading_section(text, "Machine spec format"))]
    assert len(found) == 1, "the docs have one section 'Machine spec format'"
    section = found[0]
    blocks = [b for b in code_blocks(section) if b.lang == "yaml"]
    assert len(blocks) == 1, "the Machine spec format section has one complete YAML example"
    text = "\n".join(blocks[0].lines) + "\n"
    doc = yaml.safe_load(text)
    spec = machine_spec_from_dict(doc, source="README")
    assert spec.name == "workstation" and len(spec.gpus) == 2
    path = tmp_path / "workstation.yaml"
    path.write_text(text, encoding="utf-8")
    topo = load_topology(str(path))
    assert topo.link(0, 1).nvlinks == 4 and topo.link(0, 1).pcie is not None
    assert topo.driver_version == "550.54.15" and topo.cuda_driver_version == "12.4"
    assert [g.mig_capable for g in topo.gpus] == [False, False]
