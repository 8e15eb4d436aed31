"""The shipped DeviceClasses (``daemonset/dra/deviceclass.yaml``, the chart's rendering for
``resource.k8s.io/v1``) and their CEL as the predicates ``tests/testbed/dra_allocator_model.py`` runs
in place of CEL: one place for the tests and the benches (``bench/bench_dra_scheduler.py``,
``bench/quality_dra.py``, ``bench/dra_cost_model.py``) that replay claims against the classes
users install, so that they count the work of the expressions users get.

Each predicate is written from the expression's text, and :func:`check_expressions` fails when
an expression of the file has none (a class changed without its predicate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

from agent.config import DEFAULT_DRIVER_NAME as D

CLASSES_FILE = Path(__file__).resolve().parents[2] / "daemonset" / "dra" / "deviceclass.yaml"
SET_OF_SIZES = (2, 4, 8)  # the chart's set-of-k classes


def _load() -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in yaml.safe_load_all(CLASSES_FILE.read_text()) if c}


BY_NAME = _load()
CLASSES = list(BY_NAME.values())
GPU_CLASS, SET_CLASS = BY_NAME[D], BY_NAME[f"gpuset.{D}"]


def expression(device_class: dict[str, Any]) -> str:
    (selector,) = device_class["spec"]["selectors"]
    return str(selector["cel"]["expression"])


def count_expr(k: int) -> str:
    """A claim's selector on the set size (the example claims' ``gpuCount``)."""
    return f'device.attributes["{D}"].gpuCount == {k}'


def set_alone(k: int) -> dict[str, Any]:
    """A request for one GPU set of k and nothing else (``daemonset/dra/examples``'
    ``best-set-of-4``; ``gpu.gpu-agent.io/set-of-k: 1`` in a pod's limits): the shipped
    ``set-of-k`` class where the chart has one, else the general set class with a ``gpuCount``
    selector (dgx2's sets of 16)."""
    if k in SET_OF_SIZES:
        return {"name": "gpus", "exactly": {"deviceClassName": f"set-of-{k}.{D}", "allocationMode": "ExactCount",
                                            "count": 1}}
    return {"name": "gpus", "exactly": {"deviceClassName": f"gpuset.{D}", "allocationMode": "ExactCount", "count": 1,
                                        "selectors": [{"cel": {"expression": count_expr(k)}}]}}


def profile_expr(profile: str) -> str:
    """A claim's selector on the MIG profile (docs/dra/mig.md's example claims)."""
    return f'device.attributes["{D}"].profile == "{profile}"'


def mig_request(profile: str, name: str = "mig") -> dict[str, Any]:
    """A request for one MIG device of ``profile`` through the shipped MIG class."""
    return {"name": name, "exactly": {"deviceClassName": f"mig.{D}", "allocationMode": "ExactCount", "count": 1,
                                      "selectors": [{"cel": {"expression": profile_expr(profile)}}]}}


def _profiles() -> set[str]:
    from agent.hw.sim.mig_geometry import MIG_MODELS, geometry_for

    return {p.name for m in MIG_MODELS for p in (geometry_for(m) or _NONE).profiles}


def _attrs(d: Any) -> dict[str, Any]:
    return d.attributes.get(D, {}) if d.driver == D else {}


def is_gpu(d: Any) -> bool:
    """The GPU class: full GPUs not held through a GPU set (``heldBySet`` absent counts as false)."""
    a = _attrs(d)
    return a.get("type") == "gpu" and not a.get("heldBySet", False)


def is_set(d: Any, k: int | None = None) -> bool:
    """The set classes: healthy GPU sets (of ``k`` GPUs)."""
    a = _attrs(d)
    return a.get("type") == "gpuset" and bool(a.get("healthy")) and k in (None, a.get("gpuCount"))


CEL: dict[str, Callable[[Any], bool]] = {
    expression(GPU_CLASS): is_gpu,
    expression(BY_NAME[f"mig.{D}"]): lambda d: _attrs(d).get("type") == "mig",
    expression(SET_CLASS): is_set,
    **{expression(BY_NAME[f"set-of-{k}.{D}"]): (lambda d, k=k: is_set(d, k)) for k in SET_OF_SIZES},
    **{count_expr(k): (lambda d, k=k: _attrs(d).get("gpuCount") == k) for k in range(2, 65)},
}
_NONE: Any = type("NoGeometry", (), {"profiles": ()})()
CEL.update({profile_expr(p): (lambda d, p=p: _attrs(d).get("profile") == p) for p in _profiles()})


def check_expressions() -> list[str]:
    """The class expressions of the file without a predicate here."""
    return [name for name, c in BY_NAME.items() if expression(c) not in CEL]
