# cython: language_level=3
"""Compiled topology engine (``agent._topo``).

Works on plain arrays only: adjacency bitmasks (``adjacency[i]`` has bit j set when GPUs
i and j share an NVLink), never NVML handles or dataclasses. ``agent/topology/_pure.py``
is the readable twin; both must return identical results.
"""

from libc.stdint cimport uint64_t

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1

from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromLong
from cpython.ref cimport Py_INCREF

cdef extern from *:
    int __builtin_popcountll(unsigned long long) nogil
    int __builtin_ctzll(unsigned long long) nogil

cdef enum:
    MAX_GPUS = 64


cdef inline list _members(uint64_t mask, int n):
    cdef int i
    return [i for i in range(n) if (mask >> i) & 1]



def nvlink_islands(adjacency):
    """Connected components of two or more GPUs, sorted, ordered by lowest GPU."""
    cdef int n = len(adjacency)
    if n > MAX_GPUS:
        raise ValueError(f"at most {MAX_GPUS} GPUs, got {n}")
    cdef uint64_t adj[MAX_GPUS]
    cdef int i, start
    for i in range(n):
        adj[i] = <uint64_t>adjacency[i]
    cdef uint64_t seen = 0, component, frontier, low, new
    cdef list islands = []
    for start in range(n):
        if (seen >> start) & 1:
            continue
        component = (<uint64_t>1) << start
        frontier = component
        while frontier:
            low = frontier & (~frontier + 1)
            frontier ^= low
            i = __builtin_ctzll(low)
            new = adj[i] & ~component
            component |= new
            frontier |= new
        seen |= component
        if __builtin_popcountll(component) >= 2:
            islands.append(_members(component, n))
    return islands


cdef void _expand(uint64_t r, uint64_t p, uint64_t x, uint64_t* adj, list found, int n):
    cdef uint64_t px, low, candidates
    cdef int u, v, c, best = -1, pivot = 0
    if p == 0 and x == 0:
        if r & (r - 1):
            found.append(_members(r, n))
        return
    px = p | x
    while px:
        low = px & (~px + 1)
        px ^= low
        u = __builtin_ctzll(low)
        c = __builtin_popcountll(p & adj[u])
        if c > best:
            best = c
            pivot = u
    candidates = p & ~adj[pivot]
    while candidates:
        low = candidates & (~candidates + 1)
        candidates ^= low
        v = __builtin_ctzll(low)
        _expand(r | low, p & adj[v], x & adj[v], adj, found, n)
        p &= ~low
        x |= low


def maximal_cliques(adjacency):
    """Maximal cliques of two or more GPUs, sorted, the list sorted lexicographically."""
    cdef int n = len(adjacency)
    if n > MAX_GPUS:
        raise ValueError(f"at most {MAX_GPUS} GPUs, got {n}")
    cdef uint64_t adj[MAX_GPUS]
    cdef int i
    for i in range(n):
        adj[i] = <uint64_t>adjacency[i]
    cdef list found = []
    cdef uint64_t everyone = ((<uint64_t>1) << n) - 1 if n < 64 else <uint64_t>0xFFFFFFFFFFFFFFFF
    _expand(0, everyone, 0, adj, found, n)
    found.sort()
    return found


# ---------------------------------------------------------------------------------------------
# Allocation solver: the same objective, results and tie-breaks as
# agent/topology/_pure.py:AllocationSolver (read that one for the contract).
# ---------------------------------------------------------------------------------------------

cimport cython
from libc.stdlib cimport malloc, free
from libc.string cimport memcmp, memset
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK,
                               NOWAIT_LOCK)

EXACT_MAX_GPUS = 16
cdef int _EXACT = 16
cdef int _SUB_CACHE_SIZE = 16


cdef inline uint64_t _low(uint64_t m) noexcept nogil:
    return m & (~m + 1)


cdef inline int _better(uint64_t ga, long long c1a, long long sca, int nua, long long cua,
                        uint64_t gb, long long c1b, long long scb, int nub, long long cub) noexcept nogil:
    """1 when set a ranks before set b (criteria 1-5)."""
    cdef uint64_t diff
    if c1a != c1b:
        return c1a > c1b
    if sca != scb:
        return sca > scb
    if nua != nub:
        return nua < nub
    if cua != cub:
        return cua < cub
    # equal-sized sets: the lexicographically smaller sorted list holds the lowest element
    # of the symmetric difference
    diff = ga ^ gb
    return (ga & _low(diff)) != 0


@cython.final
cdef class _TopList:
    """The best ``cap`` entries seen so far, best first."""
    cdef int cap, count
    cdef uint64_t* g
    cdef long long* c1
    cdef long long* sc
    cdef int* nu
    cdef long long* cu

    def __cinit__(self, int cap):
        self.cap = cap
        self.count = 0
        self.g = <uint64_t*>malloc(cap * sizeof(uint64_t))
        self.c1 = <long long*>malloc(cap * sizeof(long long))
        self.sc = <long long*>malloc(cap * sizeof(long long))
        self.nu = <int*>malloc(cap * sizeof(int))
        self.cu = <long long*>malloc(cap * sizeof(long long))
        if not (self.g and self.c1 and self.sc and self.nu and self.cu):
            raise MemoryError()

    def __dealloc__(self):
        free(self.g); free(self.c1); free(self.sc); free(self.nu); free(self.cu)

    cdef inline bint rejects(self, long long c1, long long sc) noexcept:
        """Cannot enter: the list is full and (c1, sc) is below its last entry's."""
        cdef int w = self.count - 1
        if self.count < self.cap:
            return False
        return c1 < self.c1[w] or (c1 == self.c1[w] and sc < self.sc[w])

    cdef void insert(self, uint64_t g, long long c1, long long sc, int nu, long long cu) noexcept:
        cdef int pos = self.count, j
        while pos > 0 and _better(g, c1, sc, nu, cu, self.g[pos - 1], self.c1[pos - 1],
                                  self.sc[pos - 1], self.nu[pos - 1], self.cu[pos - 1]):
            pos -= 1
        if pos >= self.cap:
            return
        j = self.count if self.count < self.cap else self.cap - 1
        while j > pos:
            self.g[j] = self.g[j - 1]; self.c1[j] = self.c1[j - 1]; self.sc[j] = self.sc[j - 1]
            self.nu[j] = self.nu[j - 1]; self.cu[j] = self.cu[j - 1]
            j -= 1
        self.g[pos] = g; self.c1[pos] = c1; self.sc[pos] = sc; self.nu[pos] = nu; self.cu[pos] = cu
        if self.count < self.cap:
            self.count += 1

    cdef list result(self):
        return [(int(self.g[i]), int(self.c1[i]), int(self.sc[i]), int(self.nu[i]), int(self.cu[i]))
                for i in range(self.count)]


@cython.final
cdef class AllocationSolver:
    """See ``agent.topology._pure.AllocationSolver``: identical contract and results."""
    cdef public int n
    cdef long long s[64][64]
    cdef uint64_t numa_bit[64]
    cdef uint64_t node_gpus[64]  # GPUs of each distinct NUMA id, n_nodes of them
    cdef int n_nodes
    cdef long long* table
    cdef long long* memo[17]
    cdef dict _subs
    cdef _TopList _top1  # reused by the one-answer fast paths (under the lock)
    cdef PyThread_type_lock _mutex

    #: Every method serialises itself on an internal lock (the twin relies on its caller's).
    thread_safe = True

    def __cinit__(self):
        self.table = NULL
        self._mutex = PyThread_allocate_lock()
        if self._mutex == NULL:
            raise MemoryError()
        memset(self.memo, 0, sizeof(self.memo))

    def __init__(self, scores, numa):
        cdef int n = len(scores), i, j
        cdef uint64_t ids = 0
        if len(numa) != n:
            raise ValueError(f"numa has {len(numa)} entries for {n} GPUs")
        if n > 64:
            raise ValueError(f"at most 64 GPUs, got {n}")
        if any(not 0 <= int(x) < 64 for x in numa):
            raise ValueError("numa ids must be in 0..63")
        self.n = n
        for i in range(n):
            row = scores[i]
            for j in range(n):
                self.s[i][j] = int(row[j])
            self.numa_bit[i] = (<uint64_t>1) << <int>int(numa[i])
        self.n_nodes = 0
        for i in range(n):
            ids |= self.numa_bit[i]
        while ids:
            self.node_gpus[self.n_nodes] = 0
            for i in range(n):
                if self.numa_bit[i] == _low(ids):
                    self.node_gpus[self.n_nodes] |= (<uint64_t>1) << i
            self.n_nodes += 1
            ids &= ids - 1
        self._subs = {}
        self._top1 = _TopList(1)

    def __dealloc__(self):
        cdef int k
        if self._mutex != NULL:
            PyThread_free_lock(self._mutex)
        free(self.table)
        for k in range(17):
            free(self.memo[k])

    cdef int _acquire(self) except -1:
        if not PyThread_acquire_lock(self._mutex, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self._mutex, WAIT_LOCK)
        return 0

    cdef inline void _release(self) noexcept:
        PyThread_release_lock(self._mutex)

    # ------------------------------------------------------------------ small helpers
    cdef long long _set_score(self, uint64_t mask) noexcept:
        cdef int members[64]
        cdef int c = 0, a, b
        cdef long long total = 0
        while mask:
            members[c] = __builtin_ctzll(mask)
            c += 1
            mask &= mask - 1
        for a in range(c):
            for b in range(a + 1, c):
                total += self.s[members[a]][members[b]]
        return total

    def set_score(self, mask):
        return int(self._set_score(<uint64_t>mask))

    cdef int _numa_count(self, uint64_t mask) noexcept:
        cdef int c = 0, i
        for i in range(self.n_nodes):
            c += (self.node_gpus[i] & mask) != 0
        return c

    cdef long long _cut(self, uint64_t g, uint64_t rest) noexcept:
        cdef long long total = 0
        cdef uint64_t r
        cdef int a
        while g:
            a = __builtin_ctzll(g)
            g &= g - 1
            r = rest
            while r:
                total += self.s[a][__builtin_ctzll(r)]
                r &= r - 1
        return total

    # ------------------------------------------------------------------ exact tables
    cdef long long* _table(self) except NULL:
        cdef uint64_t mask, rest, size
        cdef int i
        cdef long long add
        if self.table == NULL:
            size = (<uint64_t>1) << self.n
            self.table = <long long*>malloc(size * sizeof(long long))
            if self.table == NULL:
                raise MemoryError()
            self.table[0] = 0
            for mask in range(1, size):
                i = __builtin_ctzll(mask)
                rest = mask & (mask - 1)
                add = 0
                while rest:
                    add += self.s[i][__builtin_ctzll(rest)]
                    rest &= rest - 1
                self.table[mask] = self.table[mask & (mask - 1)] + add
        return self.table

    cdef long long* _memo_for(self, int k) except NULL:
        cdef uint64_t size
        if self.memo[k] == NULL:
            size = (<uint64_t>1) << self.n
            self.memo[k] = <long long*>malloc(size * sizeof(long long))
            if self.memo[k] == NULL:
                raise MemoryError()
            memset(self.memo[k], 0xff, size * sizeof(long long))  # all -1
            self.memo[k][0] = 0
        return self.memo[k]

    def partition_value(self, mask, int k):
        cdef uint64_t m = <uint64_t>mask
        cdef long long v
        self._acquire()
        try:
            self._table()
            v = self._partition(m, k, self._memo_for(k))
        finally:
            self._release()
        return int(v)

    cdef long long _partition(self, uint64_t mask, int k, long long* memo) noexcept:
        cdef long long v = memo[mask], best = -1
        if v >= 0:
            return v
        cdef uint64_t low = _low(mask), rest = mask ^ low
        cdef uint64_t members[64]
        cdef int c = 0, count, remainder
        while rest:
            members[c] = _low(rest)
            rest ^= members[c]
            c += 1
        count = c + 1
        remainder = count % k
        if count >= k:
            v = self._groups(mask, low, members, c, k - 1, k, memo)
            if v > best:
                best = v
        if remainder:
            v = self._groups(mask, low, members, c, remainder - 1, k, memo)
            if v > best:
                best = v
        memo[mask] = best
        return best

    cdef long long _groups(self, uint64_t mask, uint64_t low, uint64_t* members, int c, int t,
                           int k, long long* memo) noexcept:
        """Best of table[g] + P(mask - g) over groups g = low + t of ``members``."""
        cdef int idx[64]
        cdef uint64_t acc[65]
        cdef long long best = -1, v
        cdef int i, j
        cdef uint64_t g
        if t > c:
            return -1
        acc[0] = low
        for i in range(t):
            idx[i] = i
            acc[i + 1] = acc[i] | members[i]
        while True:
            g = acc[t]
            # most look-ups hit the memo: check it here rather than paying for a call
            v = memo[mask ^ g]
            if v < 0:
                v = self._partition(mask ^ g, k, memo)
            v += self.table[g]
            if v > best:
                best = v
            if not _next_combination(idx, acc, members, t, c):
                break
        return best

    def best_score(self, int k):
        self._acquire()
        try:
            return self._best_score(k)
        finally:
            self._release()

    cdef object _best_score(self, int k):
        cdef uint64_t mask, size, everyone
        cdef long long best = -1, v
        cdef long long* table
        cdef int i
        if not 1 <= k <= self.n:
            raise ValueError(f"size {k} outside 1..{self.n}")
        if self.n <= _EXACT:
            table = self._table()
            size = (<uint64_t>1) << self.n
            for mask in range(size):
                if __builtin_popcountll(mask) == k and table[mask] > best:
                    best = table[mask]
            return int(best)
        everyone = ((<uint64_t>1) << self.n) - 1 if self.n < 64 else <uint64_t>0xFFFFFFFFFFFFFFFF
        for i in range(self.n):
            v = self._set_score(self._grow((<uint64_t>1) << i, everyone, k))
            if v > best:
                best = v
        return int(best)

    # ------------------------------------------------------------------ ranking
    def rank(self, available_obj, required_obj, int k, int top=1):
        self._acquire()
        try:
            return self._rank(available_obj, required_obj, k, top)
        finally:
            self._release()

    cdef object _rank(self, available_obj, required_obj, int k, int top):
        cdef uint64_t available, required
        if available_obj < 0 or required_obj < 0 or available_obj >> self.n:
            raise ValueError("available names a GPU the node does not have")
        available = <uint64_t>available_obj
        required = <uint64_t>required_obj
        if required & ~available:
            raise ValueError("required GPUs must be available")
        cdef int n_avail = __builtin_popcountll(available)
        if not (__builtin_popcountll(required) <= k <= n_avail) or k < 1:
            raise ValueError(f"size {k} impossible with {n_avail} available")
        if top < 1:
            raise ValueError("top must be >= 1")
        if n_avail > _EXACT:
            return self._heuristic(available, required, k, top)
        if self.n > _EXACT:
            return self._ranked_compressed(available_obj, required_obj, k, top)
        return self._exact(available, required, k, top)

    cdef list _exact(self, uint64_t available, uint64_t required, int k, int top):
        cdef _TopList best = _TopList(top)
        self._exact_into(available, required, k, best)
        return best.result()

    cdef uint64_t _best_mask(self, uint64_t available, uint64_t required, int k) except? 0:
        """``rank(available, required, k, 1)[0][0]`` for a valid request, without building
        the ranking's Python objects on the common (exact) path."""
        cdef int n_avail = __builtin_popcountll(available)
        if k == n_avail:
            return available  # the only candidate
        if k == __builtin_popcountll(required):
            return required
        if n_avail > _EXACT:
            return <uint64_t>self._heuristic(available, required, k, 1)[0][0]
        if self.n > _EXACT:
            return <uint64_t>self._ranked_compressed(available, required, k, 1)[0][0]
        self._top1.count = 0
        self._exact_into(available, required, k, self._top1)
        return self._top1.g[0]

    cdef object _choose(self, available, must_include, size):
        cdef uint64_t a = 0, r = 0, bit, best
        cdef int na = 0, nr = 0, k, overflow = 0
        cdef long long i
        cdef list out
        if type(size) is not int:
            return None
        i = PyLong_AsLongLongAndOverflow(size, &overflow)
        if overflow or i < 1 or i > 64:
            return None
        k = <int>i
        if not _index_mask(available, self.n, &a, &na) or not _index_mask(must_include, self.n, &r, &nr):
            return None
        if r & ~a or k > na or nr > k:
            return None
        best = self._best_mask(a, r, k)
        out = PyList_New(k)
        for i in range(k):
            v = PyLong_FromLong(__builtin_ctzll(best))
            Py_INCREF(v)  # PyList_SET_ITEM steals the reference Cython keeps for ``v``
            PyList_SET_ITEM(out, i, v)
            best &= best - 1
        return out

    cdef int _exact_into(self, uint64_t available, uint64_t required, int k,
                         _TopList best) except -1:
        cdef long long* table = self._table()
        cdef long long* memo = self._memo_for(k)
        cdef uint64_t members[64]
        cdef uint64_t acc[65]
        cdef int idx[64]
        cdef uint64_t free_mask = available & ~required, g, rest, m, all_free = free_mask
        cdef int c = 0, t = k - __builtin_popcountll(required), i, j, inserts = 0
        cdef bint flip
        cdef long long sc, c1, cut
        cdef long long row[64]  # row[a]: total score of a with the other available GPUs
        while free_mask:
            members[c] = _low(free_mask)
            free_mask ^= members[c]
            c += 1
        # enumerate the t GPUs added to R, or the c - t left out when fewer: the ranking does
        # not depend on the order (ties are broken by _better, criterion 5 included)
        flip = c - t < t
        if flip:
            t = c - t
        acc[0] = 0 if flip else required
        for i in range(t):
            idx[i] = i
            acc[i + 1] = acc[i] | members[i]
        while True:
            g = (required | (all_free ^ acc[t])) if flip else acc[t]
            sc = table[g]
            c1 = memo[available ^ g]
            if c1 < 0:
                c1 = self._partition(available ^ g, k, memo)
            c1 += sc
            if not best.rejects(c1, sc):
                rest = available ^ g
                if inserts == 0:
                    cut = self._cut(g, rest)
                else:
                    # many candidates tie on criteria 1-2 (symmetric nodes): the cut from row
                    # sums, sum over the smaller side of row[a] minus twice its set score
                    if inserts == 1:
                        self._rows(available, row)
                    m = rest if __builtin_popcountll(rest) <= __builtin_popcountll(g) else g
                    cut = -2 * table[m]
                    while m:
                        cut += row[__builtin_ctzll(m)]
                        m &= m - 1
                inserts += 1
                best.insert(g, c1, sc, self._numa_count(g), cut)
            if not _next_combination(idx, acc, members, t, c):
                break
        return 0

    cdef void _rows(self, uint64_t available, long long* row) noexcept:
        """row[a] = sum of s[a][b] over the other available GPUs b (scores are symmetric)."""
        cdef uint64_t m = available, r
        cdef int a, b
        while m:
            a = __builtin_ctzll(m)
            m &= m - 1
            row[a] = 0
            r = available & ~((<uint64_t>1) << a)
            while r:
                b = __builtin_ctzll(r)
                r &= r - 1
                row[a] += self.s[a][b]

    cdef list _ranked_compressed(self, available, required, int k, int top):
        cdef int i
        sub = self._subs.get(available)
        if sub is None:
            members = [i for i in range(self.n) if (available >> i) & 1]
            sub_scores = [[self.s[a][b] for b in members] for a in members]
            numa = [__builtin_ctzll(self.numa_bit[a]) for a in members]
            if len(self._subs) >= _SUB_CACHE_SIZE:
                self._subs.clear()
            sub = self._subs[available] = (members, AllocationSolver(sub_scores, numa))
        members, solver = sub
        sub_required = 0
        for i, gpu in enumerate(members):
            if (required >> gpu) & 1:
                sub_required |= 1 << i
        out = []
        for g, c1, sc, numa_count, cut in solver.rank((1 << len(members)) - 1, sub_required, k, top):
            real = 0
            for i, gpu in enumerate(members):
                if (g >> i) & 1:
                    real |= 1 << gpu
            out.append((real, c1, sc, numa_count, cut))
        return out

    # ------------------------------------------------------------------ bounded search
    cdef uint64_t _grow(self, uint64_t g, uint64_t pool, int size) noexcept:
        cdef long long gain[64]
        cdef long long best_gain
        cdef uint64_t candidates = pool & ~g, r, m
        cdef int j, best_j, cnt = __builtin_popcountll(g)
        r = candidates
        while r:
            j = __builtin_ctzll(r)
            r &= r - 1
            gain[j] = 0
            m = g
            while m:
                gain[j] += self.s[j][__builtin_ctzll(m)]
                m &= m - 1
        while cnt < size:
            best_j = -1
            best_gain = -1
            r = candidates
            while r:
                j = __builtin_ctzll(r)
                r &= r - 1
                if gain[j] > best_gain:
                    best_gain = gain[j]
                    best_j = j
            candidates ^= (<uint64_t>1) << best_j
            g |= (<uint64_t>1) << best_j
            cnt += 1
            r = candidates
            while r:
                j = __builtin_ctzll(r)
                r &= r - 1
                gain[j] += self.s[j][best_j]
        return g

    cdef long long _greedy_partition(self, uint64_t mask, int k) noexcept:
        cdef long long total = 0
        cdef uint64_t group
        cdef int cnt
        while mask:
            cnt = __builtin_popcountll(mask)
            group = self._grow(_low(mask), mask, k if k < cnt else cnt)
            total += self._set_score(group)
            mask ^= group
        return total

    cdef list _heuristic(self, uint64_t available, uint64_t required, int k, int top):
        cdef _TopList best = _TopList(top)
        cdef uint64_t seen[64]
        cdef int n_seen = 0, i, dup
        cdef uint64_t seeds = available & ~required, seed, g
        cdef long long sc, c1
        cdef bint only_required = __builtin_popcountll(required) == k
        while True:
            if only_required:
                seed = required
            else:
                if not seeds:
                    break
                seed = required | _low(seeds)
                seeds &= seeds - 1
            g = self._grow(seed, available, k)
            dup = 0
            for i in range(n_seen):
                if seen[i] == g:
                    dup = 1
                    break
            if not dup:
                seen[n_seen] = g
                n_seen += 1
                sc = self._set_score(g)
                c1 = sc + self._greedy_partition(available ^ g, k)
                if not best.rejects(c1, sc):
                    best.insert(g, c1, sc, self._numa_count(g), self._cut(g, available ^ g))
            if only_required:
                break
        return best.result()


def choose(AllocationSolver solver, available, must_include, size):
    """See ``agent.topology._pure.choose``: the sorted best ``size`` GPU indices, or None
    when the request is not plainly valid."""
    solver._acquire()
    try:
        return solver._choose(available, must_include, size)
    finally:
        solver._release()


# ---------------------------------------------------------------------------------------------
# Request conversion (the allocator's hot path): GPU index lists <-> bitmasks.
# ---------------------------------------------------------------------------------------------

cdef inline bint _next_combination(int* idx, uint64_t* acc, uint64_t* members, int t, int c) noexcept:
    """Advance ``idx`` (t ascending positions among c) to the next combination in
    lexicographic order, keeping ``acc[j + 1]`` the OR of ``members[idx[0..j]]``; False
    after the last one."""
    cdef int i = t - 1, j
    while i >= 0 and idx[i] == c - t + i:
        i -= 1
    if i < 0:
        return False
    idx[i] += 1
    acc[i + 1] = acc[i] | members[idx[i]]
    for j in range(i + 1, t):
        idx[j] = idx[j - 1] + 1
        acc[j + 1] = acc[j] | members[idx[j]]
    return True


cdef bint _index_mask(object values, int n, uint64_t* mask, int* count) except -1:
    """OR the bits of ``values`` into ``mask`` and count them; False (leaving the caller to
    name the problem) when an entry is not an int in 0..n-1 or repeats."""
    cdef int overflow = 0
    cdef long long i
    cdef uint64_t bit
    for v in values:
        if type(v) is not int:
            return False
        i = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow or i < 0 or i >= n:
            return False
        bit = (<uint64_t>1) << i
        if mask[0] & bit:
            return False
        mask[0] |= bit
        count[0] += 1
    return True


def request_masks(available, must_include, int n):
    """``(available mask, must-include mask, len(available), len(must_include))``; raises
    ValueError when an entry is not an int in 0..n-1 or is repeated (the caller explains)."""
    cdef uint64_t a = 0, r = 0
    cdef int na = 0, nr = 0
    if not _index_mask(available, n, &a, &na) or not _index_mask(must_include, n, &r, &nr):
        raise ValueError("not distinct GPU indices in range")
    return a, r, na, nr


def mask_indices(mask):
    """Set bits of ``mask`` (below 2**64), ascending."""
    cdef uint64_t m = mask
    cdef list out = []
    while m:
        out.append(__builtin_ctzll(m))
        m &= m - 1
    return out


def group_devices(dict parent, int n):
    """``{gpu: [device IDs]}`` from ``{device ID: gpu}``, IDs in the dict's order; raises
    ValueError when an ID is not a non-empty str or a GPU not an int in 0..n-1."""
    cdef dict out = {}
    cdef list ids
    cdef long long g
    for device_id, gpu in parent.items():
        if type(device_id) is not str or not device_id or type(gpu) is not int:
            raise ValueError("bad entry")
        g = gpu
        if g < 0 or g >= n:
            raise ValueError("out of range")
        ids = out.get(gpu)
        if ids is None:
            out[gpu] = [device_id]
        else:
            ids.append(device_id)
    return out


# ---------------------------------------------------------------------------------------------
# Replica requests in one call: the same contract and results as
# agent/topology/_pure.py:select_replicas (read that one for the policy). This one may also
# return None for a valid request it does not handle (replica counts beyond 2**62, IDs that
# are not ASCII, replica numbers of more than 18 digits): the allocator then uses the twin.
# ---------------------------------------------------------------------------------------------

from cpython.object cimport PyObject

cdef extern from "Python.h":
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject*)
    int PyUnicode_IS_ASCII(PyObject*)
    void* PyUnicode_DATA(PyObject*)
    int PyUnicode_Compare(PyObject*, PyObject*) except? -1

cdef long long _LOAD_LIMIT = (<long long>1) << 62


cdef inline int _before_len_text(PyObject* a, PyObject* b) except -1:
    """1 when ``a`` sorts before ``b`` by (length, text), both str."""
    cdef Py_ssize_t la = PyUnicode_GET_LENGTH(a), lb = PyUnicode_GET_LENGTH(b)
    if la != lb:
        return la < lb
    return PyUnicode_Compare(a, b) < 0


cdef int _sort_len_text(PyObject** items, Py_ssize_t m) except -1:
    """Sort by (length, text): binary insertion (the IDs of one GPU are distinct)."""
    cdef Py_ssize_t i, lo, hi, mid, j
    cdef PyObject* x
    for i in range(1, m):
        x = items[i]
        lo = 0
        hi = i
        while lo < hi:
            mid = (lo + hi) >> 1
            if _before_len_text(x, items[mid]):
                hi = mid
            else:
                lo = mid + 1
        j = i
        while j > lo:
            items[j] = items[j - 1]
            j -= 1
        items[lo] = x
    return 0


cdef inline int _natural_parts(PyObject* d, Py_ssize_t* head_len, long long* num) noexcept:
    """The natural key of an ASCII ID: (head, number, "") for ``<head>::<digits>``, else
    (ID, -1, ID); 0 when this one cannot say (not ASCII, more than 18 digits)."""
    cdef Py_ssize_t n, i, j
    cdef const unsigned char* s
    cdef long long v
    if not PyUnicode_IS_ASCII(d):
        return 0
    n = PyUnicode_GET_LENGTH(d)
    s = <const unsigned char*>PyUnicode_DATA(d)
    head_len[0] = n
    num[0] = -1
    i = n - 2
    while i >= 0 and not (s[i] == 58 and s[i + 1] == 58):  # "::"
        i -= 1
    if i < 0 or i + 2 == n:
        return 1
    if n - (i + 2) > 18:
        for j in range(i + 2, n):
            if not 48 <= s[j] <= 57:
                return 1
        return 0
    v = 0
    for j in range(i + 2, n):
        if not 48 <= s[j] <= 57:
            return 1
        v = v * 10 + (s[j] - 48)
    head_len[0] = i
    num[0] = v
    return 1


cdef inline int _natural_before(PyObject* a, Py_ssize_t ha, long long na,
                                PyObject* b, Py_ssize_t hb, long long nb) noexcept:
    """1 when natural key a < key b (ASCII IDs; equal keys: 0)."""
    cdef const char* sa = <const char*>PyUnicode_DATA(a)
    cdef const char* sb = <const char*>PyUnicode_DATA(b)
    cdef int c = memcmp(sa, sb, ha if ha < hb else hb)
    if c != 0:
        return c < 0
    if ha != hb:
        return ha < hb
    # same head: numbers (-1 for a non-numeric ID); then "" == "", or the equal IDs
    return na < nb


cdef int _take(int g, int c, PyObject** grouped, Py_ssize_t* start, int* nfree, int* taken,
               char* is_sorted, PyObject** chosen, int* chosen_gpu, Py_ssize_t* n_chosen,
               Py_ssize_t nr) except -1:
    """Move the first ``c`` free IDs of GPU ``g`` (by (length, text)) into ``chosen``."""
    cdef int i
    if not is_sorted[g]:
        _sort_len_text(grouped + start[g], nfree[g])
        is_sorted[g] = 1
    for i in range(c):
        chosen[n_chosen[0]] = grouped[start[g] + i]
        chosen_gpu[n_chosen[0]] = g
        n_chosen[0] += 1
    start[g] += c
    nfree[g] -= c
    taken[g] += c
    return 0


def select_replicas(AllocationSolver solver, available, must_include, size, bint packed,
                    per_gpu):
    """See ``agent.topology._pure.select_replicas``."""
    solver._acquire()
    try:
        return _select_replicas(solver, available, must_include, size, packed, per_gpu)
    finally:
        solver._release()


cdef object _select_replicas(AllocationSolver solver, available, must_include, size,
                             bint packed, per_gpu):
    cdef int n = solver.n, g, overflow = 0, level, i, j, t, start_t, end_t, tier_len
    cdef long long v, k, need, uniform, best0, best1, key0, key1, c
    cdef Py_ssize_t count, p, q, nr
    cdef int cnt[64]
    cdef int nfree[64]
    cdef int taken[64]
    cdef Py_ssize_t start[64]
    cdef Py_ssize_t end[64]
    cdef Py_ssize_t fill[64]
    cdef long long load[64]
    cdef char is_sorted[64]
    cdef int order[64]
    cdef int group[64]
    cdef int n_order = 0, n_group
    cdef uint64_t in_req, pool, tier_mask, picks
    cdef PyObject** grouped = NULL
    cdef int* gpus = NULL
    cdef PyObject** chosen = NULL
    cdef int* chosen_gpu = NULL
    cdef Py_ssize_t* chosen_head = NULL
    cdef long long* chosen_num = NULL
    cdef Py_ssize_t n_chosen = 0
    cdef PyObject* x
    cdef PyObject** raw = NULL
    cdef Py_ssize_t hlen
    cdef dict parent = {}
    cdef list required
    cdef list out
    if type(size) is not int:
        return None
    k = PyLong_AsLongLongAndOverflow(size, &overflow)
    if overflow or k < 1:
        return None
    if type(available) is not list and type(available) is not tuple:
        available = list(available)
    count = len(available)
    if k > count:
        return None
    memset(cnt, 0, sizeof(cnt))
    memset(taken, 0, sizeof(taken))
    memset(is_sorted, 0, sizeof(is_sorted))
    gpus = <int*>malloc(count * sizeof(int) + 1)
    raw = <PyObject**>malloc(count * sizeof(PyObject*) + 1)
    grouped = <PyObject**>malloc(count * sizeof(PyObject*) + 1)
    chosen = <PyObject**>malloc(k * sizeof(PyObject*))
    chosen_gpu = <int*>malloc(k * sizeof(int))
    chosen_head = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
    chosen_num = <long long*>malloc(k * sizeof(long long))
    try:
        if not (gpus and raw and grouped and chosen and chosen_gpu and chosen_head and chosen_num):
            raise MemoryError()
        # validate and count; every ID once (the dict), every GPU index in range
        for p in range(count):
            entry = available[p]
            if type(entry) is tuple:
                if len(<tuple>entry) != 2:
                    return None
                device_id = (<tuple>entry)[0]
                gpu = (<tuple>entry)[1]
            elif type(entry) is list:
                if len(<list>entry) != 2:
                    return None
                device_id = (<list>entry)[0]
                gpu = (<list>entry)[1]
            else:
                return None
            if type(device_id) is not str or PyUnicode_GET_LENGTH(<PyObject*>device_id) == 0:
                return None
            if type(gpu) is not int:
                return None
            v = PyLong_AsLongLongAndOverflow(gpu, &overflow)
            if overflow or v < 0 or v >= n:
                return None
            g = <int>v
            parent[device_id] = gpu
            gpus[p] = g
            raw[p] = <PyObject*>device_id
            if cnt[g] == 0:
                order[n_order] = g
                n_order += 1
            cnt[g] += 1
        if len(parent) != count:
            return None  # a repeated ID
        # each GPU's IDs together, in input order
        q = 0
        for g in range(n):
            start[g] = fill[g] = q
            q += cnt[g]
            end[g] = q
        for p in range(count):
            g = gpus[p]
            grouped[fill[g]] = raw[p]
            fill[g] += 1
        # must-include: available, once each; out of its GPU's free IDs
        required = []
        if must_include:
            seen = set()
            for device_id in must_include:
                gpu = parent.get(device_id)
                if gpu is None or device_id in seen:
                    return None
                seen.add(device_id)
                required.append(device_id)
                g = <int>(<long long>gpu)
                for q in range(start[g], end[g]):
                    if <object>grouped[q] == device_id:
                        break
                while q + 1 < end[g]:
                    grouped[q] = grouped[q + 1]
                    q += 1
                end[g] -= 1
                taken[g] += 1
        nr = len(required)
        if nr > k:
            return None
        for g in range(n):
            nfree[g] = <int>(end[g] - start[g])
        # load: replicas allocated already (count minus free, free counting must-include)
        if per_gpu is None:
            uniform = 0
            for i in range(n_order):
                if cnt[order[i]] > uniform:
                    uniform = cnt[order[i]]
            for i in range(n_order):
                g = order[i]
                load[g] = uniform - cnt[g]
        elif isinstance(per_gpu, int):
            v = PyLong_AsLongLongAndOverflow(per_gpu, &overflow)
            if overflow or not -_LOAD_LIMIT <= v <= _LOAD_LIMIT:
                return None
            for i in range(n_order):
                g = order[i]
                load[g] = v - cnt[g] if v > cnt[g] else 0
        else:
            for i in range(n_order):
                g = order[i]
                total = int(per_gpu.get(g, cnt[g]))
                v = PyLong_AsLongLongAndOverflow(total, &overflow)
                if overflow or not -_LOAD_LIMIT <= v <= _LOAD_LIMIT:
                    return None
                load[g] = v - cnt[g] if v > cnt[g] else 0
        for i in range(nr):
            chosen[i] = <PyObject*>required[i]
        n_chosen = nr
        need = k - nr

        while need > 0 and not packed:
            # one round: each GPU at the lowest level of use in this request gets one more
            # replica, least loaded first; a partly taken tier of equal load goes to topology
            level = -1
            for i in range(n_order):
                g = order[i]
                if nfree[g] and (level < 0 or taken[g] < level):
                    level = taken[g]
            if level < 0:
                return None  # pragma: no cover - need never exceeds the free IDs
            n_group = 0
            for g in range(n):  # ascending index, then stable insertion by load
                if cnt[g] and nfree[g] and taken[g] == level:
                    j = n_group
                    while j > 0 and load[group[j - 1]] > load[g]:
                        group[j] = group[j - 1]
                        j -= 1
                    group[j] = g
                    n_group += 1
            start_t = 0
            while start_t < n_group and need > 0:
                end_t = start_t + 1
                while end_t < n_group and load[group[end_t]] == load[group[start_t]]:
                    end_t += 1
                tier_len = end_t - start_t
                if tier_len <= need or level > 0:
                    t = tier_len if tier_len <= need else <int>need
                    for i in range(start_t, start_t + t):
                        _take(group[i], 1, grouped, start, nfree, taken, is_sorted, chosen,
                              chosen_gpu, &n_chosen, nr)
                    need -= t
                else:
                    in_req = 0
                    for g in range(n):
                        if taken[g]:
                            in_req |= (<uint64_t>1) << g
                    tier_mask = 0
                    for i in range(start_t, end_t):
                        tier_mask |= (<uint64_t>1) << group[i]
                    pool = in_req | tier_mask
                    picks = solver._best_mask(
                        pool, in_req, __builtin_popcountll(in_req) + <int>need) & ~in_req
                    need -= __builtin_popcountll(picks)
                    while picks:
                        _take(__builtin_ctzll(picks), 1, grouped, start, nfree, taken, is_sorted,
                              chosen, chosen_gpu, &n_chosen, nr)
                        picks &= picks - 1
                start_t = end_t
        while need > 0:  # packed: key (not in the request, -(load + taken)), smallest first
            best0 = 2
            best1 = 0
            tier_mask = 0
            for g in range(n):
                if not (cnt[g] and nfree[g]):
                    continue
                key0 = 0 if taken[g] else 1
                key1 = -(load[g] + taken[g])
                if key0 < best0 or (key0 == best0 and key1 < best1):
                    best0 = key0
                    best1 = key1
                    tier_mask = 0
                if key0 == best0 and key1 == best1:
                    tier_mask |= (<uint64_t>1) << g
            if __builtin_popcountll(tier_mask) == 1 or best0 == 0:
                g = __builtin_ctzll(tier_mask)
            else:
                in_req = 0
                for i in range(n):
                    if taken[i]:
                        in_req |= (<uint64_t>1) << i
                g = __builtin_ctzll(solver._best_mask(
                    in_req | tier_mask, in_req, __builtin_popcountll(in_req) + 1) & ~in_req)
            c = need if need < nfree[g] else nfree[g]
            _take(g, <int>c, grouped, start, nfree, taken, is_sorted, chosen, chosen_gpu,
                  &n_chosen, nr)
            need -= c

        # sorted by GPU index, then natural replica order (stable, as sorted() is)
        for i in range(nr):
            chosen_gpu[i] = <int>(<long long>parent[required[i]])
        for p in range(n_chosen):
            if not _natural_parts(chosen[p], &chosen_head[p], &chosen_num[p]):
                return None
        for p in range(1, n_chosen):
            x = chosen[p]
            g = chosen_gpu[p]
            hlen = chosen_head[p]
            v = chosen_num[p]
            q = p
            while q > 0 and (g < chosen_gpu[q - 1] or (
                    g == chosen_gpu[q - 1] and _natural_before(
                        x, hlen, v, chosen[q - 1], chosen_head[q - 1], chosen_num[q - 1]))):
                chosen[q] = chosen[q - 1]
                chosen_gpu[q] = chosen_gpu[q - 1]
                chosen_head[q] = chosen_head[q - 1]
                chosen_num[q] = chosen_num[q - 1]
                q -= 1
            chosen[q] = x
            chosen_gpu[q] = g
            chosen_head[q] = hlen
            chosen_num[q] = v
        out = [<object>chosen[p] for p in range(n_chosen)]
        return out
    finally:
        free(gpus)
        free(raw)
        free(grouped)
        free(chosen)
        free(chosen_gpu)
        free(chosen_head)
        free(chosen_num)

