"""Shared fixtures, and the suite's plumbing: temporary files on tmpfs, the slow tier first."""

from __future__ import annotations

import os
import tempfile

import pytest

from agent.topology import kernel


def _temporary_files_on_tmpfs() -> None:
    """Every simulated machine is a fake sysfs tree of ~1,500 files written to a temporary
    directory and removed after (tests, and the agents they start, load hundreds): on a disk
    that is most of the suite's system time (4x slower than tmpfs measured on ext4 with
    ``discard``). Where ``TMPDIR`` is unset and /dev/shm is a writable tmpfs with room, the
    suite's temporary files (``tempfile``, ``tmp_path``, the agents' own) go there; an explicit
    ``TMPDIR`` is kept. Set before xdist starts its workers, so they inherit it."""
    shm = "/dev/shm"
    if "TMPDIR" in os.environ or not os.access(shm, os.W_OK | os.X_OK):
        return
    try:
        room = os.statvfs(shm)
    except OSError:
        return
    if room.f_bavail * room.f_frsize < 2 << 30:  # a container's default 64 MiB /dev/shm: no
        return
    os.environ["TMPDIR"] = shm
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


_temporary_files_on_tmpfs()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tier first (a stable sort: the order is the same on every xdist worker), so
    that the longest tests start while the many short ones fill the other workers, instead of
    one of them starting last and leaving the run waiting on it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
