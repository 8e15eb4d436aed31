"""The layering DESIGN.md writes down, enforced by import-linter contracts
(``pyproject.toml``, ``[tool.importlinter]``); docs/development.md "Architecture" draws the same
layers, row for row (compared below)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed in this interpreter (pip install '.[test]')")
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # lint-imports' own limit is 300 s
def test_every_import_linter_contract_is_kept():
    result = _lint_imports(ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)  # lint-imports' own limit is 300 s
def test_a_layering_violation_is_reported(tmp_path):
    # the same tool on the same package with the layers turned upside down must break:
    # the contracts above are checked against the real import graph, not vacuously kept
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "layers")["layers"]
    upside_down = "\n".join(f'    "{layer}",' for layer in reversed(layers))
    text = (
        '[tool.importlinter]\nroot_package = "agent"\n\n'
        '[[tool.importlinter.contracts]]\nname = "upside down"\ntype = "layers"\n'
        f"layers = [\n{upside_down}\n]\n"
    )
    (tmp_path / "pyproject.toml").write_text(text)
    result = _lint_imports(tmp_path / "pyproject.toml")
    assert result.returncode != 0 and "BROKEN" in result.stdout


def _layer(text: str) -> tuple[str, tuple[str, ...]]:
    """A layer as (separator, modules): ``|`` independent siblings, ``:`` siblings that may
    import each other, ``""`` a single module."""
    separators = set(re.findall(r"[|:]", text))
    assert len(separators) <= 1, f"layer {text!r} mixes | and :"
    return (separators.pop() if separators else "", tuple(m.strip() for m in re.split(r"[|:]", text)))


def _readme_layers(readme: str) -> list[tuple[str, tuple[str, ...]]]:
    """The rows of docs/development.md's Architecture table, top to bottom, in the contract's notation:
    the modules column's `agent/x/` and `agent/x.py` become ``agent.x``, ``\\|`` becomes ``|``."""
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # header, rule
    layers = []
    for row in rows:
        modules = re.split(r"(?<!\\)\|", row)[2]
        text = re.sub(r"`agent/([\w/]+?)(?:/|\.py)`", lambda m: "agent." + m[1].replace("/", "."), modules)
        text = text.replace("\\|", "|")
        assert "`" not in text, f"docs/development.md Architecture: a module that is no agent/ path in row {row!r}"
        layers.append(_layer(text))
    return layers


def test_the_readme_architecture_map_and_the_layers_contract_say_the_same():
    layers = [_layer(layer) for layer in next(c for c in _contracts() if c["id"] == "layers")["layers"]]
    assert _readme_layers((ROOT / "docs" / "development.md").read_text()) == layers


def test_the_readme_comparison_sees_a_stack_drawn_as_siblings():
    # the comparison is not vacuous: the old map (DRA stacked on the device plugin) differs
    readme = (ROOT / "docs" / "development.md").read_text()
    stacked = readme.replace(
        "| kubelet sides | `agent/dra/` \\| `agent/deviceplugin/` |",
        "| kubelet sides | `agent/dra/` |\n| | `agent/deviceplugin/` |",
    )
    assert stacked != readme
    layers = [_layer(layer) for layer in next(c for c in _contracts() if c["id"] == "layers")["layers"]]
    assert _readme_layers(stacked) != layers


def test_the_contracts_cover_every_package_of_the_agent():
    layers = next(c for c in _contracts() if c["id"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in re.split(r"[|:]", layer)}
    top = {
        f"agent.{p.stem}" if p.is_file() else f"agent.{p.name}"
        for p in (ROOT / "agent").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert sorted(top - named - {"agent._proto"}) == []



def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value) + '"'


@pytest.mark.slow
@pytest.mark.timeout(600)  # lint-imports' own limit is 300 s
def test_the_layers_contract_sees_function_level_and_type_checking_imports(tmp_path):
    """DESIGN.md: no module imports one from a layer above it, function-level imports
    included. import-linter's ``layers`` contract is that check: grimp reads every import
    statement of a module, those inside functions too, and, since our
    ``[tool.importlinter]`` does not set ``exclude_type_checking_imports``, those under
    ``if TYPE_CHECKING:`` as well. This runs import-linter with our options on a two-layer
    package whose lower layer imports the upper one only inside a function and only for
    type checking: both must be reported, so nothing else needs adding for the direction
    rule. (Loops between modules, which layers cannot see inside one layer, are checked by
    tests/test_static_checks.py.)"""
    options = {
        k: v for k, v in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"].items()
        if k not in ("root_package", "contracts")
    }
    files = {
        "__init__.py": "",
        "high.py": "X = 1\n",
        "low/__init__.py": "",
        "low/by_function.py": "def f():\n    from layered import high\n    return high\n",
        "low/by_typing.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from layered.high import X\n",
    }
    for name, text in files.items():
        path = tmp_path / "layered" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    config = (
        '[tool.importlinter]\nroot_package = "layered"\n'
        + "".join(f"{k} = {_toml_value(v)}\n" for k, v in options.items())
        + '\n[[tool.importlinter.contracts]]\nname = "down"\ntype = "layers"\n'
        + 'layers = ["layered.high", "layered.low"]\n'
    )
    (tmp_path / "pyproject.toml").write_text(config)
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed in this interpreter (pip install '.[test]')")
    result = subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tmp_path / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0, result.stdout + result.stderr
    assert "layered.low.by_function -> layered.high" in result.stdout, result.stdout
    assert "layered.low.by_typing -> layered.high" in result.stdout, result.stdout
