"""A claim's opaque configuration: how its devices are shared, in NVIDIA's kinds and fields.

The allocation of a ResourceClaim carries the configuration of its DeviceClasses and of the
claim itself (``status.allocation.devices.config[]``: ``source`` ``FromClass`` or
``FromClaim``, optional ``requests``, ``opaque.driver`` and ``opaque.parameters``). Entries
of other drivers are theirs and skipped; ours are decoded strictly, as NVIDIA's DRA driver
decodes them (``api/nvidia.com/resource/v1beta1``), under either API version:

- ``resource.nvidia.com/v1beta1`` (NVIDIA's: a claim written for NVIDIA's driver works with
  only the driver name changed) or ``resource.gpu-agent.io/v1beta1`` (the agent's own);
- kind ``GpuConfig`` (whole GPUs and GPU sets): ``sharing.strategy`` ``TimeSlicing`` (with
  ``timeSlicingConfig.interval``: ``Default``, ``Short``, ``Medium``, ``Long``; ``Default``
  when left out) or ``MPS`` (with ``mpsConfig``);
- kind ``MigDeviceConfig`` (MIG devices): ``sharing.strategy`` ``TimeSlicing`` (nothing to
  set: a MIG device has no interval of its own, there is no ``timeSlicingConfig``) or
  ``MPS``;
- ``mpsConfig``: ``defaultActiveThreadPercentage`` (0-100),
  ``defaultPinnedDeviceMemoryLimit`` (a quantity, every device),
  ``defaultPerDevicePinnedMemoryLimit`` (device index within the request's devices, or UUID
  -> quantity; overrides the default), ``multiUser`` (only ``false``: the agent's MPS
  daemons serve one user).

An unknown field, a wrong type, a value out of its set or a bad quantity is a
:class:`ClaimConfigError` naming the field path within ``parameters``.

Precedence (:func:`config_for`), NVIDIA's: class entries, then claim entries, a later entry
above an earlier one; for each allocated device the highest entry that names its request (a
main request names its subrequests too, as Kubernetes says), or names no request and is of
the device's kind, applies. An entry naming the request but of the other kind (a
``GpuConfig`` for a MIG device) is an error, as in NVIDIA's driver; a device no entry
applies to is not shared.
"""

from __future__ import annotations

import decimal
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from agent.errors import shorten
from agent.formats import parse_quantity
from agent.sharing.timeslice import DEFAULT_INTERVAL, TIMESLICE_INTERVALS

NVIDIA_API_VERSION = "resource.nvidia.com/v1beta1"
AGENT_API_VERSION = "resource.gpu-agent.io/v1beta1"
API_VERSIONS = (NVIDIA_API_VERSION, AGENT_API_VERSION)
GPU_CONFIG = "GpuConfig"
MIG_DEVICE_CONFIG = "MigDeviceConfig"
#: NVIDIA's other kinds of the group: known, not served here.
OTHER_NVIDIA_KINDS = ("VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig")
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
STRATEGIES = (TIME_SLICING, MPS)
FROM_CLASS = "FromClass"
FROM_CLAIM = "FromClaim"
MIB = 1 << 20


class ClaimConfigError(ValueError):
    """One configuration entry cannot apply: the requests it concerns (empty: every request
    of the claim), the field (a path within ``parameters``, or the entry's own key), what is
    wrong, and where the entry comes from."""

    def __init__(self, requests: Sequence[str], field: str, problem: str, origin: str = "") -> None:
        super().__init__(f"{field}: {problem}")
        self.requests = tuple(requests)
        self.field = field
        self.problem = problem
        self.origin = origin

    def line(self, claim: str, claim_requests: Sequence[str]) -> str:
        """The one line the kubelet and the log get: ``<claim> request <r>: <field>: <problem>``."""
        requests = self.requests or tuple(dict.fromkeys(claim_requests))
        who = (f"request {shorten(requests[0])}" if len(requests) == 1
               else "requests " + shorten(", ".join(requests), 200))
        where = f" ({self.origin})" if self.origin else ""
        return f"{claim} {who}: {self.field}: {self.problem}{where}"


@dataclass(frozen=True)
class MpsSettings:
    """``mpsConfig``, limits in MiB (what MPS takes: whole MiB, as NVIDIA's driver rounds)."""

    thread_percentage: int | None = None
    pinned_limit_mib: int | None = None
    #: (device index or UUID as written, MiB), in the order written
    per_device_mib: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SharingConfig:
    """One decoded ``GpuConfig`` or ``MigDeviceConfig``."""

    kind: str
    strategy: str | None = None  # None: no sharing asked
    interval: str | None = None  # TimeSlicing on a GpuConfig
    mps: MpsSettings | None = None  # MPS


@dataclass(frozen=True)
class ConfigEntry:
    """One entry of ``status.allocation.devices.config`` that is ours."""

    source: str
    requests: tuple[str, ...]
    config: SharingConfig
    origin: str  # where it comes from, for messages


def read_configs(allocation: Mapping[str, Any], driver_name: str) -> list[ConfigEntry]:
    """The entries of ``driver_name`` in ``allocation`` (``status.allocation``), lowest
    precedence first: every ``FromClass`` entry, then every ``FromClaim`` entry, each in
    their order. Raises :class:`ClaimConfigError` for the first that cannot be decoded."""
    entries = allocation.get("devices", {}).get("config") if isinstance(allocation.get("devices"), Mapping) else None
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ClaimConfigError((), "status.allocation.devices.config", "expected a list")
    by_source: dict[str, list[ConfigEntry]] = {FROM_CLASS: [], FROM_CLAIM: []}
    claim_index = 0
    for i, raw in enumerate(entries):
        at = f"status.allocation.devices.config[{i}]"
        if not isinstance(raw, Mapping):
            raise ClaimConfigError((), at, f"expected an object, got {shorten(repr(raw))}")
        requests = _requests(raw.get("requests"), at)
        source = raw.get("source")
        if source not in by_source:
            raise ClaimConfigError(requests, f"{at}.source",
                                   f"{shorten(repr(source))} is not {FROM_CLASS} or {FROM_CLAIM}")
        origin = (f"the claim's spec.devices.config[{claim_index}]" if source == FROM_CLAIM
                  else "a config of the request's DeviceClass")
        claim_index += source == FROM_CLAIM
        opaque = raw.get("opaque")
        if not isinstance(opaque, Mapping):
            raise ClaimConfigError(requests, "opaque", "missing: this driver reads opaque configuration only", origin)
        if opaque.get("driver") != driver_name:
            continue  # another driver's business
        try:
            config = decode_parameters(opaque.get("parameters"))
        except ClaimConfigError as exc:
            raise ClaimConfigError(requests, exc.field, exc.problem, origin) from None
        by_source[source].append(ConfigEntry(source, requests, config, origin))
    return by_source[FROM_CLASS] + by_source[FROM_CLAIM]


def config_for(entries: Sequence[ConfigEntry], request: str, mig: bool, device: str) -> ConfigEntry | None:
    """The entry that configures the allocated ``device`` (a MIG device when ``mig``) of
    ``request`` (see the module), or None; ClaimConfigError for an entry naming the request
    that is of the other kind."""
    kind = MIG_DEVICE_CONFIG if mig else GPU_CONFIG
    for entry in reversed(entries):
        if entry.requests:
            if not any(r == request or request.startswith(r + "/") for r in entry.requests):
                continue
            if entry.config.kind != kind:
                what = "a MIG device" if mig else "a whole GPU" if device.startswith("gpu-") else "a GPU set"
                raise ClaimConfigError((request,), "kind", f"{entry.config.kind} cannot configure device {device}"
                                       f" ({what}): use {kind}", entry.origin)
            return entry
        if entry.config.kind == kind:
            return entry
    return None


# ---------------------------------------------------------------------- decoding
def decode_parameters(params: object) -> SharingConfig:
    """``opaque.parameters`` as a :class:`SharingConfig`; ClaimConfigError naming the field."""
    obj = _object(params, "opaque.parameters")
    _known(obj, ("apiVersion", "kind", "sharing"), "")
    version = obj.get("apiVersion")
    if version not in API_VERSIONS:
        raise ClaimConfigError((), "apiVersion", f"{_shown(version)} is not one of {', '.join(API_VERSIONS)}")
    kind = obj.get("kind")
    if kind in OTHER_NVIDIA_KINDS:
        raise ClaimConfigError((), "kind", f"{kind} is not served by this driver (it serves {GPU_CONFIG} and"
                               f" {MIG_DEVICE_CONFIG})")
    if kind not in (GPU_CONFIG, MIG_DEVICE_CONFIG):
        raise ClaimConfigError((), "kind", f"{_shown(kind)} is not {GPU_CONFIG} or {MIG_DEVICE_CONFIG}")
    sharing = obj.get("sharing")
    if sharing is None:
        return SharingConfig(kind)
    sharing = _object(sharing, "sharing")
    gpu = kind == GPU_CONFIG
    _known(sharing, ("strategy", "timeSlicingConfig", "mpsConfig") if gpu else ("strategy", "mpsConfig"), "sharing")
    strategy = sharing.get("strategy")
    if strategy not in STRATEGIES:
        problem = "missing" if strategy is None else f"{_shown(strategy)} is not a strategy"
        raise ClaimConfigError((), "sharing.strategy", f"{problem}: expected {' or '.join(STRATEGIES)}")
    slicing, mps = sharing.get("timeSlicingConfig"), sharing.get("mpsConfig")
    if strategy == TIME_SLICING:
        if mps is not None:
            raise ClaimConfigError((), "sharing.mpsConfig", f"not allowed with strategy {TIME_SLICING}")
        return SharingConfig(kind, strategy, _interval(slicing) if gpu else None)
    if slicing is not None:
        raise ClaimConfigError((), "sharing.timeSlicingConfig", f"not allowed with strategy {MPS}")
    return SharingConfig(kind, strategy, mps=_mps(mps))


def _interval(value: object) -> str:
    if value is None:
        return DEFAULT_INTERVAL
    obj = _object(value, "sharing.timeSlicingConfig")
    _known(obj, ("interval",), "sharing.timeSlicingConfig")
    interval = obj.get("interval")
    if interval is None:
        return DEFAULT_INTERVAL
    if interval not in TIMESLICE_INTERVALS:
        raise ClaimConfigError((), "sharing.timeSlicingConfig.interval", f"{_shown(interval)} is not an interval:"
                               f" expected one of {', '.join(TIMESLICE_INTERVALS)}")
    return str(interval)


def _mps(value: object) -> MpsSettings:
    if value is None:
        return MpsSettings()
    at = "sharing.mpsConfig"
    obj = _object(value, at)
    _known(obj, ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                 "defaultPerDevicePinnedMemoryLimit", "multiUser"), at)
    percentage = obj.get("defaultActiveThreadPercentage")
    if percentage is not None and (isinstance(percentage, bool) or not isinstance(percentage, int)):
        raise ClaimConfigError((), f"{at}.defaultActiveThreadPercentage", f"{_shown(percentage)} is not an integer")
    if percentage is not None and not 0 <= percentage <= 100:
        raise ClaimConfigError((), f"{at}.defaultActiveThreadPercentage", f"{percentage} is not a percentage 0-100")
    limit = obj.get("defaultPinnedDeviceMemoryLimit")
    per_device = obj.get("defaultPerDevicePinnedMemoryLimit")
    per_device_mib: list[tuple[str, int]] = []
    if per_device is not None:
        for key, quantity in _object(per_device, f"{at}.defaultPerDevicePinnedMemoryLimit").items():
            per_device_mib.append((str(key), _mib(quantity, f"{at}.defaultPerDevicePinnedMemoryLimit.{key}")))
    multi_user = obj.get("multiUser")
    if multi_user is not None and not isinstance(multi_user, bool):
        raise ClaimConfigError((), f"{at}.multiUser", f"{_shown(multi_user)} is not true or false")
    if multi_user:
        raise ClaimConfigError((), f"{at}.multiUser", "true is not supported: the agent's MPS daemons serve the"
                               " pods of one user (leave it out or false)")
    return MpsSettings(percentage, None if limit is None else _mib(limit, f"{at}.defaultPinnedDeviceMemoryLimit"),
                       tuple(per_device_mib))


def _mib(value: object, at: str) -> int:
    """A quantity (a string, or a JSON number as Kubernetes takes it) in whole MiB: its
    value in bytes rounded up, then down to MiB, as NVIDIA's driver computes it; at least 1."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ClaimConfigError((), at, f"{_shown(value)} is not a quantity (expected a string such as 10Gi)")
    text = value if isinstance(value, str) else repr(value)
    try:
        amount = parse_quantity(text)
    except ValueError as exc:
        raise ClaimConfigError((), at, str(exc)) from None
    mib = int(amount.to_integral_value(rounding=decimal.ROUND_CEILING)) // MIB
    if mib < 1:
        raise ClaimConfigError((), at, f"{shorten(text)} is below 1Mi, the least pinned memory MPS can be given")
    return mib


def _requests(value: object, at: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(r, str) for r in value):
        raise ClaimConfigError((), f"{at}.requests", f"expected a list of request names, got {shorten(repr(value))}")
    return tuple(value)


def _object(value: object, at: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ClaimConfigError((), at, f"expected an object, got {_shown(value)}")
    return value


def _known(obj: Mapping[str, Any], fields: tuple[str, ...], at: str) -> None:
    unknown = [k for k in obj if k not in fields]
    if unknown:
        path = f"{at}.{unknown[0]}" if at else str(unknown[0])
        raise ClaimConfigError((), shorten(path, 200), f"unknown field (expected {', '.join(fields)})")


def _shown(value: object) -> str:
    return "nothing" if value is None else shorten(repr(value))
