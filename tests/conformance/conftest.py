"""Hooks of the conformance tier: the ``harness`` fixture runs each test body once per backend
(the stand-in, and the real ``dmharness`` where ``GPU_AGENT_K8S_BINARIES`` has it), and the
harness runs the selected tests need start all at once, in the background, when collection is
done (see dmharness_cases.py); under xdist the workers share them, each case run once
(``SharedRuns``), and a ``--collect-only`` starts none."""

from __future__ import annotations

from pathlib import Path

import pytest
from dmharness_cases import BACKENDS, Harness, SharedRuns, skip_reason

_HARNESSES: dict[str, Harness] = {}
#: set on an xdist worker: the runs it shares with the other workers of the same test run
_SHARED: SharedRuns | None = None


def _harness(backend: str) -> Harness:
    if backend not in _HARNESSES:
        _HARNESSES[backend] = Harness(backend, _SHARED)
    return _HARNESSES[backend]


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
    global _SHARED
    if session.config.option.collectonly:
        return  # nothing runs: start nothing
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None and _SHARED is None:
        _SHARED = SharedRuns.of_worker(workerinput)
    wanted: dict[str, list[str]] = {}
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if Path(str(item.fspath)).parent != Path(__file__).parent or callspec is None:
            continue
        backend = callspec.params.get("harness")
        if backend is not None:
            names = wanted.setdefault(backend, [])
            names.extend(n for n in _cases_of(item) if n not in names)
    for backend, names in wanted.items():
        if names and skip_reason(backend) is None:
            _harness(backend).start(names)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for harness in _HARNESSES.values():
        harness.close()
    if _SHARED is not None and not _HARNESSES:
        _SHARED.done()  # its share of the clean-up: it ran no case, but counts as finished


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest) -> Harness:
    reason = skip_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    return _harness(request.param)
