"""The Dockerfile builds the agent the way the project packages it, without a docker engine.

No docker exists where these tests run, so the Dockerfile is parsed (a small parser below:
comments, line continuations, stages, ``ARG`` substitution in ``FROM``, exec and shell
forms) and checked against the repository: two stages from the same slim Python image, a
builder with a compiler that builds our wheel into ``/opt/venv``, a runtime stage that copies
only that venv, the NVIDIA container toolkit variables, the console script as entrypoint,
and every path copied from the build context present in the repository and not excluded by
``.dockerignore``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import posixpath
import re
import shlex
import subprocess
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest

from agent.cli import COMMAND_MODULES
from agent.config import Config, probe_address_of

ROOT = Path(__file__).resolve().parents[1]
VENV = "/opt/venv"


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    arguments: str  # the rest of the logical line, continuations joined
    line: int  # 1-based line where it starts


@dataclasses.dataclass
class Stage:
    base: str  # the FROM image after ARG substitution
    name: str | None
    instructions: list[Instruction]

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical instructions: comment lines dropped (also inside continuations, as docker
    does), backslash-continued lines joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical = " ".join(p for p in pending if p)
        pending = []
        keyword, _, arguments = logical.partition(" ")
        out.append(Instruction(keyword.upper(), arguments.strip(), start))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return out


def split_stages(instructions: list[Instruction]) -> list[Stage]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not stages:
            name, _, default = ins.arguments.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        elif ins.keyword == "FROM":
            words = ins.arguments.split()
            words = [w for w in words if not w.startswith("--platform")]
            base = re.sub(
                r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), words[0]
            )
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name, []))
        else:
            assert stages, f"line {ins.line}: {ins.keyword} before the first FROM"
            stages[-1].instructions.append(ins)
    return stages


def copy_parts(ins: Instruction) -> tuple[dict[str, str], list[str], str]:
    """COPY/ADD -> (flags, sources, destination)."""
    rest = ins.arguments
    flags = {}
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        key, _, value = flag[2:].partition("=")
        flags[key] = value
        rest = rest.lstrip()
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    return flags, words[:-1], words[-1]


def env_pairs(ins: Instruction) -> dict[str, str]:
    words = shlex.split(ins.arguments, posix=True)
    if words and "=" not in words[0]:  # legacy `ENV KEY value with spaces`
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


def exec_form(ins: Instruction) -> list[str]:
    assert ins.arguments.startswith("["), (
        f"line {ins.line}: {ins.keyword} should use the exec form so signals reach the agent"
    )
    return json.loads(ins.arguments)


# ----------------------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


@lru_cache(maxsize=1)
def dockerignore_rules() -> tuple[tuple[bool, re.Pattern[str]], ...]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:].strip() if negated else line
        rules.append((negated, _pattern_regex(pattern.strip("/"))))
    return tuple(rules)


def is_dockerignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a directory
    excludes everything under it."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negated, regex in dockerignore_rules():
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negated
    return excluded


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return split_stages(parse_dockerfile((ROOT / "Dockerfile").read_text()))


@pytest.fixture(scope="module")
def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


def _context_sources(stages: list[Stage]) -> list[str]:
    sources = []
    for stage in stages:
        for ins in stage.of("COPY") + stage.of("ADD"):
            flags, srcs, _ = copy_parts(ins)
            if "from" not in flags:
                sources += [s.rstrip("/") or "." for s in srcs]
    return sources


def _tracked_files() -> list[str]:
    result = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        pytest.skip("not a git checkout: cannot list the tracked files")
    return result.stdout.splitlines()


# ----------------------------------------------------------------------------- the parser


def test_parser_joins_continuations_drops_comments_and_substitutes_args() -> None:
    text = (
        "# syntax comment\n"
        "ARG IMG=python:3.11-slim\n"
        "FROM ${IMG} AS builder\n"
        "RUN a \\\n"
        "    # a comment inside a continuation\n"
        " && b\n"
        "FROM $IMG\n"
        'COPY --from=builder ["/opt/venv", "/opt/venv"]\n'
        "ENV A=1 \\\n    B=\"two words\"\n"
    )
    builder, runtime = split_stages(parse_dockerfile(text))
    assert (builder.base, builder.name) == ("python:3.11-slim", "builder")
    assert [i.arguments for i in builder.of("RUN")] == ["a && b"]
    assert runtime.base == "python:3.11-slim" and runtime.name is None
    assert copy_parts(runtime.of("COPY")[0]) == ({"from": "builder"}, ["/opt/venv"], "/opt/venv")
    assert env_pairs(runtime.of("ENV")[0]) == {"A": "1", "B": "two words"}


def test_dockerignore_matcher_follows_docker_rules() -> None:
    assert is_dockerignored(".venv/bin/python")  # a directory pattern covers its contents
    assert is_dockerignored("agent/hw/__pycache__/fake.cpython-311.pyc")  # ** spans dirs
    assert not is_dockerignored("agent/cli.py")


# ----------------------------------------------------------------------------- stages


def test_dockerfile_has_a_builder_stage_and_a_runtime_stage_on_the_same_slim_python(
    stages: list[Stage], pyproject: dict
) -> None:
    assert len(stages) == 2
    builder, runtime = stages
    assert builder.name == "builder"
    # Same image: the extension built in the builder must match the runtime's Python ABI,
    # and the venv's interpreter symlinks point into the base image.
    assert builder.base == runtime.base
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?(@sha256:[0-9a-f]{64})?", runtime.base)


def test_builder_installs_a_compiler_and_builds_the_wheel_into_the_venv(stages: list[Stage]) -> None:
    runs = " ".join(i.arguments for i in stages[0].of("RUN"))
    assert "build-essential" in runs
    assert re.search(r"\bpip wheel\b.* \.(\s|$)", runs), "the builder must `pip wheel .`"
    assert re.search(rf"python -m venv (--[\w-]+ )*{VENV}(\s|$)", runs)
    assert f"pip --python {VENV}/bin/python install" in runs


def test_modules_the_builder_smoke_imports_are_built_by_the_package(stages: list[Stage]) -> None:
    # The builder fails the image build if the wheel lacks the compiled engine or the gRPC
    # stubs; the names it imports must be the ones the build produces.
    runs = " ".join(i.arguments for i in stages[0].of("RUN"))
    match = re.search(r'python(?: -\w+)* -c "import ([\w., ]+)"', runs)
    assert match, "the builder should smoke-import the built package"
    modules = [m.strip() for m in match.group(1).split(",")]
    assert "agent._topo" in modules
    for module in modules:
        importlib.import_module(module)


def test_runtime_stage_copies_only_the_venv_from_the_builder(stages: list[Stage]) -> None:
    runtime = stages[1]
    assert not runtime.of("ADD")
    copies = [copy_parts(i) for i in runtime.of("COPY")]
    assert copies == [({"from": "builder"}, [VENV], VENV)]


def test_runtime_installs_nothing_and_bakes_in_no_nvidia_library(stages: list[Stage]) -> None:
    runtime = stages[1]
    assert "nvidia" not in runtime.base and "cuda" not in runtime.base
    for ins in runtime.of("RUN"):
        assert not re.search(r"apt-get|apt |pip3? (install|wheel|download)|-m pip|nvidia|cuda",
                             ins.arguments), ins.arguments


def test_runtime_sets_the_nvidia_toolkit_variables_and_the_venv_path(stages: list[Stage]) -> None:
    env: dict[str, str] = {}
    for ins in stages[1].of("ENV"):
        env.update(env_pairs(ins))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["PATH"].split(":")[0] == f"{VENV}/bin"


def test_entrypoint_is_the_console_script_and_cmd_is_run(stages: list[Stage], pyproject: dict) -> None:
    runtime = stages[1]
    (entrypoint,) = runtime.of("ENTRYPOINT")
    (cmd,) = runtime.of("CMD")
    (script,) = exec_form(entrypoint)
    assert pyproject["project"]["scripts"][script] == "agent.cli:main"
    assert exec_form(cmd) == ["run"]
    assert "agent.commands.run" in {m.__name__ for m in COMMAND_MODULES}


def test_runtime_user_is_not_root(stages: list[Stage]) -> None:
    users = stages[1].of("USER")
    assert users, "the runtime stage must set a USER"
    uid, _, gid = users[-1].arguments.partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0
    assert not gid or (gid.isdigit() and int(gid) != 0)


def _shell_words(ins: Instruction) -> list[list[str]]:
    """A RUN's commands (split at ``&&``, ``;`` and ``||``) as word lists."""
    commands: list[list[str]] = [[]]
    for word in shlex.split(ins.arguments):
        if word in ("&&", ";", "||"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def _option(words: list[str], *names: str) -> str | None:
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def test_runtime_user_and_its_group_exist(stages: list[Stage]) -> None:
    # USER uid:gid with a gid no group has leaves files the agent creates owned by a
    # nameless group, and `id` fails; useradd --user-group picks its own gid.
    uid, _, gid = stages[1].of("USER")[-1].arguments.partition(":")
    commands = [c for ins in stages[1].of("RUN") for c in _shell_words(ins)]
    groups = [_option(c, "--gid", "-g") for c in commands if c[0] == "groupadd"]
    users = [c for c in commands if c[0] == "useradd" and _option(c, "--uid", "-u") == uid]
    assert users, f"no useradd creates uid {uid}"
    assert _option(users[0], "--gid", "-g") == (gid or uid)
    assert (gid or uid) in groups, f"no groupadd creates gid {gid or uid}"


def test_runtime_image_keeps_no_pip_setuptools_or_wheel(stages: list[Stage]) -> None:
    builder, runtime = stages
    # the venv copied into the runtime image gets no pip of its own ...
    venvs = [c for ins in builder.of("RUN") for c in _shell_words(ins) if c[:3] == ["python", "-m", "venv"]]
    assert venvs and "--without-pip" in venvs[0]
    # ... and the base image's pip, setuptools and wheel are removed from the runtime stage
    removed = " ".join(" ".join(c) for ins in runtime.of("RUN") for c in _shell_words(ins) if c[0] == "rm")
    for package in ("pip", "setuptools", "wheel", "pkg_resources", "_distutils_hack"):
        assert f"/site-packages/{package}" in removed, f"{package} stays in the runtime image"
    assert "/usr/local/bin/pip" in removed


def test_dependencies_are_installed_in_a_layer_before_the_source_is_copied(stages: list[Stage]) -> None:
    # A change to agent/ must not re-download and rebuild every dependency.
    builder = stages[0]
    order = [i for i in builder.instructions if i.keyword in ("COPY", "RUN")]
    source_at = next(n for n, i in enumerate(order)
                     if i.keyword == "COPY" and copy_parts(i)[1] != ["pyproject.toml"])
    before = order[:source_at]
    assert [copy_parts(i)[1] for i in before if i.keyword == "COPY"] == [["pyproject.toml"]]
    assert any("pip wheel" in i.arguments and "-r " in i.arguments for i in before if i.keyword == "RUN")
    assert any(f"--python {VENV}/bin/python install" in i.arguments for i in before if i.keyword == "RUN")
    after = " ".join(i.arguments for i in order[source_at:] if i.keyword == "RUN")
    assert "--no-index" in after and "--no-deps" in after  # the source step downloads nothing


def test_the_builder_imports_the_installed_package_not_the_source_tree(stages: list[Stage]) -> None:
    # `python -c` puts the working directory first on sys.path: in /src the copied agent/
    # (no compiled agent._topo, no generated stubs) shadows the package in the venv and the
    # check fails with ModuleNotFoundError: No module named 'agent._topo'.
    builder = stages[0]
    workdir = "/"
    copied: dict[str, set[str]] = {}
    for ins in builder.instructions:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, ins.arguments.strip())
        elif ins.keyword == "COPY":
            _, sources, dest = copy_parts(ins)
            target = posixpath.normpath(posixpath.join(workdir, dest))
            names = {posixpath.basename(dest.rstrip("/"))} if dest.rstrip("/") not in ("", ".") else {
                s.rstrip("/").split("/")[-1] for s in sources}
            parent = posixpath.dirname(target) if dest.rstrip("/") not in ("", ".") else target
            copied.setdefault(parent, set()).update(names)
        elif ins.keyword == "RUN" and "import agent." in ins.arguments:
            cwd = workdir
            for words in _shell_words(ins):
                if words[0] == "cd":
                    cwd = posixpath.normpath(posixpath.join(cwd, words[1]))
                elif words[0].endswith("python") and "-c" in words:
                    flags = words[1:words.index("-c")]
                    isolated = any(f in ("-I", "-P") or (f.startswith("-") and not f.startswith("--")
                                   and ("I" in f or "P" in f)) for f in flags)
                    assert isolated or "agent" not in copied.get(cwd, set()), (
                        f"line {ins.line}: the import check runs in {cwd}, where the copied "
                        "source tree shadows the installed package")
                    return
    pytest.fail("the builder has no import check of the built package")


def test_oci_labels_carry_the_version_and_the_source(stages: list[Stage], pyproject: dict) -> None:
    runtime = stages[1]
    args = {}
    for ins in runtime.of("ARG"):
        name, _, default = ins.arguments.partition("=")
        args[name.strip()] = default.strip().strip('"')
    labels: dict[str, str] = {}
    for ins in runtime.of("LABEL"):
        labels.update(env_pairs(ins))

    def resolved(value: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)

    assert resolved(labels["org.opencontainers.image.version"]) == pyproject["project"]["version"]
    assert labels["org.opencontainers.image.source"] == "${SOURCE}" and "SOURCE" in args
    assert labels["org.opencontainers.image.licenses"] == pyproject["project"]["license"]


def test_exposed_ports_are_the_agents_default_metrics_and_probe_ports(stages: list[Stage]) -> None:
    exposed = {int(w.split("/")[0]) for i in stages[1].of("EXPOSE") for w in i.arguments.split()}
    default = Config()
    assert exposed == {int(a.rpartition(":")[2]) for a in (default.metrics_address, probe_address_of(default))}


# ----------------------------------------------------------------------------- build context


def test_every_path_copied_from_the_context_exists_and_is_not_dockerignored(
    stages: list[Stage],
) -> None:
    sources = _context_sources(stages)
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not is_dockerignored(source), f"COPY {source}: excluded by .dockerignore"


def test_builder_copies_everything_the_package_build_reads(
    stages: list[Stage], pyproject: dict
) -> None:
    copied = {s.split("/")[0] for s in _context_sources(stages[:1])}
    needed = {"pyproject.toml", "setup.py", pyproject["project"]["readme"]}
    needed |= {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    # Top-level paths setup.py names (the Cython sources, the .proto files, ...).
    top_level = {p.name for p in ROOT.iterdir()}
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in top_level:
            needed.add(node.value)
    assert needed <= copied, f"the builder does not COPY {sorted(needed - copied)}"


def test_every_tracked_file_under_the_copied_paths_reaches_the_build(stages: list[Stage]) -> None:
    copied = _context_sources(stages)
    tracked = [
        f for f in _tracked_files()
        if any(f == c or f.startswith(c + "/") for c in copied)
    ]
    assert tracked
    ignored = [f for f in tracked if is_dockerignored(f)]
    assert not ignored, f".dockerignore drops tracked sources: {ignored}"


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "agent/_topo.cpython-311-x86_64-linux-gnu.so",
        "agent/_proto/deviceplugin_v1beta1_pb2.py",
        "agent/_proto/podresources_v1_pb2_grpc.py",
        "ext/_topo.c",
        "agent/__pycache__/cli.cpython-311.pyc",
        "build/lib/agent/cli.py",
        "gpu_topology_agent.egg-info/PKG-INFO",
    ],
)
def test_dockerignore_keeps_build_outputs_and_local_state_out_of_the_context(path: str) -> None:
    # Stale local builds (another Python's .so, old stubs) must not shadow the builder's.
    assert is_dockerignored(path)
