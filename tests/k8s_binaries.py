"""Where the tests find the Kubernetes binaries they cannot ship: the directory named by the
one environment variable ``GPU_AGENT_K8S_BINARIES``.

Both are built from Kubernetes v1.32 source, which nothing beside the project may carry
(``../shared/tools/README.md``), so a contributor who has them points the variable at their
directory (docs/development.md, "Testing"):

- ``dmharness``: the kubelet's own device manager and topology manager around a fake pod
  admission loop; it starts the agent it is given after ``--`` and writes a JSON summary
  (``tests/conformance/``).
- ``draalloc``: the scheduler's structured DRA allocator
  (``k8s.io/dynamic-resource-allocation/structured``) over slice, class and claim files
  (``tests/test_dra_draalloc.py``; ``bench/quality_dra.py`` reads the same variable).

Where the variable is unset, or the binary is not an executable file in that directory, the
tests that need it skip and say which of the two.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "GPU_AGENT_K8S_BINARIES"

_WHAT = {
    "dmharness": "the kubelet's device and topology managers (Kubernetes v1.32)",
    "draalloc": "the scheduler's structured DRA allocator (Kubernetes v1.32)",
}


def k8s_binary(name: str) -> Path:
    """Where ``name`` would be: in the directory ``$GPU_AGENT_K8S_BINARIES`` (a path that
    cannot exist when the variable is unset; :func:`missing_reason` says why)."""
    folder = os.environ.get(ENV, "")
    return Path(folder, name) if folder else Path("/nonexistent", ENV, name)


def missing_reason(name: str) -> str | None:
    """Why ``name`` cannot run here (None: it can), for ``pytest.skip``."""
    folder = os.environ.get(ENV, "")
    if not folder:
        return (
            f"{ENV} is unset: this needs {name}, {_WHAT[name]}, built from Kubernetes source and "
            f"never shipped; set {ENV} to the directory holding it (docs/development.md, Testing)"
        )
    path = k8s_binary(name)
    if not path.is_file() or not os.access(path, os.X_OK):
        return f"{ENV}={folder} has no executable {name} ({_WHAT[name]})"
    return None
