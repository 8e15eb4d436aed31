"""Shared fixtures."""

from __future__ import annotations

import pytest

from agent.topology import kernel


@pytest.fixture(params=["cython", "python"])
def impl(request):
    """Runs the test on the Cython extension and on its pure-Python twin (as msgpack re-runs
    its suite with its pure-Python switch). A module runs every test on both with
    ``pytestmark = pytest.mark.usefixtures("impl")``: the allocator, model and topology
    suites do."""
    before = kernel.IMPLEMENTATION
    kernel.use(request.param)
    yield request.param
    kernel.use(before)
