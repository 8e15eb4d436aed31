"""Pure-Python twin of the ``agent._topo`` extension: the readable reference.

Every function here has the same name, arguments and results as its Cython counterpart in
``ext/_topo.pyx``; tests run both and compare. Inputs are plain Python values: an adjacency
is a list of int bitmasks, ``adjacency[i]`` having bit ``j`` set when GPUs i and j share at
least one NVLink.
"""

from __future__ import annotations

from itertools import combinations


def nvlink_islands(adjacency: list[int]) -> list[list[int]]:
    """Connected components of the NVLink graph with two or more GPUs, each sorted,
    ordered by their lowest GPU."""
    n = len(adjacency)
    seen = 0
    islands: list[list[int]] = []
    for start in range(n):
        if seen >> start & 1:
            continue
        component = 1 << start
        frontier = 1 << start
        while frontier:
            low = frontier & -frontier
            frontier ^= low
            i = low.bit_length() - 1
            new = adjacency[i] & ~component
            component |= new
            frontier |= new
        seen |= component
        members = [i for i in range(n) if component >> i & 1]
        if len(members) >= 2:
            islands.append(members)
    return islands


def maximal_cliques(adjacency: list[int]) -> list[list[int]]:
    """Maximal cliques (every pair NVLinked) of two or more GPUs, each sorted, the list
    sorted lexicographically. Bron-Kerbosch with pivoting on bitmasks."""
    n = len(adjacency)
    found: list[list[int]] = []

    def expand(r: int, p: int, x: int) -> None:
        if p == 0 and x == 0:
            if r & (r - 1):  # at least two members
                found.append([i for i in range(n) if r >> i & 1])
            return
        # pivot: the vertex of p|x with most neighbours in p
        best, pivot = -1, 0
        px = p | x
        while px:
            low = px & -px
            px ^= low
            u = low.bit_length() - 1
            c = bin(p & adjacency[u]).count("1")
            if c > best:
                best, pivot = c, u
        candidates = p & ~adjacency[pivot]
        while candidates:
            low = candidates & -candidates
            candidates ^= low
            v = low.bit_length() - 1
            expand(r | low, p & adjacency[v], x & adjacency[v])
            p &= ~low
            x |= low

    expand(0, (1 << n) - 1, 0)
    found.sort()
    return found


# ---------------------------------------------------------------------------------------------
# Allocation: the objective of issue 3, computed exactly for up to EXACT_MAX_GPUS available GPUs.
# ---------------------------------------------------------------------------------------------

#: Largest number of available GPUs solved exactly (bitmask tables of 2**n entries).
EXACT_MAX_GPUS = 16
#: Compressed sub-solvers kept per solver (a node with more than 16 GPUs, few available).
_SUB_CACHE_SIZE = 16


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class AllocationSolver:
    """Chooses k GPUs out of the available ones by the issue-3 objective.

    ``scores[i][j]`` is the pair score of GPUs i and j (symmetric, 0 on the diagonal);
    ``numa[i]`` a small non-negative int naming GPU i's NUMA node (the caller maps "unknown"
    to an id of its own). Sets are int bitmasks over GPU indices.

    Objective, for R ⊆ G ⊆ A, |G| = k, maximised lexicographically:

    1. ``score(G) + P_k(A \\ G)`` where ``P_k(S)`` is the best total set score of a partition of
       S into ``|S| // k`` groups of size k plus, when ``r = |S| mod k`` is not 0, exactly one
       group of the r remaining GPUs (the anchor's padded group, padding scoring 0);
    2. ``score(G)``;
    3. fewer distinct NUMA ids in G;
    4. smaller cut: sum of pair scores between G and A \\ G;
    5. the lexicographically smallest sorted index list.

    Exact when ``|A| <= EXACT_MAX_GPUS``. The partition values ``P_k`` are memoised per k
    over the whole node (they depend only on the mask), so repeated calls get cheaper. With
    more available GPUs, :meth:`rank` runs a bounded greedy search (see ``_heuristic``).
    Not thread-safe: callers serialise calls.
    """

    #: Not thread-safe: callers serialise calls (the extension's solver locks itself).
    thread_safe = False

    def __init__(self, scores, numa):
        n = len(scores)
        if len(numa) != n:
            raise ValueError(f"numa has {len(numa)} entries for {n} GPUs")
        if n > 64:
            raise ValueError(f"at most 64 GPUs, got {n}")
        if any(not 0 <= int(x) < 64 for x in numa):
            raise ValueError("numa ids must be in 0..63")
        self.n = n
        self._s = [[int(v) for v in row] for row in scores]
        self._numa_bit = [1 << int(x) for x in numa]
        self._set_scores = None  # list over all 2**n masks, built on first exact use
        self._memo = {}  # k -> list of P_k by mask, -1 = not computed yet
        self._subs = {}  # available mask -> (members, AllocationSolver) for n > 16

    # ------------------------------------------------------------------ small helpers
    def set_score(self, mask: int) -> int:
        """Sum of pair scores within ``mask``."""
        members = _bits(mask)
        s = self._s
        return sum(s[a][b] for i, a in enumerate(members) for b in members[i + 1 :])

    def _numa_count(self, mask: int) -> int:
        seen = 0
        for i in _bits(mask):
            seen |= self._numa_bit[i]
        return bin(seen).count("1")

    def _cut(self, g: int, rest: int) -> int:
        s = self._s
        rest_members = _bits(rest)
        return sum(s[a][b] for a in _bits(g) for b in rest_members)

    # ------------------------------------------------------------------ exact tables
    def _table(self) -> list[int]:
        """Set score of every subset of the node, built incrementally: score(S) =
        score(S - low) + sum of pair scores of low with S - low."""
        if self._set_scores is None:
            n, s = self.n, self._s
            table = [0] * (1 << n)
            for mask in range(1, 1 << n):
                low = mask & -mask
                i = low.bit_length() - 1
                rest = mask ^ low
                add = 0
                for j in _bits(rest):
                    add += s[i][j]
                table[mask] = table[rest] + add
            self._set_scores = table
        return self._set_scores

    def partition_value(self, mask: int, k: int) -> int:
        """``P_k(mask)``: the best partition of ``mask`` into k-groups plus one group of
        ``popcount(mask) % k`` GPUs (exact; needs ``n <= EXACT_MAX_GPUS``)."""
        memo = self._memo.get(k)
        if memo is None:
            memo = self._memo[k] = [-1] * (1 << self.n)
            memo[0] = 0
        return self._partition(mask, k, memo, self._table())

    def _partition(self, mask: int, k: int, memo: list[int], table: list[int]) -> int:
        v = memo[mask]
        if v >= 0:
            return v
        # The lowest GPU is in some group: either a k-group or the one remainder group.
        low = mask & -mask
        members = [1 << i for i in _bits(mask ^ low)]
        count = len(members) + 1
        remainder = count % k
        best = -1
        sizes = ([k] if count >= k else []) + ([remainder] if remainder else [])
        for size in sizes:
            for others in combinations(members, size - 1):
                group = low + sum(others)
                v = table[group] + self._partition(mask ^ group, k, memo, table)
                if v > best:
                    best = v
        memo[mask] = best
        return best

    def best_score(self, k: int) -> int:
        """Best set score of any k GPUs of the node (exact up to 16 GPUs, else the best the
        greedy growth from every GPU finds)."""
        if not 1 <= k <= self.n:
            raise ValueError(f"size {k} outside 1..{self.n}")
        if self.n <= EXACT_MAX_GPUS:
            table = self._table()
            return max(table[m] for m in range(1 << self.n) if m.bit_count() == k)
        everyone = (1 << self.n) - 1
        return max(self.set_score(self._grow(1 << i, everyone, k)) for i in range(self.n))

    # ------------------------------------------------------------------ ranking
    def rank(self, available: int, required: int, k: int, top: int = 1) -> list[tuple]:
        """The ``top`` best sets G (R ⊆ G ⊆ A, |G| = k), best first, each as
        ``(mask, criterion1, score, numa_count, cut)``."""
        if available >> self.n:
            raise ValueError("available names a GPU the node does not have")
        if required & ~available:
            raise ValueError("required GPUs must be available")
        n_avail = available.bit_count()
        if not (required.bit_count() <= k <= n_avail) or k < 1:
            raise ValueError(f"size {k} impossible with {n_avail} available")
        if top < 1:
            raise ValueError("top must be >= 1")
        if n_avail > EXACT_MAX_GPUS:
            return self._heuristic(available, required, k, top)
        if self.n > EXACT_MAX_GPUS:
            return self._ranked_compressed(available, required, k, top)
        table = self._table()
        memo = self._memo.get(k)
        if memo is None:
            memo = self._memo[k] = [-1] * (1 << self.n)
            memo[0] = 0
        free = [1 << i for i in _bits(available & ~required)]
        scored = []
        for others in combinations(free, k - required.bit_count()):
            g = required + sum(others)
            score = table[g]
            crit1 = score + self._partition(available ^ g, k, memo, table)
            scored.append((g, crit1, score))
        # Criteria 1-2 first; 3-5 are only needed to order what ties on the first two.
        scored.sort(key=lambda e: (-e[1], -e[2]))
        cutoff = scored[min(top, len(scored)) - 1][1:]
        finalists = [e for e in scored if e[1:] >= cutoff]
        return self._finish(finalists, available, top)

    def _finish(self, entries, available: int, top: int) -> list[tuple]:
        full = [
            (g, c1, sc, self._numa_count(g), self._cut(g, available ^ g)) for g, c1, sc in entries
        ]
        full.sort(key=lambda e: (-e[1], -e[2], e[3], e[4], _bits(e[0])))
        return full[:top]

    def _ranked_compressed(self, available: int, required: int, k: int, top: int) -> list[tuple]:
        """A node with more than 16 GPUs but at most 16 available: solve exactly on the
        available GPUs alone (renumbered 0..m-1, which keeps index order)."""
        sub = self._subs.get(available)
        if sub is None:
            members = _bits(available)
            s = self._s
            sub_scores = [[s[a][b] for b in members] for a in members]
            numa = [self._numa_bit[a].bit_length() - 1 for a in members]
            if len(self._subs) >= _SUB_CACHE_SIZE:
                self._subs.clear()
            sub = self._subs[available] = (members, AllocationSolver(sub_scores, numa))
        members, solver = sub
        position = {g: i for i, g in enumerate(members)}
        sub_required = sum(1 << position[g] for g in _bits(required))
        ranked = solver.rank((1 << len(members)) - 1, sub_required, k, top)
        out = []
        for g, c1, sc, numa_count, cut in ranked:
            real = sum(1 << members[i] for i in _bits(g))
            out.append((real, c1, sc, numa_count, cut))
        return out

    # ------------------------------------------------------------------ bounded search
    def _grow(self, g: int, pool: int, size: int) -> int:
        """Greedily grow ``g`` inside ``pool`` to ``size`` GPUs: add the GPU with the largest
        summed pair score to the members so far; ties go to the lowest index."""
        s = self._s
        members = _bits(g)
        candidates = _bits(pool & ~g)
        gain = {j: sum(s[j][m] for m in members) for j in candidates}
        while len(members) < size:
            best_j, best_gain = -1, -1
            for j in candidates:
                if gain[j] > best_gain:
                    best_j, best_gain = j, gain[j]
            candidates.remove(best_j)
            members.append(best_j)
            g |= 1 << best_j
            for j in candidates:
                gain[j] += s[j][best_j]
        return g

    def _greedy_partition(self, mask: int, k: int) -> int:
        """Approximate ``P_k(mask)``: repeatedly grow a group from the lowest remaining GPU
        to k GPUs (the last group takes what is left)."""
        total = 0
        while mask:
            low = mask & -mask
            group = self._grow(low, mask, min(k, mask.bit_count()))
            total += self.set_score(group)
            mask ^= group
        return total

    def _heuristic(self, available: int, required: int, k: int, top: int) -> list[tuple]:
        """Bounded search for more than 16 available GPUs (not exact): one candidate per
        seed R ∪ {s} for every available s (R itself when |R| = k), grown greedily to k;
        criterion 1 uses the greedy partition of the rest. Work is O(n^3) pair look-ups."""
        if required.bit_count() == k:
            seeds = [required]
        else:
            seeds = [required | (1 << s) for s in _bits(available & ~required)]
        seen = set()
        entries = []
        for seed in seeds:
            g = self._grow(seed, available, k)
            if g in seen:
                continue
            seen.add(g)
            score = self.set_score(g)
            entries.append((g, score + self._greedy_partition(available ^ g, k), score))
        return self._finish(entries, available, top)


# ---------------------------------------------------------------------------------------------
# Request conversion (the allocator's hot path): GPU index lists <-> bitmasks.
# ---------------------------------------------------------------------------------------------


def request_masks(available, must_include, n: int) -> tuple[int, int, int, int]:
    """``(available mask, must-include mask, len(available), len(must_include))``; raises
    ValueError when an entry is not an int in 0..n-1 or is repeated (the caller explains)."""
    masks = []
    for values in (available, must_include):
        mask = 0
        count = 0
        for v in values:
            if type(v) is not int:
                raise ValueError("not an index")
            if not 0 <= v < n:
                raise ValueError("out of range")
            if mask >> v & 1:
                raise ValueError("duplicate")
            mask |= 1 << v
            count += 1
        masks.append((mask, count))
    return masks[0][0], masks[1][0], masks[0][1], masks[1][1]


def mask_indices(mask: int) -> list[int]:
    """Set bits of ``mask``, ascending."""
    return _bits(mask)


def group_devices(parent: dict, n: int) -> dict[int, list[str]]:
    """``{gpu: [device IDs]}`` from ``{device ID: gpu}``, IDs in the dict's order; raises
    ValueError when an ID is not a non-empty str or a GPU not an int in 0..n-1."""
    out: dict[int, list[str]] = {}
    for device_id, gpu in parent.items():
        if type(device_id) is not str or not device_id or type(gpu) is not int:
            raise ValueError("bad entry")
        if not 0 <= gpu < n:
            raise ValueError("out of range")
        out.setdefault(gpu, []).append(device_id)
    return out


# ---------------------------------------------------------------------------------------------
# Whole requests (the allocator's fast paths): validation, policy and result in one call.
# Each returns None where the request is not a plain valid one; the allocator then names the
# problem (AllocationError) or, for unusual but valid input, normalises it and asks again.
# ---------------------------------------------------------------------------------------------


def choose(solver: AllocationSolver, available, must_include, size) -> list[int] | None:
    """``best_set`` in one call: the sorted indices of the best ``size`` GPUs of
    ``available`` holding ``must_include`` (lists of ints), or None when the request is not
    plainly valid (an entry not an int in 0..n-1, a repeat, must-include outside available,
    ``size`` not an int in ``max(1, |must_include|)..|available|``)."""
    if type(size) is not int:
        return None
    try:
        avail, required, n_avail, n_required = request_masks(available, must_include, solver.n)
    except ValueError:
        return None
    if required & ~avail or not (1 <= size <= n_avail and n_required <= size):
        return None
    return _bits(solver.rank(avail, required, size, 1)[0][0])


def _natural_key(device_id: str) -> tuple[str, int, str]:
    """``<uuid>::2`` before ``<uuid>::10``; other IDs by their text."""
    head, sep, tail = device_id.rpartition("::")
    return (head, int(tail), "") if sep and tail.isdigit() else (device_id, -1, device_id)


def _extend(solver, in_request: list[int], tier: list[int], count: int) -> list[int]:
    """``count`` GPUs of ``tier`` that the GPU policy adds to ``in_request`` (disjoint)."""
    pool = sum(1 << g for g in in_request) | sum(1 << g for g in tier)
    required = sum(1 << g for g in in_request)
    best = solver.rank(pool, required, len(in_request) + count, 1)[0][0]
    return _bits(best & ~required)


def select_replicas(solver, available, must_include, size, packed, per_gpu) -> list[str] | None:
    """``AllocationEngine.replicas`` in one call (its docstring has the policy): the replica
    IDs to allocate, sorted by GPU index then replica number, or None when the request is
    not plainly valid (an entry not a (non-empty str, int in 0..n-1) tuple or list pair, a
    repeated ID, a must-include ID not available or repeated, ``size`` not an int in
    ``max(1, |must_include|)..|available|``). ``per_gpu``: None (every GPU has as many
    replicas as the one with most free), an int for every GPU, or a mapping GPU -> count
    (GPUs not in it: their free count). ``solver`` breaks ties among equally loaded GPUs."""
    n = solver.n
    if type(size) is not int:
        return None
    parent: dict[str, int] = {}
    free: dict[int, list[str]] = {}  # GPU -> its free IDs not in must-include
    count = 0
    for entry in available:
        if (type(entry) is not tuple and type(entry) is not list) or len(entry) != 2:
            return None
        device_id, gpu = entry
        if type(device_id) is not str or not device_id or type(gpu) is not int:
            return None
        if not 0 <= gpu < n:
            return None
        parent[device_id] = gpu
        count += 1
        ids = free.get(gpu)
        if ids is None:
            free[gpu] = [device_id]
        else:
            ids.append(device_id)
    if len(parent) != count:
        return None  # a repeated ID
    required: list[str] = []
    seen: set[str] = set()
    for device_id in must_include:
        gpu = parent.get(device_id)
        if gpu is None or device_id in seen:
            return None
        seen.add(device_id)
        required.append(device_id)
        free[gpu].remove(device_id)
    if not (1 <= size <= count and len(required) <= size):
        return None

    all_free = {g: len(ids) for g, ids in free.items()}
    for d in required:
        all_free[parent[d]] += 1
    if per_gpu is None:
        uniform = max(all_free.values())
        total = {g: uniform for g in all_free}
    elif isinstance(per_gpu, int):
        total = {g: per_gpu for g in all_free}
    else:
        total = {g: int(per_gpu.get(g, all_free[g])) for g in all_free}
    load = {g: max(total[g] - all_free[g], 0) for g in all_free}
    taken = dict.fromkeys(free, 0)
    for d in required:
        taken[parent[d]] += 1
    sorted_gpus: set[int] = set()
    chosen = list(required)
    need = size - len(required)

    def take(gpu: int, count: int) -> None:
        ids = free[gpu]
        if gpu not in sorted_gpus:  # shorter first, then by text: replica number order
            ids.sort()
            ids.sort(key=len)
            sorted_gpus.add(gpu)
        chosen.extend(ids[:count])
        del ids[:count]
        taken[gpu] += count

    while need > 0 and not packed:
        # one round: each GPU at the lowest level of use in this request gets one more
        # replica, least loaded first; a partly taken tier of equal load goes to topology
        level = min(taken[g] for g, ids in free.items() if ids)
        group = sorted((load[g], g) for g, ids in free.items() if ids and taken[g] == level)
        start = 0
        while start < len(group) and need > 0:
            end = start + 1
            while end < len(group) and group[end][0] == group[start][0]:
                end += 1
            tier = [g for _, g in group[start:end]]
            if len(tier) <= need:
                picks = tier
            elif level > 0:
                # every tier GPU is already in the request: topology cannot tell them apart
                picks = tier[:need]
            else:
                picks = _extend(solver, sorted(g for g in taken if taken[g]), tier, need)
            for g in picks:
                take(g, 1)
            need -= len(picks)
            start = end
    while need > 0:  # packed
        eligible = [g for g, ids in free.items() if ids]
        key = {g: (0 if taken[g] else 1, -(load[g] + taken[g])) for g in eligible}
        best_key = min(key.values())
        tier = sorted(g for g in eligible if key[g] == best_key)
        if len(tier) == 1 or best_key[0] == 0:
            # GPUs already in the request and equally loaded: topology cannot tell
            gpu = tier[0]
        else:
            (gpu,) = _extend(solver, sorted(g for g in taken if taken[g]), tier, 1)
        count = min(need, len(free[gpu]))
        take(gpu, count)
        need -= count
    return sorted(chosen, key=lambda d: (parent[d], _natural_key(d)))
