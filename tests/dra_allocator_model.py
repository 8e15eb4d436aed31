"""A model of the scheduler's DRA allocator, for the tests and ``bench/quality_dra.py``.

The allocator kube-scheduler runs is Go code in ``k8s.io/dynamic-resource-allocation/structured``
and cannot ship with this project. This is a small Python model of the variant Kubernetes 1.36
picks whenever a beta feature is on (``internal/incubating``, v0.36.2:
``allocator_incubating.go``, ``pools_incubating.go``, ``constraint.go``), written from that code
and following it function by function. The API server's defaulting and validation of the
objects it reads are in ``dra_api_validation.py`` beside it.

What it follows, by upstream function:

* ``GatherPools`` / ``addSlice`` / ``buildPool`` -> :func:`gather_pools`: a slice is relevant
  when it carries ``sharedCounters`` (always) or its ``nodeName`` is the node or ``allNodes``
  is set; slices are grouped by (driver, pool name), an older generation is dropped, a newer
  one replaces the slices seen so far; a pool with fewer slices than ``resourceSliceCount``
  is incomplete (never allocated from). ``buildPool`` sorts a pool's slices by name, splits
  counter-set slices from device slices, and marks the pool invalid for a device name seen
  twice, a counter-set name seen twice, or a device consuming a counter set or counter that
  does not exist. Pools are sorted by driver, then pool name (``sortPoolsByID``).
* ``Allocate`` (claim checks) -> :meth:`AllocatorModel.allocate`: per request (or each
  subrequest of ``firstAvailable``) the device class is looked up and the count taken
  (``validateDeviceRequest``; ``All`` collects the selectable devices up front and refuses
  incomplete or invalid pools); a claim whose smallest possible device count exceeds
  ``AllocationResultsMaxSize`` (32) is an error; ``matchAttribute`` and ``distinctAttribute``
  constraints are built per claim.
* ``allocateOne`` -> :meth:`_Search.one`: claims in order, requests in order, devices of a
  request one after the other; a request with subrequests tries them in order and keeps the
  first that completes the whole search (``selectedSubRequestIndex``); the devices of one
  request are tried in pool, slice, device order from the position after the previous one
  (combinations, never permutations); depth first, first complete answer wins; the
  ``errAllocationResultMaxSizeExceeded`` back-off is kept.
* ``allocateDevice`` -> :meth:`_Search.device`: in use (allocated before, or taken by this
  search) -> skip; counters (``checkAvailableCounters``): the pool's counter sets minus what
  the already allocated devices consume, minus what this search holds, must cover the
  device's consumption, else it is given back and the device skipped; then taints
  (``taintPreventsAllocation``: ``NoSchedule`` / ``NoExecute`` without a matching toleration,
  ``ToleratesTaint``'s rules; other effects ignored); then the claim's constraints. The undo
  closure gives back constraints, the in-use mark, the counters and the result entry.
* ``isSelectable`` / ``selectorsMatch``: the class's selectors, then the request's, all must
  match; cached per search as upstream caches per ``Allocate`` call.

Where model and upstream could differ:

* **Selectors are Python predicates, not CEL**: a claim or class still carries
  ``{"cel": {"expression": ...}}``; the model looks each expression up in the ``cel`` mapping
  it was given (expression text -> predicate over a :class:`DeviceView`) and raises for one it
  does not know. A predicate that disagrees with the CEL it stands for is the test's bug.
* **The counter leak of v0.36**: ``allocateDevice`` reserves a device's counters *before* it
  checks taints and constraints, and a device rejected by either keeps its counters reserved
  for the rest of that ``Allocate`` call (kubernetes/kubernetes#140436, fixed on master by
  #140431, not in v0.36.2). ``leak_rejected_counters=True`` (the default) models v0.36.2;
  False models the fix. Consequence for a driver: a tainted set device blocks its healthy
  members' singles and every overlapping set for the rest of the search that met it.
* Counter bookkeeping is keyed by pool name alone, as upstream's is (not by driver and pool):
  two drivers publishing pools of the same name share it. Give each driver its own model (or
  its own pool names) to stay clear of it, as ``bench/quality_dra.py`` does.
* Counter checks: upstream compares every counter of every set in the pool on each
  candidate; the model compares the counters the candidate touches plus a per-pool flag
  "some counter is already over-committed by allocated devices" (then no counter-consuming
  device of the pool fits, as upstream). Same answers, less work.
* Not modelled (an input using them raises :class:`NotModelled`): ``nodeSelector`` and
  ``perDeviceNodeSelection`` slices, slices of other nodes that share a pool with this node's
  (``checkSlicesInPool``), binding conditions (their pools go last upstream), admin access,
  consumable capacity (``allowMultipleAllocations``, capacity requests), DeviceTaintRules
  (taints not in the slice). The allocation result's node selector and configs are not built.
* Quantities: counters and capacities are parsed as exact integers (plain, or with a decimal
  or binary suffix); fractional quantities raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

ALLOCATION_RESULTS_MAX_SIZE = 32  # k8s.io/api/resource/v1 AllocationResultsMaxSize


class NotModelled(ValueError):
    """The input uses an upstream feature this model leaves out (see the module docstring)."""


class AllocationError(ValueError):
    """What upstream's ``Allocate`` returns as an error (not "unschedulable", which is None)."""


@dataclass(frozen=True)
class DeviceView:
    """What a selector sees (CEL's ``device``): ``attributes[domain][id]`` and
    ``capacity[domain][id]`` hold plain values; names without a domain are the driver's."""

    driver: str
    name: str
    attributes: Mapping[str, Mapping[str, Any]]
    capacity: Mapping[str, Mapping[str, int]]


Predicate = Callable[[DeviceView], bool]
DeviceId = tuple[str, str, str]  # driver, pool, device


_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(text: object) -> int:
    """An integer Kubernetes quantity (``"1"``, ``"80Gi"``); NotModelled for anything else."""
    m = _QUANTITY.match(str(text))
    if not m:
        raise NotModelled(f"quantity {text!r}: only integer quantities are modelled")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def _plain(value: Mapping[str, Any]) -> Any:
    ((_, v),) = value.items()
    return v


def _by_domain(driver: str, entries: Mapping[str, Any], plain: Callable[[Any], Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in entries.items():
        domain, _, ident = key.rpartition("/")
        out.setdefault(domain or driver, {})[ident] = plain(value)
    return out


@dataclass
class Device:
    """A device of a pool as the search sees it (``deviceWithID``)."""

    id: DeviceId
    spec: Mapping[str, Any]
    pool: Pool
    view: DeviceView
    consumes: tuple[tuple[str, str, int], ...]  # (counter set, counter, amount)
    taints: tuple[Mapping[str, Any], ...]


@dataclass
class Pool:
    driver: str
    name: str
    incomplete: bool = False
    invalid: str = ""
    devices: list[Device] = field(default_factory=list)  # slices by name, devices in slice order
    counters: dict[tuple[str, str], int] = field(default_factory=dict)  # (set, counter) -> value


def _slice_relevant(spec: Mapping[str, Any], node: str) -> bool:
    if spec.get("sharedCounters"):
        return True
    if spec.get("nodeSelector") is not None or spec.get("perDeviceNodeSelection"):
        raise NotModelled("nodeSelector / perDeviceNodeSelection slices are not modelled")
    return spec.get("nodeName") == node or bool(spec.get("allNodes"))


def gather_pools(slices: Iterable[Mapping[str, Any]], node: str) -> list[Pool]:
    """``GatherPools`` + ``buildPool`` for the slices relevant to ``node`` (module docstring)."""
    by_pool: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in slices:
        spec = s["spec"]
        if not _slice_relevant(spec, node):
            continue
        key = (spec["driver"], spec["pool"]["name"])
        seen = by_pool.setdefault(key, [])
        gen = spec["pool"]["generation"]
        if seen and gen < seen[0]["spec"]["pool"]["generation"]:
            continue
        if seen and gen > seen[0]["spec"]["pool"]["generation"]:
            seen.clear()
        seen.append(s)
    pools = [_build_pool(driver, name, objs) for (driver, name), objs in by_pool.items()]
    return sorted(pools, key=lambda p: (p.driver, p.name))


def _build_pool(driver: str, name: str, objs: list[Mapping[str, Any]]) -> Pool:
    pool = Pool(driver, name)
    if len(objs) != objs[0]["spec"]["pool"]["resourceSliceCount"]:
        pool.incomplete = True
        return pool
    objs = sorted(objs, key=lambda s: s["metadata"]["name"])
    sets: set[str] = set()
    for s in objs:
        for cs in s["spec"].get("sharedCounters") or ():
            if cs["name"] in sets:
                pool.invalid = f"duplicate counter set name {cs['name']}"
                return pool
            sets.add(cs["name"])
            for counter, c in cs["counters"].items():
                pool.counters[(cs["name"], counter)] = quantity(c["value"])
    names: set[str] = set()
    for s in objs:
        if s["spec"].get("sharedCounters"):
            continue
        for d in s["spec"].get("devices") or ():
            if d["name"] in names:
                pool.invalid = f"duplicate device name {d['name']}"
                return pool
            names.add(d["name"])
            if d.get("bindingConditions") or d.get("allowMultipleAllocations"):
                raise NotModelled("binding conditions / multiple allocations are not modelled")
            consumes = []
            for use in d.get("consumesCounters") or ():
                if use["counterSet"] not in sets:
                    pool.invalid = f"counter set {use['counterSet']} not found"
                    return pool
                for counter, c in use["counters"].items():
                    if (use["counterSet"], counter) not in pool.counters:
                        pool.invalid = f"counter {counter} not found in counter set {use['counterSet']}"
                        return pool
                    consumes.append((use["counterSet"], counter, quantity(c["value"])))
            view = DeviceView(driver, d["name"], _by_domain(driver, d.get("attributes") or {}, _plain),
                              _by_domain(driver, d.get("capacity") or {}, lambda c: quantity(c["value"])))
            pool.devices.append(Device((driver, name, d["name"]), d, pool, view, tuple(consumes),
                                       tuple(d.get("taints") or ())))
    return pool


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """``resourceclaim.ToleratesTaint``: effect (empty: all), key (empty: all), then the
    operator: Equal (or empty) compares values, Exists matches any, others match nothing."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Equal":
        return toleration.get("value", "") == taint.get("value", "")
    return op == "Exists"


def taint_prevents(device: Device, tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """``taintPreventsAllocation``: only NoSchedule and NoExecute count."""
    tols = list(tolerations)
    return any(t.get("effect") in ("NoSchedule", "NoExecute") and not any(tolerates(x, t) for x in tols)
               for t in device.taints)


@dataclass
class _Request:
    """One request or subrequest (``requestData``)."""

    name: str  # "req" or "req/sub"
    base: str  # the request's name (constraints name it, or "req/sub")
    sub: str  # the subrequest's name, "" for a plain request
    spec: Mapping[str, Any]  # ExactDeviceRequest / DeviceSubRequest, defaulted
    class_selectors: tuple[Predicate, ...]
    selectors: tuple[Predicate, ...]
    count: int
    all_devices: list[Device] | None = None


class _MaxSizeExceeded(Exception):
    """``errAllocationResultMaxSizeExceeded``."""


def lookup_attribute(device: Device, name: str) -> Any:
    """``lookupAttribute``: a fully qualified name; the driver's own domain may be omitted in
    the slice. Returns the plain value or None."""
    domain, _, ident = name.rpartition("/")
    return device.view.attributes.get(domain, {}).get(ident)


class _Constraint:
    """``matchAttributeConstraint`` (``distinct=False``) and ``distinctAttributeConstraint``."""

    def __init__(self, requests: Iterable[str], attribute: str, distinct: bool) -> None:
        self.requests, self.attribute, self.distinct = set(requests), attribute, distinct
        self.values: list[Any] = []

    def applies(self, req: _Request) -> bool:
        return not self.requests or req.base in self.requests or (bool(req.sub) and req.name in self.requests)

    def add(self, req: _Request, device: Device) -> bool:
        if not self.applies(req):
            return True
        value = lookup_attribute(device, self.attribute)
        if value is None:
            return False
        if self.values and (value in self.values if self.distinct else value != self.values[0]):
            return False
        self.values.append(value)
        return True

    def remove(self, req: _Request, device: Device) -> None:
        if self.applies(req):
            self.values.pop()


class AllocatorModel:
    """``NewAllocator`` over ``slices`` (v1 objects), ``classes`` (v1 DeviceClass objects) and
    ``allocated`` (device IDs of claims allocated before: they are in use and their counters
    consumed; the attribute may be replaced between calls, as the scheduler builds a new
    allocator with the current state each cycle). ``cel`` maps every CEL expression the
    classes and claims use to a predicate. The pools of a node are gathered once and reused
    (they depend on the slices and the node only)."""

    def __init__(self, slices: Iterable[Mapping[str, Any]], classes: Iterable[Mapping[str, Any]],
                 cel: Mapping[str, Predicate], allocated: Iterable[DeviceId] = (), *,
                 leak_rejected_counters: bool = True) -> None:
        self.slices = list(slices)
        self.classes = {c["metadata"]["name"]: c for c in classes}
        self.cel = dict(cel)
        self.allocated = set(allocated)
        self.leak = leak_rejected_counters
        self.steps = 0  # allocateOne invocations of the last allocate() (numAllocateOneInvocations)
        self._pools: dict[str, list[Pool]] = {}

    def predicates(self, selectors: Iterable[Mapping[str, Any]], where: str) -> tuple[Predicate, ...]:
        out = []
        for i, sel in enumerate(selectors):
            expr = (sel.get("cel") or {}).get("expression")
            if expr is None:
                raise AllocationError(f"{where}, selector #{i}: CEL expression empty (unsupported selector type?)")
            if expr not in self.cel:
                raise NotModelled(f"{where}, selector #{i}: no predicate given for CEL {expr!r}")
            out.append(self.cel[expr])
        return tuple(out)

    def allocate(self, claims: list[Mapping[str, Any]], node: str) -> list[list[tuple[str, DeviceId]]] | None:
        """Per claim, its results in order as (request name, device ID); None when the claims
        cannot all be allocated on ``node`` (unschedulable); AllocationError as upstream errs."""
        pools = self._pools.get(node)
        if pools is None:
            pools = self._pools[node] = gather_pools(self.slices, node)
        search = _Search(self, pools, [self._requests(c, pools) for c in claims],
                         [self._constraints(c) for c in claims])
        done = search.one(0, 0, 0, 0, False, (0, 0))
        self.steps = search.steps
        if not done:
            if any(p.invalid for p in pools):
                raise AllocationError("invalid resource pools were encountered")
            return None
        return [[(r.name, d.id) for r, d in res] for res in search.result]

    def _constraints(self, claim: Mapping[str, Any]) -> list[_Constraint]:
        out = []
        for i, c in enumerate(claim["spec"]["devices"].get("constraints") or ()):
            if c.get("matchAttribute"):
                out.append(_Constraint(c.get("requests") or (), c["matchAttribute"], False))
            elif c.get("distinctAttribute"):
                out.append(_Constraint(c.get("requests") or (), c["distinctAttribute"], True))
            else:
                raise AllocationError(f"constraint #{i}: empty constraint (unsupported constraint type?)")
        return out

    def _requests(self, claim: Mapping[str, Any], pools: list[Pool]) -> list[list[_Request]]:
        """Per request, its alternatives: one for a plain request, one per subrequest."""
        name = claim["metadata"]["name"]
        out, least_total = [], 0
        for req in claim["spec"]["devices"]["requests"]:
            if req.get("firstAvailable"):
                alts = [self._request(name, f"{req['name']}/{s['name']}", req["name"], s["name"], s, pools)
                        for s in req["firstAvailable"]]
            else:
                alts = [self._request(name, req["name"], req["name"], "", req["exactly"], pools)]
            least_total += min(a.count for a in alts)
            out.append(alts)
        if least_total > ALLOCATION_RESULTS_MAX_SIZE:
            raise AllocationError(f"claim {name}: number of requested devices {least_total} exceeds the claim "
                                  f"limit of {ALLOCATION_RESULTS_MAX_SIZE}")
        return out

    def _request(self, claim: str, name: str, base: str, sub: str, spec: Mapping[str, Any],
                 pools: list[Pool]) -> _Request:
        where = f"claim {claim}, request {name}"
        if spec.get("adminAccess") is not None or spec.get("capacity") is not None:
            raise NotModelled(f"{where}: admin access / capacity requests are not modelled")
        cls = self.classes.get(spec.get("deviceClassName", ""))
        if cls is None:
            raise AllocationError(f"{where}: could not retrieve device class {spec.get('deviceClassName')}")
        r = _Request(name, base, sub, spec, self.predicates(cls["spec"].get("selectors") or (), f"class {cls['metadata']['name']}"),
                     self.predicates(spec.get("selectors") or (), where), 0)
        if spec.get("allocationMode", "ExactCount") == "ExactCount":
            r.count = int(spec.get("count", 1))
            return r
        r.all_devices = []
        for pool in pools:
            if pool.incomplete or pool.invalid:
                state = "currently being updated" if pool.incomplete else "currently invalid"
                raise AllocationError(f"{where}: asks for all devices, but resource pool {pool.driver}/{pool.name} is {state}")
            r.all_devices += [d for d in pool.devices if _selectable(r, d)]
        r.count = len(r.all_devices)
        return r


def _selectable(req: _Request, device: Device) -> bool:
    return all(p(device.view) for p in req.class_selectors) and all(p(device.view) for p in req.selectors)


class _Search:
    """One ``Allocate`` call's state (upstream's ``allocator`` struct) and its search."""

    def __init__(self, model: AllocatorModel, pools: list[Pool], requests: list[list[list[_Request]]],
                 constraints: list[list[_Constraint]]) -> None:
        self.model, self.requests, self.constraints = model, requests, constraints
        self.pools = [p for p in pools if not p.incomplete and not p.invalid]
        self.allocating: dict[DeviceId, set[int]] = {}
        self.held: dict[tuple[str, tuple[str, str]], int] = {}  # (pool, counter) -> taken by this search
        self.available: dict[str, tuple[dict[tuple[str, str], int], bool]] = {}
        self.result: list[list[tuple[_Request, Device]]] = [[] for _ in requests]
        self.match: dict[tuple[DeviceId, str, int], bool] = {}
        self.chosen: dict[tuple[int, int], int] = {}  # (claim, request) -> subrequest (selectedSubRequestIndex)
        self.steps = 0

    def one(self, claim: int, request: int, sub: int, index: int, in_sub: bool,
            start: tuple[int, int]) -> bool:
        """``allocateOne``: device ``index`` of (sub)request ``sub`` of ``request`` of
        ``claim``; ``start`` is the (pool, device) position to search from."""
        self.steps += 1
        if claim >= len(self.requests):
            return True
        if request >= len(self.requests[claim]):
            try:
                return self.one(claim + 1, 0, 0, 0, False, (0, 0))
            except _MaxSizeExceeded:
                return False
        alts = self.requests[claim][request]
        if not in_sub and alts[0].sub:
            all_exceeded = True
            for i in range(len(alts)):
                try:
                    done = self.one(claim, request, i, 0, True, (0, 0))
                except _MaxSizeExceeded:
                    continue
                all_exceeded = False
                if done:
                    self.chosen[(claim, request)] = i
                    return True
            if all_exceeded:
                raise _MaxSizeExceeded
            return False
        req = alts[sub]
        if req.all_devices is not None and not req.all_devices:
            return False
        if index >= req.count:
            return self.one(claim, request + 1, 0, 0, False, (0, 0))
        if len(self.result[claim]) + req.count - index > ALLOCATION_RESULTS_MAX_SIZE:
            raise _MaxSizeExceeded
        if req.all_devices is not None:
            undo = self.device(claim, req, req.all_devices[index], must=True)
            if undo is None:
                return False
            try:
                done = self.one(claim, request, sub, index + 1, in_sub, (0, 0))
            except BaseException:
                undo()
                raise
            if not done:
                undo()
            return done
        return self._candidates(claim, request, sub, index, in_sub, start, req)

    def _candidates(self, claim: int, request: int, sub: int, index: int, in_sub: bool,
                    start: tuple[int, int], req: _Request) -> bool:
        """The device loop of ``allocateOne``: every eligible device from ``start`` on."""
        for p in range(start[0], len(self.pools)):
            devices = self.pools[p].devices
            for i in range(start[1] if p == start[0] else 0, len(devices)):
                device = devices[i]
                if self.in_use(device.id) or not self.selectable(claim, req, device):
                    continue
                undo = self.device(claim, req, device)
                if undo is None:
                    continue
                try:
                    done = self.one(claim, request, sub, index + 1, in_sub, (p, i + 1))
                except BaseException:
                    undo()
                    raise
                if done:
                    return True
                undo()
        return False

    def in_use(self, device_id: DeviceId) -> bool:
        return device_id in self.model.allocated or bool(self.allocating.get(device_id))

    def selectable(self, claim: int, req: _Request, device: Device) -> bool:
        key = (device.id, req.name, claim)
        hit = self.match.get(key)
        if hit is None:
            hit = self.match[key] = _selectable(req, device)
        return hit

    def device(self, claim: int, req: _Request, device: Device,
               must: bool = False) -> Callable[[], None] | None:
        """``allocateDevice``: reserve ``device`` for ``req`` of ``claim``; its undo, or None.
        ``must`` (allocation mode All): a constraint that rejects the device is an error."""
        if self.in_use(device.id):
            return None
        if device.consumes and not self._take_counters(device):
            return None
        if taint_prevents(device, req.spec.get("tolerations") or ()):
            if not self.model.leak:
                self._give_counters(device)
            return None
        added: list[_Constraint] = []
        for c in self.constraints[claim]:
            if not c.add(req, device):
                if must:
                    raise AllocationError(f"request {req.name}: cannot add device {'/'.join(device.id)} "
                                          "because a claim constraint would not be satisfied")
                for a in added:
                    a.remove(req, device)
                if not self.model.leak:
                    self._give_counters(device)
                return None
            added.append(c)
        self.allocating.setdefault(device.id, set()).add(claim)
        self.result[claim].append((req, device))
        n = len(self.result[claim]) - 1

        def undo() -> None:
            for c in self.constraints[claim]:
                c.remove(req, device)
            self.allocating[device.id].discard(claim)
            if device.consumes:
                self._give_counters(device)
            del self.result[claim][n:]

        return undo

    def _pool_counters(self, pool: Pool) -> tuple[dict[tuple[str, str], int], bool]:
        """Counters left after the devices allocated before (computed once per pool, as
        ``availableCounters``) and whether one of them is already below zero. Keyed by the pool
        *name* alone, as upstream keys ``availableCounters`` and ``consumedCounters``: pools
        of two drivers with the same name share this bookkeeping (the first one asked wins)."""
        cached = self.available.get(pool.name)
        if cached is None:
            left = dict(pool.counters)
            for d in pool.devices:
                if d.id in self.model.allocated:
                    for cs, counter, amount in d.consumes:
                        if (cs, counter) in left:
                            left[(cs, counter)] -= amount
            cached = self.available[pool.name] = (left, any(v < 0 for v in left.values()))
        return cached

    def _take_counters(self, device: Device) -> bool:
        """``checkAvailableCounters``: reserve, then check; given back when short."""
        left, over = self._pool_counters(device.pool)
        for cs, counter, amount in device.consumes:
            key = (device.pool.name, (cs, counter))
            self.held[key] = self.held.get(key, 0) + amount
        if over or any(self.held[(device.pool.name, (cs, c))] > left.get((cs, c), float("inf"))
                       for cs, c, _ in device.consumes):
            self._give_counters(device)
            return False
        return True

    def _give_counters(self, device: Device) -> None:
        """``deallocateCountersForDevice``."""
        for cs, counter, amount in device.consumes:
            self.held[(device.pool.name, (cs, counter))] -= amount
