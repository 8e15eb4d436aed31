"""Every NVML call the agent makes, and what came back: the record that tells the simulated
NVML (``agent/hw/sim/nvml.py``) from a real driver.

    python bench/real_gpu/nvml_calls.py [--simulate MACHINE] [--out FILE]

The agent's own backend (:class:`agent.hw.nvml.backend.NvmlBackend`) runs its paths
(discovery, two telemetry samples a second apart, health-event registration and one wait,
doctor's per-GPU status)
over a recording wrapper of ``pynvml`` (or of the simulated machine's fake). Each call is
recorded by function name: how often, and each distinct outcome, either ``ok`` with the
returned type (and the value for plain numbers and strings, the length for lists) or the
``NVMLError`` subclass raised. The record is JSON, keyed by function name, so a record from a
real GPU and one from the fake of a like machine can be compared call by call
(:func:`compare_records`); ``run.py`` writes the real one beside its report.

Nothing is changed on the GPU: these are the reads the agent makes in ``run`` mode.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: Values longer than this are cut in the record (names, versions, serials stay whole).
_MAX_VALUE = 120


def describe(result: Any) -> str:
    """One outcome, as text: the type, and the value for plain scalars and strings."""
    if isinstance(result, (bool, int, float)):
        return f"{type(result).__name__} {result!r}"
    if isinstance(result, (str, bytes)):
        return f"{type(result).__name__} {result[:_MAX_VALUE]!r}"
    if isinstance(result, (list, tuple)):
        inner = sorted({type(x).__name__ for x in result})
        return f"{type(result).__name__}[{len(result)}] of {','.join(inner) or '-'}"
    if result is None:
        return "None"
    return type(result).__name__


def filled(args: tuple[Any, ...]) -> str:
    """The integer fields of the structs a call filled through its arguments (``byref``),
    e.g. the fabric state ``nvmlDeviceGetGpuFabricInfoV`` writes; empty when none."""
    out = []
    for arg in args:
        target = getattr(arg, "_obj", arg)
        if isinstance(target, ctypes.Structure):
            fields = [f"{name}={getattr(target, name)}" for name, *_ in target._fields_
                      if isinstance(getattr(target, name), int)]
            out.append(f"{type(target).__name__}({', '.join(fields)})")
    return "; ".join(out)


class RecordingNvml:
    """``pynvml`` (or a fake of it) with every ``nvml*`` function call recorded; constants,
    struct classes and exception classes pass through untouched."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.record: dict[str, dict[str, Any]] = {}

    def _note(self, name: str, outcome: str) -> None:
        entry = self.record.setdefault(name, {"calls": 0, "outcomes": []})
        entry["calls"] += 1
        if outcome not in entry["outcomes"] and len(entry["outcomes"]) < 8:
            entry["outcomes"].append(outcome)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if not (name.startswith("nvml") and callable(value)) or isinstance(value, type):
            return value
        nvml_error = self._lib.NVMLError

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = value(*args, **kwargs)
            except nvml_error as exc:
                self._note(name, f"error {type(exc).__name__}")
                raise
            except Exception as exc:  # a broken binding: recorded, then raised as it came
                self._note(name, f"raised {type(exc).__name__}: {str(exc)[:_MAX_VALUE]}")
                raise
            into = filled(args)
            self._note(name, f"ok {describe(result)}" + (f" into {into}" if into else ""))
            return result

        return call


def record_calls(simulate: str | None) -> dict[str, Any]:
    """Run the agent's NVML paths once over a recording wrapper; the record, with the
    library it ran on."""
    from agent.discovery import open_backend
    from agent.hw.nvml.backend import NvmlBackend
    from agent.hw.nvml.status import read_gpu_status

    from agent.hw.sysfs import SysfsReader

    sim = None
    if simulate:
        plain, sim = open_backend(simulate)
        lib: Any = plain.lib
        sysfs = plain.sysfs
        library = f"simulated:{simulate}"
    else:
        import pynvml

        lib, sysfs = pynvml, SysfsReader("/sys")
        library = f"pynvml {getattr(pynvml, '__version__', '?')} from {os.path.dirname(pynvml.__file__)}"
    recorder = RecordingNvml(lib)
    backend = NvmlBackend(lib=recorder, sysfs=sysfs)
    steps: dict[str, str] = {}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except Exception as exc:  # each path on its own: one failing must not hide the others
            steps[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        steps[name] = "ok"
        return out

    step("init", backend.init)
    try:
        facts = step("read_facts", lambda: backend.read_facts())
        count = len(facts.gpus) if facts is not None else 0
        source = step("sample_source", backend.sample_source)
        if source is not None:
            step("sample 1", lambda: [source.sample(i) for i in range(count)])
            time.sleep(1.0)  # per-process utilisation and energy are differences of samples
            samples = step("sample 2", lambda: [source.sample(i) for i in range(count)])
            step("sample close", source.close)
            if samples:
                steps["sample fields"] = ", ".join(sorted(
                    k for k, v in vars(samples[0]).items() if v is not None)) if samples[0] is not None else "none"
        step("wait_events", lambda: backend.wait_events(200))
        step("gpu status", lambda: [read_gpu_status(backend, i) for i in range(count)])
    finally:
        backend.shutdown()
        if sim is not None:
            sim.close()
    return {"library": library, "steps": steps, "calls": dict(sorted(recorder.record.items()))}


def _kind(outcome: str) -> str:
    """An outcome without its value: ``ok int``, ``error NVMLError_NotSupported``."""
    head, _, rest = outcome.partition(" ")
    if head != "ok":
        return outcome.split(":")[0]
    kind = rest.split(" ")[0]
    # handles are opaque: ctypes pointers in pynvml (LP_struct_...), objects of the fake's own
    return "ok handle" if kind.startswith(("LP_", "_")) else f"ok {kind}"


def compare_records(real: Mapping[str, Any], fake: Mapping[str, Any]) -> list[str]:
    """Where the fake's record differs from the real one: a function only one of them
    called, or a kind of outcome (ok and its type, or the error class) only one of them
    gave. Values (names, temperatures) are not compared: the machines differ."""
    out: list[str] = []
    real_calls, fake_calls = real["calls"], fake["calls"]
    for name in sorted(set(real_calls) | set(fake_calls)):
        if name not in fake_calls:
            out.append(f"{name}: called on the real GPU ({real_calls[name]['outcomes']}), not by the fake's run")
            continue
        if name not in real_calls:
            out.append(f"{name}: called in the fake's run ({fake_calls[name]['outcomes']}), not on the real GPU")
            continue
        r = sorted({_kind(o) for o in real_calls[name]["outcomes"]})
        f = sorted({_kind(o) for o in fake_calls[name]["outcomes"]})
        if r != f:
            out.append(f"{name}: real {r}, fake {f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record every NVML call the agent makes, and its outcome.")
    parser.add_argument("--simulate", default=None, metavar="MACHINE", help="a simulated machine instead of NVML")
    parser.add_argument("--out", default="-", help="where the JSON record goes (default: standard output)")
    parser.add_argument("--compare", nargs=2, metavar=("REAL", "FAKE"), default=None,
                        help="compare two records instead of recording (exit 1 on differences)")
    args = parser.parse_args(argv)
    if args.compare:
        with open(args.compare[0], encoding="utf-8") as f:
            real = json.load(f)
        with open(args.compare[1], encoding="utf-8") as f:
            fake = json.load(f)
        found = compare_records(real, fake)
        sys.stdout.write("".join(line + "\n" for line in found) or "no differences\n")
        return 1 if found else 0
    record = record_calls(args.simulate)
    text = json.dumps(record, indent=1) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
