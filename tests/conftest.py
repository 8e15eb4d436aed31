"""Shared fixtures."""

from __future__ import annotations

import pytest

from agent.topology import engine


@pytest.fixture(params=["cython", "python"])
def impl(request):
    """Runs the test on the Cython extension and on its pure-Python twin."""
    before = engine.IMPLEMENTATION
    engine.use(request.param)
    yield request.param
    engine.use(before)
