"""Pure-Python twin of the ``agent._topo`` extension: the readable reference.

Every public name here has the same arguments, results and errors as its Cython counterpart
in ``ext/_topo.pyx``; tests run both and compare. This is the kernel only: plain ints and
bitmasks in, plain ints and bitmasks out. Device IDs, request validation and the mapping
between the two live in ``agent.topology.allocator``.

An adjacency is a list of int bitmasks, ``adjacency[i]`` having bit ``j`` set when GPUs i
and j share at least one NVLink. Every public entry point checks its arguments (type, then
range) and raises TypeError or ValueError with the message the extension uses.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, Sequence

from agent.records import MAX_GPUS  # re-exported: the engine API (agent.topology.engine)

#: Largest number of GPUs solved exactly (bitmask tables of 2**n entries). The extension
#: compiles the same number in; ``engine.EXACT_MAX_GPUS`` reads it from the implementation
#: in use and a test checks that both agree.
EXACT_MAX_GPUS = 16
#: Largest pair score, replica count (free, taken) and replica load the kernel accepts.
SCORE_MAX = 2**31 - 1
COUNT_MAX = 2**31 - 1
LOAD_MAX = 2**62


def _int(v: object, what: str, lo: int, hi: int) -> int:
    """``v`` when it is an int (not a bool, not a subclass) in ``lo..hi``."""
    if type(v) is not int:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{what} {v} outside {lo}..{hi}")
    return v


def _mask(v: object, what: str, n: int) -> int:
    """``v`` when it is an int bitmask of GPUs 0..n-1."""
    if type(v) is not int:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if v < 0 or v >> n:
        raise ValueError(f"{what} {v:#x} is not a set of the node's {n} GPUs")
    return v


def _take(free: list[int], taken: list[int], counts: list[int], gpu: int, count: int) -> None:
    """Move ``count`` replicas of ``gpu`` from free into the request."""
    free[gpu] -= count
    taken[gpu] += count
    counts[gpu] += count


def _int_list(values: Sequence[int], what: str, n: int, hi: int) -> list[int]:
    """``values`` as a list when it holds n ints in 0..hi."""
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} entries for {n} GPUs")
    for i in range(n):
        _int(values[i], f"{what}[{i}]", 0, hi)
    return list(values)


def _adjacency(adjacency: Sequence[int]) -> int:
    """The GPU count of a valid adjacency (at most MAX_GPUS masks of GPUs 0..n-1)."""
    n = len(adjacency)
    if n > MAX_GPUS:
        raise ValueError(f"at most {MAX_GPUS} GPUs, got {n}")
    for i in range(n):
        _mask(adjacency[i], f"adjacency[{i}]", n)
    return n


def nvlink_islands(adjacency: list[int]) -> list[list[int]]:
    """Connected components of the NVLink graph with two or more GPUs, each sorted,
    ordered by their lowest GPU."""
    n = _adjacency(adjacency)
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
    n = _adjacency(adjacency)
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

#: Compressed sub-solvers kept per solver (a node with more than 16 GPUs, few available).
_SUB_CACHE_SIZE = 16


def mask_indices(mask: int) -> list[int]:
    """Set bits of ``mask`` (a 64-bit mask), ascending."""
    return _bits(_mask(mask, "mask", MAX_GPUS))


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

    def __init__(self, scores: Sequence[Sequence[int]], numa: Sequence[int]) -> None:
        n = len(scores)
        if n > MAX_GPUS:
            raise ValueError(f"at most {MAX_GPUS} GPUs, got {n}")
        if len(numa) != n:
            raise ValueError(f"numa has {len(numa)} entries for {n} GPUs")
        for i in range(n):
            row = scores[i]
            if len(row) != n:
                raise ValueError(f"scores[{i}] has {len(row)} entries for {n} GPUs")
            for j in range(n):
                _int(row[j], f"scores[{i}][{j}]", 0, SCORE_MAX)
            if row[i] != 0:
                raise ValueError(f"scores[{i}][{i}] must be 0, got {row[i]}")
        for i in range(n):
            for j in range(i + 1, n):
                if scores[i][j] != scores[j][i]:
                    raise ValueError(
                        f"scores are not symmetric: scores[{i}][{j}] = {scores[i][j]}, "
                        f"scores[{j}][{i}] = {scores[j][i]}"
                    )
        for i in range(n):
            _int(numa[i], f"numa[{i}]", 0, MAX_GPUS - 1)
        self.n = n
        self._s = [list(row) for row in scores]
        self._numa_bit = [1 << x for x in numa]
        self._set_scores: list[int] | None = None  # all 2**n masks, built on first exact use
        self._memo: dict[int, list[int]] = {}  # k -> P_k by mask, -1 = not computed yet
        self._subs: dict[int, tuple[list[int], AllocationSolver]] = {}  # see _sub

    def _request(self, available: int, required: int, k: int) -> tuple[int, int, int]:
        """The checked ``(available, required, k)`` of a rank/best_mask call."""
        available = _mask(available, "available", self.n)
        required = _mask(required, "required", self.n)
        if required & ~available:
            raise ValueError("required GPUs must be available")
        n_avail = available.bit_count()
        k = _int(k, "size", 1, self.n)
        if not required.bit_count() <= k <= n_avail:
            raise ValueError(
                f"size {k} impossible with {n_avail} available and {required.bit_count()} required"
            )
        return available, required, k

    # ------------------------------------------------------------------ small helpers
    def set_score(self, mask: int) -> int:
        """Sum of pair scores within ``mask``."""
        return self._set_score(_mask(mask, "mask", self.n))

    def _set_score(self, mask: int) -> int:
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
            if self.n > EXACT_MAX_GPUS:  # callers compress first; never 2**n for a big node
                raise ValueError(f"no exact tables above {EXACT_MAX_GPUS} GPUs")
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
        ``popcount(mask) % k`` GPUs, exact; ``mask`` may hold at most EXACT_MAX_GPUS GPUs (on
        a bigger node it is solved on those GPUs alone)."""
        mask = _mask(mask, "mask", self.n)
        k = _int(k, "size", 1, self.n)
        count = mask.bit_count()
        if count > EXACT_MAX_GPUS:
            raise ValueError(
                f"partition_value is exact for at most {EXACT_MAX_GPUS} GPUs, the mask has {count}"
            )
        if k > count:  # one group of them all (also keeps k within the memo tables)
            return self._set_score(mask)
        if self.n > EXACT_MAX_GPUS:
            _, sub = self._sub(mask)
            return sub.partition_value((1 << count) - 1, k)
        return self._partition(mask, k, self._memo_for(k), self._table())

    def _memo_for(self, k: int) -> list[int]:
        memo = self._memo.get(k)
        if memo is None:
            memo = self._memo[k] = [-1] * (1 << self.n)
            memo[0] = 0
        return memo

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
        k = _int(k, "size", 1, self.n)
        if self.n <= EXACT_MAX_GPUS:
            table = self._table()
            return max(table[m] for m in range(1 << self.n) if m.bit_count() == k)
        everyone = (1 << self.n) - 1
        return max(self._set_score(self._grow(1 << i, everyone, k)) for i in range(self.n))

    # ------------------------------------------------------------------ ranking
    def rank(self, available: int, required: int, k: int, top: int = 1) -> list[tuple[Any, ...]]:
        """The ``top`` best sets G (R ⊆ G ⊆ A, |G| = k), best first, each as
        ``(mask, criterion1, score, numa_count, cut)``."""
        available, required, k = self._request(available, required, k)
        top = _int(top, "top", 1, COUNT_MAX)
        return self._rank(available, required, k, top)

    def best_mask(self, available: int, required: int, k: int) -> int:
        """``rank(available, required, k, 1)[0][0]``: the best set as a mask."""
        return self._best_mask(*self._request(available, required, k))

    def _best_mask(self, available: int, required: int, k: int) -> int:
        if k == available.bit_count():
            return available  # the only candidate
        if k == required.bit_count():
            return required
        return int(self._rank(available, required, k, 1)[0][0])

    def _rank(self, available: int, required: int, k: int, top: int) -> list[tuple[Any, ...]]:
        if available.bit_count() > EXACT_MAX_GPUS:
            return self._heuristic(available, required, k, top)
        if self.n > EXACT_MAX_GPUS:
            return self._ranked_compressed(available, required, k, top)
        table = self._table()
        memo = self._memo_for(k)
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

    def _finish(self, entries: list[tuple[Any, ...]], available: int, top: int) -> list[tuple[Any, ...]]:
        full = [
            (g, c1, sc, self._numa_count(g), self._cut(g, available ^ g)) for g, c1, sc in entries
        ]
        full.sort(key=lambda e: (-e[1], -e[2], e[3], e[4], _bits(e[0])))
        return full[:top]

    def _sub(self, available: int) -> tuple[list[int], AllocationSolver]:
        """The GPUs of ``available`` (at most EXACT_MAX_GPUS, on a bigger node) and a solver
        on them alone, renumbered 0..m-1 (which keeps index order); cached."""
        sub = self._subs.get(available)
        if sub is None:
            members = _bits(available)
            s = self._s
            sub_scores = [[s[a][b] for b in members] for a in members]
            numa = [self._numa_bit[a].bit_length() - 1 for a in members]
            if len(self._subs) >= _SUB_CACHE_SIZE:
                self._subs.clear()
            sub = self._subs[available] = (members, AllocationSolver(sub_scores, numa))
        return sub

    def _ranked_compressed(self, available: int, required: int, k: int, top: int) -> list[tuple[Any, ...]]:
        """A node with more than 16 GPUs but at most 16 available: solve exactly on the
        available GPUs alone (renumbered 0..m-1, which keeps index order)."""
        members, solver = self._sub(available)
        position = {g: i for i, g in enumerate(members)}
        sub_required = sum(1 << position[g] for g in _bits(required))
        ranked = solver._rank((1 << len(members)) - 1, sub_required, k, top)
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
            total += self._set_score(group)
            mask ^= group
        return total

    def _heuristic(self, available: int, required: int, k: int, top: int) -> list[tuple[Any, ...]]:
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
            score = self._set_score(g)
            entries.append((g, score + self._greedy_partition(available ^ g, k), score))
        return self._finish(entries, available, top)



    # ------------------------------------------------------------------ replicas
    def replica_counts(
        self,
        free: Sequence[int],
        taken: Sequence[int],
        load: Sequence[int],
        need: int,
        packed: bool,
    ) -> list[int]:
        """How many more replicas of each GPU a time-sliced request takes (the allocator's
        ``replicas`` docstring has the policy). Per GPU g: ``free[g]`` replicas free and not
        yet in the request, ``taken[g]`` already in it (must-include), ``load[g]`` allocated
        to others. ``need`` more replicas are wanted (at most the free ones). Ties among
        equally loaded GPUs go to the GPU policy, given the GPUs already in the request."""
        n = self.n
        free = _int_list(free, "free", n, COUNT_MAX)
        taken = _int_list(taken, "taken", n, COUNT_MAX)
        load = _int_list(load, "load", n, LOAD_MAX)
        need = _int(need, "need", 0, sum(free))
        counts = [0] * n
        if not packed:
            self._spread(free, taken, load, need, counts)
        else:
            self._pack(free, taken, load, need, counts)
        return counts

    def _spread(self, free: list[int], taken: list[int], load: list[int], need: int, counts: list[int]) -> None:
        """``replica_counts`` spread: rounds in which each GPU at the lowest level of use in
        this request gets one more replica, least loaded first; a partly taken tier of equal
        load goes to topology."""
        n = self.n
        while need > 0:
            level = min(taken[g] for g in range(n) if free[g])
            group = sorted((load[g], g) for g in range(n) if free[g] and taken[g] == level)
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
                    picks = self._extend(taken, tier, need)
                for g in picks:
                    _take(free, taken, counts, g, 1)
                need -= len(picks)
                start = end

    def _pack(self, free: list[int], taken: list[int], load: list[int], need: int, counts: list[int]) -> None:
        """``replica_counts`` packed: GPUs not in the request first, then the most loaded."""
        while need > 0:
            eligible = [g for g in range(self.n) if free[g]]
            key = {g: (0 if taken[g] else 1, -(load[g] + taken[g])) for g in eligible}
            best_key = min(key.values())
            tier = [g for g in eligible if key[g] == best_key]
            if len(tier) == 1 or best_key[0] == 0:
                # GPUs already in the request and equally loaded: topology cannot tell
                gpu = tier[0]
            else:
                (gpu,) = self._extend(taken, tier, 1)
            count = min(need, free[gpu])
            _take(free, taken, counts, gpu, count)
            need -= count

    def _extend(self, taken: list[int], tier: list[int], count: int) -> list[int]:
        """``count`` GPUs of ``tier`` that the GPU policy adds to those with ``taken``."""
        required = sum(1 << g for g in range(self.n) if taken[g])
        pool = required | sum(1 << g for g in tier)
        best = self._best_mask(pool, required, required.bit_count() + count)
        return _bits(best & ~required)
