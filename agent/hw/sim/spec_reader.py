"""Typed values out of an untrusted spec mapping: each reader checks one value (a mapping with
known keys, a list, an integer in range, a non-empty string, a bus id, a cpulist) and raises
:class:`~agent.errors.InputFormatError` naming the source, the key path and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.errors import InputFormatError
from agent.formats import BusIdError, parse_cpulist, sysfs_to_nvml_bus_id


class SpecReader:
    """Reads one spec mapping; every error names the source and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> InputFormatError:
        return InputFormatError(f"{self.source}: {where}: {what}")

    def mapping(
        self, value: object, where: str, keys: frozenset[str] | None = None
    ) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
        unknown = sorted(set(map(str, value)) - keys) if keys is not None else []
        if unknown:
            raise self.fail(where, f"unknown keys {unknown}; expected some of {sorted(keys or ())}")
        return value

    def seq(self, value: object, where: str) -> Sequence[Any]:
        if value is None:
            return []
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise self.fail(where, f"expected a list, got {type(value).__name__}")
        return value

    def int_(self, value: object, where: str, *, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(where, f"must be >= {minimum}, got {value}")
        return value

    def opt_int(self, value: object, where: str, *, minimum: int | None = None) -> int | None:
        return None if value is None else self.int_(value, where, minimum=minimum)

    def str_(self, value: object, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def opt_str(self, value: object, where: str) -> str | None:
        return None if value is None else self.str_(value, where)

    def bool_(self, value: object, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {value!r}")
        return value

    def bus_id(self, value: object, where: str) -> str:
        try:
            return sysfs_to_nvml_bus_id(self.str_(value, where))
        except BusIdError:
            raise self.fail(where, f"not a PCI bus id: {value!r} (e.g. '0000:3b:00.0')") from None

    def cpulist(self, value: object, where: str) -> str:
        text = self.str_(str(value) if isinstance(value, int) else value, where)
        try:
            parse_cpulist(text)
        except ValueError:
            raise self.fail(where, f"not a cpulist: {value!r} (e.g. '0-19,40-59')") from None
        return text

    def names(self, value: object, where: str) -> tuple[str, ...]:
        return tuple(self.str_(s, where) for s in self.seq(value, where))

    def indices(self, value: object, where: str, n: int) -> tuple[int, ...]:
        out = tuple(self.int_(x, where, minimum=0) for x in self.seq(value, where))
        if any(x >= n for x in out):
            raise self.fail(where, f"GPU indices must be 0..{n - 1}")
        return out
