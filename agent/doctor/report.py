"""The checks' results, how they are run (each in its own thread, each with a timeout) and
how they are shown (one line each, or JSON).

A check is a function of the :class:`~agent.doctor.context.DoctorContext` returning a
:class:`Result`. It never raises to the runner: an exception becomes a WARN saying the check
could not run and why, and a check still running at its timeout becomes a WARN saying so
(its thread is left behind, a daemon: the command ends anyway).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.errors import shorten

if TYPE_CHECKING:  # pragma: no cover
    from agent.doctor.context import DoctorContext

__all__ = ["FAIL", "PASS", "WARN", "Check", "Result", "exit_code", "render_json", "render_table", "run_checks"]

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class Result:
    """One check's outcome: ``status`` (PASS, WARN or FAIL), what was ``found`` and, when not
    PASS, what to do (``action``)."""

    status: str
    found: str
    action: str = ""


def passed(found: str) -> Result:
    return Result(PASS, found)


def warned(found: str, action: str) -> Result:
    return Result(WARN, found, action)


def failed(found: str, action: str) -> Result:
    return Result(FAIL, found, action)


@dataclass(frozen=True)
class Check:
    """A named check (``group.name``), the function that runs it and its timeout."""

    name: str
    run: Callable[[DoctorContext], Result]
    timeout_s: float = 5.0


@dataclass(frozen=True)
class Outcome:
    """A check's result as reported: its name and how long it took."""

    check: str
    result: Result
    duration_s: float


def _run_one(check: Check, context: DoctorContext, slot: list[Outcome]) -> None:
    start = time.monotonic()
    try:
        result = check.run(context)
    except Exception as exc:  # a check that cannot run says why, never a traceback
        result = warned(f"could not run: {shorten(f'{type(exc).__name__}: {exc}', 300)}",
                        "run it again with --log-level DEBUG; report the message if it persists")
    slot.append(Outcome(check.name, result, time.monotonic() - start))


def run_checks(checks: Sequence[Check], context: DoctorContext) -> list[Outcome]:
    """Run every check at once, each in its own daemon thread, and collect the outcomes in
    the order of ``checks``; a check not done within its timeout is a WARN."""
    started = time.monotonic()
    slots: list[list[Outcome]] = [[] for _ in checks]
    threads = [
        threading.Thread(target=_run_one, args=(check, context, slot), name=f"doctor-{check.name}", daemon=True)
        for check, slot in zip(checks, slots)
    ]
    for thread in threads:
        thread.start()
    outcomes = []
    for check, thread, slot in zip(checks, threads, slots):
        thread.join(max(0.0, started + check.timeout_s - time.monotonic()))
        if slot:
            outcomes.append(slot[0])
        else:
            outcomes.append(Outcome(check.name, warned(
                f"did not finish within {check.timeout_s:g} s",
                "something it waits on hangs (NVML, a socket, the API server): run it again; if it"
                " persists, look at what this check reads"), check.timeout_s))
    return outcomes


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """0 when nothing FAILs, 1 otherwise."""
    return 1 if any(o.result.status == FAIL for o in outcomes) else 0


def _counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    return {s.lower(): sum(1 for o in outcomes if o.result.status == s) for s in (PASS, WARN, FAIL)}


def render_table(outcomes: Sequence[Outcome], duration_s: float) -> str:
    """One line per check: status, name, what was found, and ``-> what to do`` when not
    PASS; then a summary line."""
    width = max((len(o.check) for o in outcomes), default=0)
    lines = []
    for o in outcomes:
        line = f"{o.result.status}  {o.check:<{width}}  {o.result.found}"
        if o.result.status != PASS and o.result.action:
            line += f" -> {o.result.action}"
        lines.append(line)
    counts = _counts(outcomes)
    lines.append(f"doctor: {counts['pass']} PASS, {counts['warn']} WARN, {counts['fail']} FAIL"
                 f" in {duration_s:.1f} s")
    return "\n".join(lines)


def render_json(outcomes: Sequence[Outcome], duration_s: float) -> str:
    """``{"checks": [{check, status, found, action, duration_s}], "summary": {pass, warn,
    fail}, "exit_code", "duration_s"}``."""
    return json.dumps({
        "checks": [
            {"check": o.check, "status": o.result.status, "found": o.result.found,
             "action": o.result.action, "duration_s": round(o.duration_s, 3)}
            for o in outcomes
        ],
        "summary": _counts(outcomes),
        "exit_code": exit_code(outcomes),
        "duration_s": round(duration_s, 3),
    }, indent=2)
