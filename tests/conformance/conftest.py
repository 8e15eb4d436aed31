"""Hooks of the conformance tier: start the harness runs the selected tests need, all at
once and in the background, when collection is done (see dmharness_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dmharness_cases import Harness, skip_reason

_HARNESS: Harness | None = None


def _cases_of(item: pytest.Item) -> list[str]:
    names: list[str] = []
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "case" in callspec.params:
        names.append(callspec.params["case"])
    for mark in item.iter_markers("cases"):
        names.extend(mark.args)
    return names


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cases(*names): the harness cases a conformance test reads")


def pytest_collection_finish(session: pytest.Session) -> None:
    global _HARNESS
    wanted: list[str] = []
    for item in session.items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            wanted.extend(n for n in _cases_of(item) if n not in wanted)
    if wanted and skip_reason() is None:
        _HARNESS = Harness()
        _HARNESS.start(wanted)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _HARNESS is not None:
        _HARNESS.close()


@pytest.fixture
def harness() -> Harness:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness()
    return _HARNESS
