"""The twin's allocation solver: the objective of issue 3, exact for up to EXACT_MAX_GPUS
available GPUs (bitmask tables, memoised partitions), a bounded greedy search above, and the
replica policy's entry point (the policy itself is ``replicas``)."""

from __future__ import annotations

from itertools import combinations
from typing import Any, Sequence

from agent.topology._pure import replicas
from agent.topology._pure.checks import (
    COUNT_MAX,
    EXACT_MAX_GPUS,
    MAX_GPUS,
    SCORE_MAX,
    bits,
    bounds,
    gpu_mask,
    int_in,
    per_gpu,
    ranks,
)

#: Compressed sub-solvers kept per solver (a node with more than 16 GPUs, few available).
_SUB_CACHE_SIZE = 16


class AllocationSolver:
    """Chooses k GPUs out of the available ones by the issue-3 objective.

    ``scores[i][j]`` is the pair score of GPUs i and j (symmetric, 0 on the diagonal);
    ``numa[i]`` a small non-negative int naming GPU i's NUMA node (the caller maps "unknown"
    to an id of its own). Sets are int bitmasks over GPU indices.

    Objective, for R ⊆ G ⊆ A, |G| = k, maximised lexicographically:

    1. ``score(G) + P_k(A \\ G)`` where ``P_k(S)`` is the best total set score of a partition of
       S into ``|S| // k`` groups of size k plus, when ``r = |S| mod k`` is not 0, exactly one
       group of the r remaining GPUs (go-gpuallocator's padded group, padding scoring 0);
    2. ``score(G)``;
    3. fewer distinct NUMA ids in G;
    4. smaller cut: sum of pair scores between G and A \\ G;
    5. the lexicographically smallest sorted index list.

    Exact when ``|A| <= EXACT_MAX_GPUS``. The partition values ``P_k`` are memoised per k
    over the whole node (they depend only on the mask), so repeated calls get cheaper. With
    more available GPUs, :meth:`rank` runs a bounded greedy search (see ``_heuristic``).
    Not thread-safe: callers serialise calls. (The extension finds the same single best set
    with fewer candidates where free GPUs are interchangeable: ``ext/_topo.pyx``.)
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
                int_in(row[j], f"scores[{i}][{j}]", 0, SCORE_MAX)
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
            int_in(numa[i], f"numa[{i}]", 0, MAX_GPUS - 1)
        self.n = n
        self._s = [list(row) for row in scores]
        self._numa_bit = [1 << x for x in numa]
        self._set_scores: list[int] | None = None  # all 2**n masks, built on first exact use
        self._memo: dict[int, list[int]] = {}  # k -> P_k by mask, -1 = not computed yet
        self._subs: dict[int, tuple[list[int], AllocationSolver]] = {}  # see _sub

    def _request(self, available: int, required: int, k: int) -> tuple[int, int, int]:
        """The checked ``(available, required, k)`` of a rank/best_mask call."""
        available = gpu_mask(available, "available", self.n)
        required = gpu_mask(required, "required", self.n)
        if required & ~available:
            raise ValueError("required GPUs must be available")
        n_avail = available.bit_count()
        k = int_in(k, "size", 1, self.n)
        if not required.bit_count() <= k <= n_avail:
            raise ValueError(
                f"size {k} impossible with {n_avail} available and {required.bit_count()} required"
            )
        return available, required, k

    # ------------------------------------------------------------------ small helpers
    def set_score(self, mask: int) -> int:
        """Sum of pair scores within ``mask``."""
        return self._set_score(gpu_mask(mask, "mask", self.n))

    def _set_score(self, mask: int) -> int:
        members = bits(mask)
        s = self._s
        return sum(s[a][b] for i, a in enumerate(members) for b in members[i + 1 :])

    def _numa_count(self, mask: int) -> int:
        seen = 0
        for i in bits(mask):
            seen |= self._numa_bit[i]
        return bin(seen).count("1")

    def _cut(self, g: int, rest: int) -> int:
        s = self._s
        rest_members = bits(rest)
        return sum(s[a][b] for a in bits(g) for b in rest_members)

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
                for j in bits(rest):
                    add += s[i][j]
                table[mask] = table[rest] + add
            self._set_scores = table
        return self._set_scores

    def partition_value(self, mask: int, k: int) -> int:
        """``P_k(mask)``: the best partition of ``mask`` into k-groups plus one group of
        ``popcount(mask) % k`` GPUs, exact; ``mask`` may hold at most EXACT_MAX_GPUS GPUs (on
        a bigger node it is solved on those GPUs alone)."""
        mask = gpu_mask(mask, "mask", self.n)
        k = int_in(k, "size", 1, self.n)
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
        members = [1 << i for i in bits(mask ^ low)]
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
        k = int_in(k, "size", 1, self.n)
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
        top = int_in(top, "top", 1, COUNT_MAX)
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
        free = [1 << i for i in bits(available & ~required)]
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
        full.sort(key=lambda e: (-e[1], -e[2], e[3], e[4], bits(e[0])))
        return full[:top]

    def _sub(self, available: int) -> tuple[list[int], AllocationSolver]:
        """The GPUs of ``available`` (at most EXACT_MAX_GPUS, on a bigger node) and a solver
        on them alone, renumbered 0..m-1 (which keeps index order); cached."""
        sub = self._subs.get(available)
        if sub is None:
            members = bits(available)
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
        sub_required = sum(1 << position[g] for g in bits(required))
        ranked = solver._rank((1 << len(members)) - 1, sub_required, k, top)
        out = []
        for g, c1, sc, numa_count, cut in ranked:
            real = sum(1 << members[i] for i in bits(g))
            out.append((real, c1, sc, numa_count, cut))
        return out

    # ------------------------------------------------------------------ bounded search
    def _grow(self, g: int, pool: int, size: int) -> int:
        """Greedily grow ``g`` inside ``pool`` to ``size`` GPUs: add the GPU with the largest
        summed pair score to the members so far; ties go to the lowest index."""
        s = self._s
        members = bits(g)
        candidates = bits(pool & ~g)
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
            seeds = [required | (1 << s) for s in bits(available & ~required)]
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
    def replica_ranks(
        self,
        start: Sequence[int],
        free: Sequence[int],
        required: Sequence[int],
        size: int,
        packed: bool,
    ) -> list[int]:
        """The ranks a time-sliced request gets, ascending: ``required`` and ``size -
        len(required)`` ranks of ``free``.

        Ranks number one resource's devices: GPU g holds ranks ``start[g]`` to
        ``start[g + 1] - 1`` (n + 1 non-decreasing entries from 0), and a GPU's lowest free
        ranks are taken first. ``free`` (available, not in the request yet) and ``required``
        (must-include) are strictly ascending and disjoint; a GPU's ranks in neither are
        allocated to others, its load. How many each GPU gives is the replica policy
        (``replicas.spread`` / ``replicas.pack``)."""
        n = self.n
        start = bounds(start, n)
        free = ranks(free, "free", start[n])
        required = ranks(required, "required", start[n])
        shared = set(free).intersection(required)
        if shared:
            raise ValueError(f"rank {min(shared)} is both free and required")
        need = int_in(size, "size", len(required), len(required) + len(free)) - len(required)
        nfree, taken = per_gpu(free, start), per_gpu(required, start)
        load = [
            start[g + 1] - start[g] - nfree[g] - taken[g] if nfree[g] or taken[g] else 0
            for g in range(n)
        ]
        policy = replicas.pack if packed else replicas.spread
        counts = policy(list(nfree), list(taken), load, need, self._best_mask)
        picked: list[int] = []
        first = 0
        for g in range(n):
            picked += free[first : first + counts[g]]
            first += nfree[g]
        return sorted(required + picked)
