"""The API server's defaulting and validation of ``resource.k8s.io/v1`` ResourceSlices and
ResourceClaims, as far as the agent's objects and the tests' claims use them: a stand-in for
``kubernetes/pkg/apis/resource/v1/defaults.go`` and
``kubernetes/pkg/apis/resource/validation/validation.go``, with the limits of
``k8s.io/api/resource/v1/types.go`` (v0.36.2). Used with ``dra_allocator_model.py``.

Limits, each with where it comes from (constant in ``k8s.io/api/resource/v1/types.go``, the
check in ``validation.go``):

==================================================  =====  ====================================
devices per slice                                    128   ``ResourceSliceMaxDevices``
devices per slice when any device has taints or      64    ``ResourceSliceMaxDevicesWithAdvancedFeatures``
consumes counters (1.36: or list attributes)               (was ``...WithTaintsOrConsumesCounters``);
                                                           ``validateResourceSliceSpec``
counter sets per slice (``sharedCounters``)          8     ``ResourceSliceMaxCounterSets``;
                                                           ``validateResourceSliceSpec``
counters per counter set                             32    ``ResourceSliceMaxCountersPerCounterSet``;
                                                           ``validateCounterSet``
counter consumptions per device                      2     ``ResourceSliceMaxDeviceCounterConsumptionsPerDevice``;
(``consumesCounters`` entries, one per set)                ``validateDevice``
counters per consumption                             32    ``ResourceSliceMaxCountersPerDeviceCounterConsumption``;
                                                           ``validateDeviceCounterConsumption``
attributes + capacities per device                   32    ``ResourceSliceMaxAttributesAndCapacitiesPerDevice``
string / version attribute length                    64    ``DeviceAttributeMaxValueLength``
attribute name: domain / identifier length           63/32 ``DeviceMaxDomainLength`` / ``DeviceMaxIDLength``
taints per device                                    16    ``DeviceTaintsMaxLength``
requests per claim; devices in one allocation        32    ``DeviceRequestsMaxSize`` = ``AllocationResultsMaxSize``
subrequests per ``firstAvailable``                   8     ``FirstAvailableDeviceRequestMaxSize``
selectors per request; tolerations per request       32/16 ``DeviceSelectorsMaxSize`` / ``DeviceTolerationsMaxLength``
constraints per claim                                32    ``DeviceConstraintsMaxSize``
==================================================  =====  ====================================

Names: object names are DNS subdomains (253); device, counter-set, counter and request names
are DNS labels (63); the pool name is at most 253 characters of DNS subdomains separated by
``/``; the driver name is a CSI driver name (at most 63, a DNS subdomain). A slice holds
``sharedCounters`` or ``devices``, never both, and exactly one of ``nodeName``,
``nodeSelector``, ``allNodes``, ``perDeviceNodeSelection``.

Defaulting (``SetDefaults_ExactDeviceRequest`` / ``SetDefaults_DeviceSubRequest``): an empty
``allocationMode`` becomes ``ExactCount``, and ``count`` 0 with ``ExactCount`` becomes 1.
A toleration's empty operator means ``Equal`` (``ToleratesTaint``).

Where this could differ from the API server: the declarative validation 1.36 adds (``+k8s:``
tags) is read as the same limits; CEL expressions are not compiled (their cost is not
checked); node selectors, binding conditions, consumable capacity and admin access are not
validated beyond their presence; list-type attributes are not known.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_STRING = 64
MAX_TAINTS = 16
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_SELECTORS = 32
MAX_TOLERATIONS = 16
MAX_CONSTRAINTS = 32

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
_LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                         r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[+]?[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def is_label(name: object) -> bool:
    return isinstance(name, str) and len(name) <= 63 and bool(_LABEL.match(name))


def is_subdomain(name: object) -> bool:
    return isinstance(name, str) and len(name) <= 253 and bool(_SUBDOMAIN.match(name))


def _qualified(name: str, path: str) -> list[str]:
    domain, _, ident = name.rpartition("/")
    errs = []
    if domain and (len(domain) > 63 or not is_subdomain(domain)):
        errs.append(f"{path}: domain {domain!r} must be a DNS subdomain of at most 63 characters")
    if len(ident) > 32 or not _C_IDENT.match(ident):
        errs.append(f"{path}: {ident!r} must be a C identifier of at most 32 characters")
    return errs


def _counters(counters: Mapping[str, Any], limit: int, path: str) -> list[str]:
    if not counters:
        return [f"{path}: required"]
    errs = [f"{path}: must have at most {limit} counters"] if len(counters) > limit else []
    for name, c in counters.items():
        if not is_label(name):
            errs.append(f"{path}[{name}]: must be a DNS label")
        if not isinstance(c, Mapping) or not _QUANTITY.match(str(c.get("value", ""))):
            errs.append(f"{path}[{name}].value: must be a quantity")
    return errs


def _attribute(value: Any, path: str) -> list[str]:
    if not isinstance(value, Mapping) or len(value) != 1:
        return [f"{path}: exactly one value must be specified"]
    ((kind, v),) = value.items()
    if kind in ("string", "version") and len(str(v)) > MAX_ATTRIBUTE_STRING:
        return [f"{path}.{kind}: must have at most {MAX_ATTRIBUTE_STRING} characters"]
    if kind == "version" and not _SEMVER.match(str(v)):
        return [f"{path}.version: must be a semver 2.0.0 string"]
    if kind == "int" and not (isinstance(v, int) and not isinstance(v, bool)):
        return [f"{path}.int: must be an integer"]
    if kind == "bool" and not isinstance(v, bool):
        return [f"{path}.bool: must be a boolean"]
    if kind not in ("string", "version", "int", "bool"):
        return [f"{path}: unknown value type {kind!r}"]
    return []


def _device(d: Mapping[str, Any], path: str) -> list[str]:
    errs = [] if is_label(d.get("name")) else [f"{path}.name: must be a DNS label"]
    attrs, caps = d.get("attributes") or {}, d.get("capacity") or {}
    if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES:
        errs.append(f"{path}: the total number of attributes and capacities must not exceed "
                    f"{MAX_ATTRIBUTES_AND_CAPACITIES}")
    for key, value in attrs.items():
        errs += _qualified(key, f"{path}.attributes[{key}]") + _attribute(value, f"{path}.attributes[{key}]")
    for key, value in caps.items():
        errs += _qualified(key, f"{path}.capacity[{key}]")
        if not _QUANTITY.match(str(value.get("value", ""))):
            errs.append(f"{path}.capacity[{key}].value: must be a quantity")
    taints = d.get("taints") or []
    if len(taints) > MAX_TAINTS:
        errs.append(f"{path}.taints: must have at most {MAX_TAINTS} items")
    for i, t in enumerate(taints):
        if not isinstance(t.get("key"), str) or not _LABEL_NAME.match(t["key"]):
            errs.append(f"{path}.taints[{i}].key: must be a label name")
        if t.get("effect") not in ("None", "NoSchedule", "NoExecute"):
            errs.append(f"{path}.taints[{i}].effect: must be one of None, NoSchedule, NoExecute")
    uses = d.get("consumesCounters") or []
    if len(uses) > MAX_CONSUMPTIONS_PER_DEVICE:
        errs.append(f"{path}.consumesCounters: must have at most {MAX_CONSUMPTIONS_PER_DEVICE} items")
    if len({u.get("counterSet") for u in uses}) != len(uses):
        errs.append(f"{path}.consumesCounters: duplicate counterSet")
    for i, u in enumerate(uses):
        if not is_label(u.get("counterSet")):
            errs.append(f"{path}.consumesCounters[{i}].counterSet: must be a DNS label")
        errs += _counters(u.get("counters") or {}, MAX_COUNTERS_PER_CONSUMPTION, f"{path}.consumesCounters[{i}].counters")
    return errs


def _slice_spec(spec: Mapping[str, Any]) -> list[str]:
    errs = []
    driver = spec.get("driver")
    if not (isinstance(driver, str) and len(driver) <= 63 and is_subdomain(driver.lower())):
        errs.append("spec.driver: must be a DNS subdomain of at most 63 characters")
    pool = spec.get("pool") or {}
    name = pool.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= 253 and all(is_subdomain(p) for p in name.split("/"))):
        errs.append("spec.pool.name: must be DNS subdomains separated by '/', at most 253 characters")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] <= 0:
        errs.append("spec.pool.resourceSliceCount: must be greater than zero")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errs.append("spec.pool.generation: must be greater than or equal to zero")
    chosen = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(chosen) != 1:
        errs.append("spec: exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required")
    if spec.get("nodeName") is not None and not is_subdomain(spec["nodeName"]):
        errs.append("spec.nodeName: must be a node name")
    devices, sets = spec.get("devices"), spec.get("sharedCounters")
    if devices is not None and sets is not None:
        errs.append("spec: only one of `sharedCounters` or `devices` is allowed")
    devices, sets = devices or [], sets or []
    advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    if len(devices) > limit:
        errs.append(f"spec.devices: must have at most {limit} items")
    if len({d.get("name") for d in devices}) != len(devices):
        errs.append("spec.devices: duplicate device name")
    for i, d in enumerate(devices):
        errs += _device(d, f"spec.devices[{i}]")
    if len(sets) > MAX_COUNTER_SETS:
        errs.append(f"spec.sharedCounters: must have at most {MAX_COUNTER_SETS} items")
    if len({s.get("name") for s in sets}) != len(sets):
        errs.append("spec.sharedCounters: duplicate counter set name")
    for i, s in enumerate(sets):
        if not is_label(s.get("name")):
            errs.append(f"spec.sharedCounters[{i}].name: must be a DNS label")
        errs += _counters(s.get("counters") or {}, MAX_COUNTERS_PER_SET, f"spec.sharedCounters[{i}].counters")
    return errs


def validate_slice(obj: Mapping[str, Any]) -> list[str]:
    """``ValidateResourceSlice`` for a ``resource.k8s.io/v1`` object: the problems found."""
    errs = []
    if obj.get("apiVersion") != "resource.k8s.io/v1" or obj.get("kind") != "ResourceSlice":
        errs.append("apiVersion/kind: expected resource.k8s.io/v1 ResourceSlice")
    if not is_subdomain((obj.get("metadata") or {}).get("name")):
        errs.append("metadata.name: must be a DNS subdomain of at most 253 characters")
    return errs + _slice_spec(obj.get("spec") or {})


def default_claim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The claim as the API server stores it (``SetDefaults_*``): a copy."""
    out = copy.deepcopy(dict(obj))
    for req in out["spec"]["devices"].get("requests") or ():
        for r in ([req["exactly"]] if req.get("exactly") else []) + list(req.get("firstAvailable") or ()):
            r.setdefault("allocationMode", "ExactCount")
            if r["allocationMode"] == "ExactCount" and not r.get("count"):
                r["count"] = 1
    return out


def _one_request(r: Mapping[str, Any], path: str) -> list[str]:
    errs = [] if is_subdomain(r.get("deviceClassName")) else [f"{path}.deviceClassName: must be a DNS subdomain"]
    mode, count = r.get("allocationMode"), r.get("count", 0)
    if mode == "ExactCount" and not (isinstance(count, int) and count > 0):
        errs.append(f"{path}.count: must be greater than zero")
    elif mode == "All" and count:
        errs.append(f"{path}.count: must not be specified when allocationMode is 'All'")
    elif mode not in ("ExactCount", "All"):
        errs.append(f"{path}.allocationMode: must be ExactCount or All")
    if len(r.get("selectors") or ()) > MAX_SELECTORS:
        errs.append(f"{path}.selectors: must have at most {MAX_SELECTORS} items")
    if len(r.get("tolerations") or ()) > MAX_TOLERATIONS:
        errs.append(f"{path}.tolerations: must have at most {MAX_TOLERATIONS} items")
    return errs


def validate_claim(obj: Mapping[str, Any]) -> list[str]:
    """``ValidateResourceClaim`` for a defaulted ``resource.k8s.io/v1`` claim."""
    devices = (obj.get("spec") or {}).get("devices") or {}
    requests = devices.get("requests") or []
    errs = [] if is_subdomain((obj.get("metadata") or {}).get("name")) else ["metadata.name: must be a DNS subdomain"]
    if len(requests) > MAX_REQUESTS:
        errs.append(f"spec.devices.requests: must have at most {MAX_REQUESTS} items")
    if len({r.get("name") for r in requests}) != len(requests):
        errs.append("spec.devices.requests: duplicate request name")
    names: set[str] = set()
    for i, req in enumerate(requests):
        path = f"spec.devices.requests[{i}]"
        if not is_label(req.get("name")):
            errs.append(f"{path}.name: must be a DNS label")
        names.add(str(req.get("name")))
        subs = req.get("firstAvailable") or []
        if bool(req.get("exactly")) == bool(subs):
            errs.append(f"{path}: exactly one of `exactly` or `firstAvailable` is required")
        if req.get("exactly"):
            errs += _one_request(req["exactly"], f"{path}.exactly")
        if len(subs) > MAX_SUBREQUESTS:
            errs.append(f"{path}.firstAvailable: must have at most {MAX_SUBREQUESTS} items")
        if len({s.get("name") for s in subs}) != len(subs):
            errs.append(f"{path}.firstAvailable: duplicate subrequest name")
        for j, s in enumerate(subs):
            if not is_label(s.get("name")):
                errs.append(f"{path}.firstAvailable[{j}].name: must be a DNS label")
            names.add(f"{req.get('name')}/{s.get('name')}")
            errs += _one_request(s, f"{path}.firstAvailable[{j}]")
    constraints = devices.get("constraints") or []
    if len(constraints) > MAX_CONSTRAINTS:
        errs.append(f"spec.devices.constraints: must have at most {MAX_CONSTRAINTS} items")
    for i, c in enumerate(constraints):
        attrs = [c[k] for k in ("matchAttribute", "distinctAttribute") if c.get(k)]
        if len(attrs) != 1 or "/" not in attrs[0]:
            errs.append(f"spec.devices.constraints[{i}]: exactly one fully qualified matchAttribute or distinctAttribute")
        errs += [f"spec.devices.constraints[{i}].requests: {r!r} is not a request" for r in c.get("requests") or ()
                 if r not in names]
    return errs
