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
