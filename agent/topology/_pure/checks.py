"""The twin's limits and argument checks: every public entry point checks its arguments
(type, then range) and raises TypeError or ValueError with the message the extension uses."""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from agent.records import (
    MAX_GPUS as MAX_GPUS,  # re-exported: the engine API (agent.topology.kernel)
)

#: Largest number of GPUs solved exactly (bitmask tables of 2**n entries). The extension
#: compiles the same number in; ``engine.EXACT_MAX_GPUS`` reads it from the implementation
#: in use and a test checks that both agree.
EXACT_MAX_GPUS = 16
#: Largest pair score and device rank the kernel accepts.
SCORE_MAX = 2**31 - 1
COUNT_MAX = 2**31 - 1


def int_in(v: object, what: str, lo: int, hi: int) -> int:
    """``v`` when it is an int (not a bool, not a subclass) in ``lo..hi``."""
    if type(v) is not int:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{what} {v} outside {lo}..{hi}")
    return v


def gpu_mask(v: object, what: str, n: int) -> int:
    """``v`` when it is an int bitmask of GPUs 0..n-1."""
    if type(v) is not int:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if v < 0 or v >> n:
        raise ValueError(f"{what} {v:#x} is not a set of the node's {n} GPUs")
    return v


def bits(mask: int) -> list[int]:
    """Indices of the set bits of ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def mask_indices(mask: int) -> list[int]:
    """Set bits of ``mask`` (a 64-bit mask), ascending."""
    return bits(gpu_mask(mask, "mask", MAX_GPUS))


def bounds(start: Sequence[int], n: int) -> list[int]:
    """``start`` when it holds n + 1 non-decreasing ints from 0 (GPU g's device ranks are
    ``start[g]`` to ``start[g + 1] - 1``)."""
    if len(start) != n + 1:
        raise ValueError(f"start has {len(start)} entries for {n} GPUs (expected {n + 1})")
    out: list[int] = []
    lo = 0
    for i in range(n + 1):
        lo = int_in(start[i], f"start[{i}]", lo, 0 if i == 0 else COUNT_MAX)
        out.append(lo)
    return out


def ranks(values: Sequence[int], what: str, total: int) -> list[int]:
    """``values`` when they are strictly ascending ints in 0..total-1."""
    out: list[int] = []
    lo = 0
    for i in range(len(values)):
        out.append(int_in(values[i], f"{what}[{i}]", lo, total - 1))
        lo = out[-1] + 1
    return out


def per_gpu(ascending: list[int], start: list[int]) -> list[int]:
    """How many of the ascending ranks each GPU holds."""
    at = [bisect_left(ascending, s) for s in start]
    return [b - a for a, b in zip(at, at[1:])]
