"""The layering DESIGN.md writes down, checked on the source (imports point downward)."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources():
    for path in sorted(AGENT.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        yield path.relative_to(AGENT.parent).as_posix(), imports_of(path)


def test_only_the_nvml_backend_imports_pynvml():
    offenders = [p for p, mods in sources() if "pynvml" in mods and p != "agent/hw/nvml.py"]
    assert offenders == []


def test_hw_and_topology_layers_import_nothing_of_ours_above_them():
    above = ("agent.deviceplugin", "agent.metrics", "agent.labels", "agent.daemon", "agent.cli",
             "agent.commands", "agent.health")
    for path, mods in sources():
        if path.startswith(("agent/hw/", "agent/topology/", "agent/config.py")):
            bad = sorted(m for m in mods if m.startswith(above))
            assert bad == [], f"{path} imports {bad}"


def test_config_imports_nothing_of_ours_but_the_leaf_modules():
    leaves = ("agent.errors", "agent.formats", "agent.records")  # they import nothing above them
    for path, mods in sources():
        if path == "agent/config.py":
            ours = {m for m in mods if m.startswith("agent")}
            others = sorted(m for m in ours if not any(m == leaf or m.startswith(leaf + ".") for leaf in leaves))
            assert ours and others == [], f"agent/config.py imports {others}"


def test_grpc_is_imported_only_by_the_kubelet_facing_modules():
    # agent/metrics/podresources.py is the one exception outside deviceplugin/: it is a
    # client of the kubelet's pod-resources API, read for pod attribution.
    allowed = ("agent/deviceplugin/", "agent/dra/", "agent/metrics/podresources.py", "agent/daemon.py",
               "agent/commands/demo.py", "agent/demo")
    for path, mods in sources():
        if any(m == "grpc" or m.startswith("grpc.") for m in mods):
            assert path.startswith(allowed), f"{path} imports grpc"


def test_the_kubelet_request_path_cannot_reach_nvml():
    # GetPreferredAllocation and Allocate answer from the frozen topology: nothing the
    # device plugin imports (itself, config, health state, topology) may import the NVML
    # backend, so no request can wait on NVML (the anchor re-walks NVML on every call).
    request_path = ("agent/deviceplugin/", "agent/health.py", "agent/topology/", "agent/config.py")
    for path, mods in sources():
        if path.startswith(request_path):
            assert not any(m.startswith("agent.hw") for m in mods), f"{path} imports {sorted(mods)}"
