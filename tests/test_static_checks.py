"""The tree passes its own lint and type checks (configured in pyproject.toml), run with the
interpreter that runs the tests; skipped where ruff, mypy or vulture is not installed (the `test`
extra brings them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_tool(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed in this interpreter (pip install '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{' '.join(result.args[2:])} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )


def test_ruff_finds_nothing_in_agent_tests_and_bench():
    _assert_clean(_run_tool("ruff", "check", "--no-cache", "--output-format=concise", "agent", "tests", "bench"))


def test_mypy_finds_no_type_errors_in_agent():
    _assert_clean(_run_tool("mypy"))


def test_vulture_finds_no_dead_code_in_agent():
    # configured in pyproject.toml ([tool.vulture]): tests/ and bench/ are read so that what
    # they use counts as used; only findings in agent/ fail the check
    result = _run_tool("vulture")
    findings = [line for line in result.stdout.splitlines() if line.startswith("agent/")]
    assert result.returncode in (0, 3) and not result.stderr, result.stderr  # 3: it found something
    assert not findings, "unused code (delete it, or name its user in tests/vulture_whitelist.py):\n" + "\n".join(findings)


#: Issue 10: no module of the agent above about 600 lines (the generated gRPC stubs in
#: agent/_proto and the Cython kernel ext/_topo.pyx aside), no function above about 60.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _oversized(path: Path, text: str) -> list[str]:
    """What in one module breaks the size limits: the module itself, and each function
    (nested ones and methods included) measured from its ``def`` to its last line."""
    import ast

    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_no_module_of_the_agent_is_above_600_lines_and_no_function_above_60():
    modules = [p for p in sorted((ROOT / "agent").rglob("*.py")) if "_proto" not in p.relative_to(ROOT).parts]
    assert len(modules) > 20  # the walk found the agent's modules
    found = [f for p in modules for f in _oversized(p.relative_to(ROOT), p.read_text(encoding="utf-8"))]
    assert found == [], "split these by responsibility:\n" + "\n".join(found)


def test_the_size_check_reports_a_long_module_and_a_long_nested_function():
    long_function = "def outer():\n    def inner():\n" + "        x = 1\n" * 60 + "    return inner\n"
    assert _oversized(Path("f.py"), long_function) == [
        "f.py:1 outer: 63 lines (at most 60)", "f.py:2 inner: 61 lines (at most 60)",
    ]
    assert _oversized(Path("m.py"), "x = 1\n" * 601) == ["m.py: 601 lines (at most 600)"]
    assert _oversized(Path("ok.py"), "x = 1\n" * 540 + "def f():\n" + "    pass\n" * 59) == []  # 600 and 60: at the limit
