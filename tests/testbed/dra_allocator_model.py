"""A model of the scheduler's DRA allocator, for the tests, ``bench/quality_dra.py`` and ``bench/bench_dra_scheduler.py``.

The allocator kube-scheduler runs is Go code in ``k8s.io/dynamic-resource-allocation/structured``
and cannot ship with this project. This is a small Python model of the variant Kubernetes 1.36
picks whenever a beta feature is on (``internal/incubating``, v0.36.2:
``allocator_incubating.go``, ``pools_incubating.go``, ``constraint.go``), written from that code
and following it function by function; ``version="1.37"`` swaps in ``GatherPools`` of v0.37.0-alpha.2
(kubernetes#138917, the only change there that matters here). The API server's defaulting and validation of the
objects it reads are in ``dra_api_validation.py`` beside it.

What it follows, by upstream function:

* ``NewAllocator`` / ``GatherPools`` / ``addSlice`` / ``checkSlicesInPool`` / ``buildPool``
  -> :func:`gather_pools`: a Filter of node N sees N's slices and ``slicesShared`` (slices
  without ``nodeName``; in 1.36 also every slice holding ``sharedCounters``, whatever its
  node). A slice is relevant when its ``nodeName`` is N or ``allNodes`` is set, and in 1.36
  whenever it carries ``sharedCounters`` (so each Filter gathers every node's pool: the
  counter slice of node M makes M's pool relevant to N, it is incomplete with that one slice,
  ``checkSlicesInPool`` walks every slice of the cluster for M's others, and ``buildPool``
  converts them and validates their counter consumptions; their devices only count for
  counters). 1.37 drops the ``sharedCounters`` rule: a counter slice with ``nodeName`` is
  relevant to its node alone. Slices are grouped by (driver, pool name), an older
  generation is dropped, a newer one replaces the slices seen so far; a pool with fewer
  slices than ``resourceSliceCount`` even after ``checkSlicesInPool`` is incomplete (never
  allocated from), one with a newer generation elsewhere is dropped. ``buildPool`` sorts a pool's slices by name, splits
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
  ``perDeviceNodeSelection`` slices, binding conditions (their pools go last upstream), admin access,
  consumable capacity (``allowMultipleAllocations``, capacity requests), DeviceTaintRules
  (taints not in the slice). The allocation result's node selector and configs are not built.
* Quantities: counters and capacities are parsed as exact integers (plain, or with a decimal
  or binary suffix); fractional quantities raise.

Work counted (:class:`Work`, ``AllocatorModel.work`` after each ``allocate``: one Filter of
one node, as the DynamicResources plugin calls ``Allocate`` once per Filter, and each
``Allocate`` gathers the pools anew; the model gathers once per node and charges the same
gathering work to every call):

* ``pools``: the pools ``GatherPools`` returns (incomplete ones included);
* ``slices_converted`` / ``devices_converted``: ``Convert_v1_ResourceSlice_To_api_ResourceSlice``
  calls in ``addSlice`` (every relevant slice, before the generation check) and in
  ``buildPool`` (the slices ``checkSlicesInPool`` found), and the devices those slices hold
  (each converted whole: attributes, capacities, counter consumptions);
* ``consumptions_validated``: the counter look-ups of ``validateDeviceCounterConsumption``,
  one per counter named in a device's ``consumesCounters``, over every device of the pool
  (those targeting the node and, in 1.36, the ones of other nodes' pools);
* ``slices_scanned``: the slices ``checkSlicesInPool`` walks (all of the cluster's, per
  incomplete-looking pool);
* ``cel_evaluations``: selector expressions run by ``selectorsMatch``, through
  ``isSelectable``'s cache (once per device and (sub)request per ``Allocate``; class
  selectors first, stopping at the first non-match);
* ``counter_checks``: the counters ``checkAvailableCounters`` compares for each device it
  reserves (upstream compares every counter of every set of the pool; on a shortfall it
  stops at the first short counter in Go's map order, which the model cannot know, so a
  refused device is counted in full: an upper bound);
* ``steps``: ``allocateOne`` invocations (upstream's ``numAllocateOneInvocations``).

Not counted: the CEL compilation (cached across cycles upstream), ``availableCounters`` (a
walk over a pool's devices once per pool and ``Allocate`` where a counter is checked), the
rest of the scheduling cycle. :class:`ClusterGather` gives the gathering counts of one
Filter in a cluster of N node-local pools without gathering N pools per Filter (equal to
:func:`gather_pools`' counts: ``GatherPools`` handles each pool on its own, see the class).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

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
    others: list[Device] = field(default_factory=list)  # devices of slices not targeting the node
    counters: dict[tuple[str, str], int] = field(default_factory=dict)  # (set, counter) -> value


@dataclass
class Work:
    """What one ``Allocate`` call (one Filter of one node) costs the scheduler, counted as the
    upstream functions named do it (module docstring, "Work counted"); adds up field by field."""

    pools: int = 0  # pools GatherPools returns (incomplete ones included)
    slices_converted: int = 0  # Convert_v1_ResourceSlice_To_api_ResourceSlice calls
    devices_converted: int = 0  # devices in those slices (each converted with its attributes)
    consumptions_validated: int = 0  # counter look-ups in validateDeviceCounterConsumption
    slices_scanned: int = 0  # slices checkSlicesInPool walks
    cel_evaluations: int = 0  # selector expressions selectorsMatch evaluates
    counter_checks: int = 0  # counters checkAvailableCounters compares per reserved device
    steps: int = 0  # allocateOne invocations

    def __add__(self, other: Work) -> Work:
        return Work(**{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__})

    def times(self, n: int) -> Work:
        return Work(**{k: getattr(self, k) * n for k in self.__dataclass_fields__})


VERSIONS = ("1.36", "1.37")  # GatherPools of v0.36.2 / of v0.37.0-alpha.2 (kubernetes#138917)


def _shared(spec: Mapping[str, Any], version: str) -> bool:
    """``NewAllocator``'s split: a slice without ``nodeName`` is in ``slicesShared`` (handed to
    every node's Filter); in 1.36 so is every slice holding ``sharedCounters``."""
    return not spec.get("nodeName") or (version == "1.36" and bool(spec.get("sharedCounters")))


def _slice_relevant(spec: Mapping[str, Any], node: str, version: str = "1.36") -> bool:
    if version == "1.36" and spec.get("sharedCounters"):
        return True
    if spec.get("nodeSelector") is not None or spec.get("perDeviceNodeSelection"):
        raise NotModelled("nodeSelector / perDeviceNodeSelection slices are not modelled")
    return spec.get("nodeName") == node or bool(spec.get("allNodes"))


def _pool_key(s: Mapping[str, Any]) -> tuple[str, str]:
    return (s["spec"]["driver"], s["spec"]["pool"]["name"])


def gather_pools(slices: Iterable[Mapping[str, Any]], node: str, *, version: str = "1.36",
                 work: Work | None = None) -> list[Pool]:
    """``GatherPools`` + ``checkSlicesInPool`` + ``buildPool`` of ``version`` for the Filter
    of ``node`` over the cluster's ``slices`` (module docstring); ``work`` counts its cost."""
    if version not in VERSIONS:
        raise ValueError(f"version {version!r}: expected one of {VERSIONS}")
    work = work if work is not None else Work()
    everything = list(slices)
    for_node = ([s for s in everything if s["spec"].get("nodeName") == node and not _shared(s["spec"], version)]
                + [s for s in everything if _shared(s["spec"], version)])
    by_pool: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in for_node:
        spec = s["spec"]
        if not _slice_relevant(spec, node, version):
            continue
        work.slices_converted += 1  # addSlice converts before it looks at the generation
        work.devices_converted += len(spec.get("devices") or ())
        seen = by_pool.setdefault(_pool_key(s), [])
        gen = spec["pool"]["generation"]
        if seen and gen < seen[0]["spec"]["pool"]["generation"]:
            continue
        if seen and gen > seen[0]["spec"]["pool"]["generation"]:
            seen.clear()
        seen.append(s)
    pools = []
    for (driver, name), objs in by_pool.items():
        want = objs[0]["spec"]["pool"]["resourceSliceCount"]
        others: list[Mapping[str, Any]] = []
        if len(objs) != want:  # checkSlicesInPool: the pool's other slices, from every slice
            work.slices_scanned += len(everything)
            gen = objs[0]["spec"]["pool"]["generation"]
            pool_slices = [s for s in everything if _pool_key(s) == (driver, name)]
            if any(s["spec"]["pool"]["generation"] > gen for s in pool_slices):
                continue  # obsolete: the driver is replacing this generation
            current = [s for s in pool_slices if s["spec"]["pool"]["generation"] == gen]
            if len(current) != want:
                pools.append(Pool(driver, name, incomplete=True))
                continue
            names = {s["metadata"]["name"] for s in objs}
            others = [s for s in current if s["metadata"]["name"] not in names]
            for s in others:
                work.slices_converted += 1
                work.devices_converted += len(s["spec"].get("devices") or ())
        pools.append(_build_pool(driver, name, objs, others, work))
    work.pools += len(pools)
    return sorted(pools, key=lambda p: (p.driver, p.name))


class ClusterGather:
    """What ``GatherPools`` costs one Filter of a node in a cluster where every slice names its
    node (``nodeName``) and each node publishes pools of its own, as the agent does: the
    counts :func:`gather_pools` gives over all the cluster's slices, added up per pool.
    ``GatherPools`` converts each relevant slice and builds each pool from that pool's slices
    alone, so a Filter of node N costs N's own gathering plus, in 1.36, every other node M's
    pool as seen from elsewhere (its counter slice relevant, the rest found by
    ``checkSlicesInPool``, which walks all the cluster's slices for it). Nodes are set (and
    replaced, when they re-publish) with :meth:`set_node`; ``copies`` makes one node stand
    for that many nodes publishing the same slices under their own names (the counts do not
    depend on names)."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.own: dict[str, Work] = {}
        self.foreign: dict[str, Work] = {}  # one copy's
        self.slices: dict[str, int] = {}  # one copy's
        self.copies: dict[str, int] = {}
        self._foreign_total, self._slices_total = Work(), 0

    def set_node(self, node: str, slices: Sequence[Mapping[str, Any]], copies: int = 1) -> None:
        if any(s["spec"].get("nodeName") != node for s in slices):
            raise NotModelled("ClusterGather: every slice of a node must name that node")
        own, foreign = Work(), Work()
        gather_pools(slices, node, version=self.version, work=own)
        if self.version == "1.36":
            gather_pools(slices, "", version=self.version, work=foreign)
            foreign.slices_scanned = 0  # charged per Filter over the whole cluster (filter_work)
        if node in self.own:
            self._foreign_total = self._foreign_total + self.foreign[node].times(-self.copies[node])
            self._slices_total -= self.slices[node] * self.copies[node]
        self.own[node], self.foreign[node], self.slices[node], self.copies[node] = own, foreign, len(slices), copies
        self._foreign_total = self._foreign_total + foreign.times(copies)
        self._slices_total += len(slices) * copies

    def filter_work(self, node: str) -> Work:
        """The gathering counts of one Filter of ``node`` (of one of its copies)."""
        others = self._foreign_total + self.foreign[node].times(-1)
        return self.own[node] + others + Work(slices_scanned=others.pools * self._slices_total)


def _build_pool(driver: str, name: str, objs: list[Mapping[str, Any]],
                others: Sequence[Mapping[str, Any]] = (), work: Work | None = None) -> Pool:
    """``buildPool``: ``objs`` target the node (their devices are allocatable), ``others``
    (found by ``checkSlicesInPool``) only count for counters."""
    work = work if work is not None else Work()
    pool = Pool(driver, name)
    objs = sorted(objs, key=lambda s: s["metadata"]["name"])
    sets: set[str] = set()
    for s in [*objs, *others]:
        for cs in s["spec"].get("sharedCounters") or ():
            if cs["name"] in sets:
                pool.invalid = f"duplicate counter set name {cs['name']}"
                return pool
            sets.add(cs["name"])
            for counter, c in cs["counters"].items():
                pool.counters[(cs["name"], counter)] = quantity(c["value"])
    names: set[str] = set()
    for s in [*objs, *others]:
        if s["spec"].get("sharedCounters"):
            continue
        targeting = any(s is o for o in objs)
        for d in s["spec"].get("devices") or ():
            if targeting and d["name"] in names:
                pool.invalid = f"duplicate device name {d['name']}"
                return pool
            names.add(d["name"])
            if d.get("bindingConditions") or d.get("allowMultipleAllocations"):
                raise NotModelled("binding conditions / multiple allocations are not modelled")
            consumes = []
            for use in d.get("consumesCounters") or ():
                work.consumptions_validated += len(use["counters"])
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
            device = Device((driver, name, d["name"]), d, pool, view, tuple(consumes), tuple(d.get("taints") or ()))
            (pool.devices if targeting else pool.others).append(device)
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
                 leak_rejected_counters: bool = True, version: str = "1.36") -> None:
        self.slices = list(slices)
        self.classes = {c["metadata"]["name"]: c for c in classes}
        self.cel = dict(cel)
        self.allocated = set(allocated)
        self.leak = leak_rejected_counters
        self.version = version
        self.steps = 0  # allocateOne invocations of the last allocate() (numAllocateOneInvocations)
        self.work = Work()  # what the last allocate() cost, gathering included (Work)
        self._pools: dict[str, tuple[list[Pool], Work]] = {}

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
        cached = self._pools.get(node)
        if cached is None:
            gathered = Work()
            cached = self._pools[node] = (gather_pools(self.slices, node, version=self.version, work=gathered), gathered)
        pools, gathered = cached
        self.work = gathered + Work()  # upstream gathers on every call; the model reuses the pools
        search = _Search(self, pools, [self._requests(c, pools) for c in claims],
                         [self._constraints(c) for c in claims])
        done = search.one(0, 0, 0, 0, False, (0, 0))
        self.steps = self.work.steps = search.steps
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
            r.all_devices += [d for d in pool.devices if _selectable(r, d, self.work)]
        r.count = len(r.all_devices)
        return r


def _selectable(req: _Request, device: Device, work: Work) -> bool:
    """``isSelectable``: the class's selectors, then the request's, each list stopping at the
    first that does not match (``selectorsMatch``); every expression run is counted."""
    for p in (*req.class_selectors, *req.selectors):
        work.cel_evaluations += 1
        if not p(device.view):
            return False
    return True


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
            hit = self.match[key] = _selectable(req, device, self.model.work)
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
            for d in (*pool.devices, *pool.others):
                if d.id in self.model.allocated:
                    for cs, counter, amount in d.consumes:
                        if (cs, counter) in left:
                            left[(cs, counter)] -= amount
            cached = self.available[pool.name] = (left, any(v < 0 for v in left.values()))
        return cached

    def _take_counters(self, device: Device) -> bool:
        """``checkAvailableCounters``: reserve, then check; given back when short."""
        left, over = self._pool_counters(device.pool)
        self.model.work.counter_checks += len(device.pool.counters)  # upstream compares them all
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
