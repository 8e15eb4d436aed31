"""Packaging: the sdist builds a working wheel, and the package says what it needs.

One build per session: a copy of the source tree, with generated files planted in it, is
turned into an sdist (pypa ``build``, the ``sdist`` fixture), and a wheel is built from that
sdist alone (``pip wheel``, the ``wheel`` fixture), both without build isolation: the
[build-system] requirements come from the ``test`` extra, so nothing is downloaded. The
wheel is then installed into fresh virtual environments.

The generated gRPC code checks its runtime: ``*_pb2_grpc`` modules refuse a grpcio older
than the grpcio-tools that generated them, ``*_pb2`` modules a protobuf older than their
gencode version. So grpcio-tools is pinned exactly and the runtime floors follow from it;
one test installs exactly those floors (from the package index) and imports the stubs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Written by a local build or an editable install; never part of an sdist.
PLANTED_GENERATED = (
    "agent/_proto/planted_pb2.py",
    "agent/_proto/planted_pb2.pyi",
    "agent/_proto/planted_pb2_grpc.py",
    "agent/_topo.cpython-311-x86_64-linux-gnu.so",
    "agent/__pycache__/cli.cpython-311.pyc",
    "ext/_topo.c",
    "ext/_topo.html",
)
GENERATED = re.compile(r"(_pb2\w*\.pyi?|\.so|\.pyc|\.c|\.html)$")
# pip output when the package index cannot be reached (no network where the suite runs)
OFFLINE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Name or service not known|Network is unreachable|ProxyError|"
    r"ConnectTimeoutError|Read timed out"
)


def _requirements(strings: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(s) for s in strings]
    return {r.name.lower(): r for r in reqs}


def _pin(req: Requirement) -> Version:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req} is not an exact == pin"
    return Version(specs[0].version)


def _floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{req} should declare exactly one >= floor"
    return floors[0]


BUILD_REQUIRES = _requirements(PYPROJECT["build-system"]["requires"])
RUNTIME = _requirements(PYPROJECT["project"]["dependencies"])
TOOLS_PIN = _pin(BUILD_REQUIRES["grpcio-tools"])


def _proto_stems() -> list[str]:
    stems = sorted(p.stem for p in (ROOT / "proto").glob("*.proto"))
    assert stems, "no proto/*.proto"
    return stems


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _check(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"{' '.join(map(str, result.args))} exited {result.returncode}:\n"
        f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
    )
    return result.stdout


# ----------------------------------------------------------------------- pins and floors


def test_grpcio_tools_is_pinned_exactly_in_the_build_requirements() -> None:
    assert str(BUILD_REQUIRES["grpcio-tools"].specifier) == f"=={TOOLS_PIN}"


def test_runtime_grpcio_floor_is_the_grpcio_tools_pin() -> None:
    # grpcio-tools and grpcio are released together; the *_pb2_grpc modules compare
    # grpc.__version__ with the grpcio-tools version that generated them.
    assert _floor(RUNTIME["grpcio"]) == TOOLS_PIN


def test_runtime_protobuf_floor_is_the_protobuf_the_pinned_grpcio_tools_requires() -> None:
    try:
        installed = Version(importlib.metadata.version("grpcio-tools"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("grpcio-tools is not installed in this interpreter (pip install '.[test]')")
    assert installed == TOOLS_PIN, (
        f"grpcio-tools {installed} is installed but pyproject pins {TOOLS_PIN}: reinstall "
        "the test extra (pip install -e '.[test]')"
    )
    tools_needs = _requirements(importlib.metadata.requires("grpcio-tools") or [])
    assert _floor(RUNTIME["protobuf"]) == _floor(tools_needs["protobuf"])
    assert _floor(RUNTIME["grpcio"]) >= _floor(tools_needs["grpcio"])


def test_the_test_extra_carries_the_build_requirements_unchanged() -> None:
    # The suite builds without isolation from the test extra: same requirements, same pin.
    test_extra = {
        str(r)
        for r in _requirements(PYPROJECT["project"]["optional-dependencies"]["test"]).values()
    }
    missing = {str(r) for r in BUILD_REQUIRES.values()} - test_extra
    assert not missing, f"[build-system] requires {sorted(missing)} but the test extra does not"


def test_setup_py_generates_nothing_when_imported() -> None:
    # Code is generated by the build commands only: no call at module level but setup().
    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [
        ast.unparse(node.value.func)
        for node in tree.body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
    ]
    assert calls == ["setup"]
    assert "cythonize" not in {
        alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }


# ----------------------------------------------------------------------- sdist and wheel


def _sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        prefix = tar.getnames()[0].split("/")[0] + "/"
        return {m.name.removeprefix(prefix) for m in tar.getmembers() if m.isfile()}


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as whl:
        return set(whl.namelist())


def _only(directory: Path, pattern: str) -> Path:
    found = list(directory.glob(pattern))
    assert len(found) == 1, (
        f"{pattern} in {directory}: {sorted(p.name for p in directory.iterdir())}"
    )
    return found[0]


@pytest.fixture(scope="session")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist of a copy of the tree with generated files planted in it (pypa `build`,
    no isolation: the build requirements come from the test extra)."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("pypa build is not installed in this interpreter (pip install '.[test]')")
    base = tmp_path_factory.mktemp("sdist")
    src = base / "src"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,  # the sysfs fixtures hold symlink loops, as sysfs does
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", ".*_cache", ".hypothesis", "results",
            ".tools",  # Helm and kubectl for the chart tests (gitignored, 100+ MB)
        ),
    )
    for rel in PLANTED_GENERATED:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("# generated: must not reach the sdist\nraise ImportError\n")
    out = base / "dist"
    build = [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out)]
    _check(_run([*build, str(src)], cwd=base))
    return _only(out, "*.tar.gz")


@pytest.fixture(scope="session")
def wheel(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the sdist alone (this is the one slow step: Cython and gcc)."""
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _check(
        _run([*pip_wheel, "--no-index", "--wheel-dir", str(out), str(sdist)], cwd=out, timeout=600)
    )
    return _only(out, "*.whl")


def _expected_sources() -> set[str]:
    files = {"setup.py", "pyproject.toml", "MANIFEST.in", PYPROJECT["project"]["readme"]}
    for pattern in ("proto/*.proto", "ext/*.pyx", "agent/**/*.py", "agent/**/*.yaml"):
        files |= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)}
    return {f for f in files if not GENERATED.search(f)}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # builds the sdist and the wheel first (600 s limit each)
def test_sdist_carries_every_source_the_wheel_build_reads(sdist: Path) -> None:
    missing = _expected_sources() - _sdist_names(sdist)
    assert not missing, f"the sdist lacks {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # builds the sdist and the wheel first (600 s limit each)
def test_sdist_carries_no_generated_file(sdist: Path) -> None:
    names = _sdist_names(sdist)
    assert not names & set(PLANTED_GENERATED)
    generated = sorted(n for n in names if GENERATED.search(n))
    assert not generated, f"the sdist carries generated files: {generated}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # builds the sdist and the wheel first (600 s limit each)
def test_wheel_from_the_sdist_has_the_engine_the_stubs_and_the_machine_specs(wheel: Path) -> None:
    names = _wheel_names(wheel)
    assert any(re.fullmatch(r"agent/_topo\.[^/]+\.so", n) for n in names), "no agent._topo"
    for stem in _proto_stems():
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"agent/_proto/{stem}{suffix}" in names
    specs = {n for n in _expected_sources() if n.endswith(".yaml")}
    assert specs and specs <= names, f"the wheel lacks {sorted(specs - names)}"
    assert not [n for n in names if "planted" in n], (
        "stale stubs in the source tree reached the wheel"
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)  # builds the sdist and the wheel first (600 s limit each)
def test_stubs_import_each_other_by_their_package_path(wheel: Path) -> None:
    # protoc's own import mapping (the .proto files staged under agent/_proto/), no rewriting
    with zipfile.ZipFile(wheel) as whl:
        for stem in _proto_stems():
            grpc_module = whl.read(f"agent/_proto/{stem}_pb2_grpc.py").decode()
            assert f"\nfrom agent._proto import {stem}_pb2 as " in grpc_module


def _fresh_venv(path: Path, wheel: Path, *requirements: str) -> subprocess.CompletedProcess[str]:
    """A venv with the wheel (no dependencies) and `requirements`, installed by this
    interpreter's pip (`--python`), so the venv needs no pip of its own."""
    _check(_run([sys.executable, "-m", "venv", "--without-pip", str(path)], cwd=path.parent))
    python = path / "bin" / "python"
    _check(
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                str(wheel),
            ],
            cwd=path.parent,
        )
    )
    if not requirements:
        return subprocess.CompletedProcess([], 0, "", "")
    return _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *requirements],
        cwd=path.parent,
        timeout=600,
    )


def _import_script(*extra: str) -> str:
    stems = _proto_stems()
    imports = "; ".join(f"import agent._proto.{s}_pb2_grpc" for s in stems)
    return "\n".join(
        [
            "import agent, agent._topo",
            imports,
            "print(agent.__file__); print(agent._topo.__file__)",
            *extra,
        ]
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)  # builds the sdist and the wheel first (600 s limit each)
def test_installed_wheel_imports_the_engine_and_the_stubs_in_a_fresh_venv(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _fresh_venv(venv, wheel)
    # The dependencies (grpcio, protobuf, PyYAML, ...) come from this interpreter's
    # site-packages, listed after the venv's own: its editable `agent` is not activated
    # (a .pth file in a directory that a .pth line adds is not processed).
    site = _check(
        _run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            cwd=tmp_path,
        )
    ).strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "zz_suite_dependencies.pth").write_text("\n".join(ours) + "\n")
    printed = _check(_run([str(venv / "bin" / "python"), "-c", _import_script()], cwd=tmp_path))
    for module_file in printed.split():
        assert Path(module_file).is_relative_to(venv), f"imported {module_file}, not the wheel's"
    # the console script runs from the wheel with its package data (a built-in machine spec)
    discover = _check(
        _run(
            [str(venv / "bin" / "gpu-topology-agent"), "discover", "--simulate", "single-gpu"],
            cwd=tmp_path,
        )
    )
    assert "GPU0" in discover


@pytest.mark.slow
@pytest.mark.timeout(1500)  # builds the sdist and the wheel first (600 s limit each)
def test_declared_runtime_floors_import_the_stubs_built_by_the_pinned_tools(
    wheel: Path, tmp_path: Path
) -> None:
    grpcio, protobuf = _floor(RUNTIME["grpcio"]), _floor(RUNTIME["protobuf"])
    venv = tmp_path / "floors"
    installed = _fresh_venv(venv, wheel, f"grpcio=={grpcio}", f"protobuf=={protobuf}")
    if installed.returncode != 0 and OFFLINE.search(installed.stdout + installed.stderr):
        pytest.skip(
            f"the package index is unreachable, cannot install the floors: {installed.stderr[-300:]}"
        )
    _check(installed)
    script = _import_script(
        "import grpc, google.protobuf",
        "print('versions', grpc.__version__, google.protobuf.__version__)",
    )
    printed = _check(_run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path))
    assert f"versions {grpcio} {protobuf}" in printed
