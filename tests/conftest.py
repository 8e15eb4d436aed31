"""Shared fixtures."""

from __future__ import annotations

import pytest

from agent.topology import kernel


@pytest.fixture(params=["cython", "python"])
def impl(request, monkeypatch):
    """Runs the test on the Cython extension and on its pure-Python twin (as msgpack re-runs
    its suite with its pure-Python switch). A module runs every test on both with
    ``pytestmark = pytest.mark.usefixtures("impl")``: the allocator, model and topology
    suites do. The switch is the kernel module's three names, patched for the test (the
    agent picks its implementation once, at import)."""
    from agent import _topo
    from agent.topology import _pure

    module = _topo if request.param == "cython" else _pure
    monkeypatch.setattr(kernel, "impl", module)
    monkeypatch.setattr(kernel, "IMPLEMENTATION", request.param)
    monkeypatch.setattr(kernel, "EXACT_MAX_GPUS", module.EXACT_MAX_GPUS)
    return request.param
