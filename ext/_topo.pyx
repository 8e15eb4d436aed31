# cython: language_level=3
# cython: boundscheck=False
# cython: wraparound=False
# cython: cdivision=True
# cython: initializedcheck=False
# cython: embedsignature=True
"""Compiled topology kernel (``agent._topo``).

The combinatorics only, over plain ints: adjacency bitmasks (``adjacency[i]`` has bit j set
when GPUs i and j share an NVLink), pair-score matrices, NUMA ids, GPU bitmasks and device
ranks. Never device IDs, NVML handles or dataclasses: a request is checked once, where its
device IDs become ranks (``agent.topology.deviceids``), and the checks here are this module's
own guards for its public API. ``agent/topology/_pure/`` is the readable twin; both return
identical results and raise identical errors.

One shortcut the twin does not take (the answers are the same): the single best set of an
exact search (``best_mask``, and ``rank`` for one entry) is searched once per choice of how
many GPUs each group of interchangeable free GPUs gives (same NUMA node, same pair score
with every other GPU, as the GPUs behind one PCIe switch of an NVSwitch node), taking the
lowest of each group: the other sets of that choice tie with it on criteria 1-4 and lose on
the lowest indices. A 16-GPU NVSwitch node asked for 8 GPUs with one must-include looks at
750 sets instead of 6,435.

Directives (above), chosen deliberately:
- ``boundscheck=False, wraparound=False, initializedcheck=False``: the hot loops index fixed
  C arrays of MAX_GPUS entries and Python lists by non-negative indices below their length.
  That holds because every public entry point checks its arguments first (type, then range:
  masks within the node's GPUs, sizes within 1..n, at most MAX_GPUS GPUs, exact tables only
  up to EXACT_MAX_GPUS), with the same TypeError/ValueError messages as the twin.
- ``cdivision=True``: the only division is ``count % k`` with ``count >= 0`` and ``k >= 1``,
  where C and Python agree.
"""

from libc.stdint cimport uint64_t
from libc.stdlib cimport malloc, free
from libc.stdlib cimport free as free_mem  # ``free`` is also a parameter name below
from libc.string cimport memset
from cpython.long cimport PyLong_AsLongLongAndOverflow

cimport cython
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK,
                               NOWAIT_LOCK)

cdef extern from *:
    int __builtin_popcountll(unsigned long long) nogil
    int __builtin_ctzll(unsigned long long) nogil

cdef enum:
    _MAX_GPUS = 64
    _EXACT = 16
    _SUB_CACHE_SIZE = 16
    _MAX_CANDIDATES = 12870  # C(16, 8): no exact ranking has more; the bounded search <= 64

#: Most GPUs per node (64-bit masks).
MAX_GPUS = _MAX_GPUS
#: Largest number of GPUs solved exactly (bitmask tables of 2**n entries). The one definition
#: of this limit: ``agent.topology.kernel.EXACT_MAX_GPUS`` reads it from here (or from the
#: twin, which a test keeps equal).
EXACT_MAX_GPUS = _EXACT
#: Largest pair score and device rank accepted (as in the twin).
SCORE_MAX = 2**31 - 1
COUNT_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Argument checks: the twin's _int/_mask/_bounds/_ranks, message for message.
# ---------------------------------------------------------------------------------------------

cdef long long _int(object v, str what, long long lo, long long hi) except? -1:
    if type(v) is not int:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{what} {v} outside {lo}..{hi}")
    return <long long>v


cdef uint64_t _mask(object v, str what, int n) except? 0xFFFFFFFFFFFFFFFF:
    if type(v) is not int:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if v < 0 or v >> n:
        raise ValueError(f"{what} {v:#x} is not a set of the node's {n} GPUs")
    return <uint64_t>v


cdef int _bounds(object start, int n, long long* out) except -1:
    """Copy a valid ``start`` (n + 1 non-decreasing ints from 0) into ``out``."""
    cdef int i, overflow = 0
    cdef long long lo = 0, x
    if len(start) != n + 1:
        raise ValueError(f"start has {len(start)} entries for {n} GPUs (expected {n + 1})")
    for i in range(n + 1):
        v = start[i]
        x = PyLong_AsLongLongAndOverflow(v, &overflow) if type(v) is int else -1
        if overflow or x < lo or x > (0 if i == 0 else COUNT_MAX):
            _int(v, f"start[{i}]", lo, 0 if i == 0 else COUNT_MAX)  # raises the twin's error
        out[i] = lo = x
    return 0


cdef int _ranks(object values, str what, long long total, long long* out) except -1:
    """Copy ``values`` (strictly ascending ints in 0..total-1) into ``out``."""
    cdef Py_ssize_t i, m = len(values)
    cdef int overflow = 0
    cdef long long lo = 0, x
    for i in range(m):
        v = values[i]
        x = PyLong_AsLongLongAndOverflow(v, &overflow) if type(v) is int else -1
        if overflow or x < lo or x >= total:
            _int(v, f"{what}[{i}]", lo, total - 1)  # raises the twin's error
        out[i] = x
        lo = x + 1
    return 0


cdef void _per_gpu(long long* ranks, Py_ssize_t m, long long* bounds, int n,
                   long long* out) noexcept:
    """``out[g]``: how many of the ascending ``ranks`` GPU g holds."""
    cdef int g = 0
    cdef Py_ssize_t i
    memset(out, 0, n * sizeof(long long))
    for i in range(m):
        while ranks[i] >= bounds[g + 1]:
            g += 1
        out[g] += 1


cdef int _adjacency(object adjacency, uint64_t* adj) except -1:
    """Copy a valid adjacency into ``adj``; its GPU count."""
    cdef int n = len(adjacency), i
    if n > _MAX_GPUS:
        raise ValueError(f"at most {_MAX_GPUS} GPUs, got {n}")
    for i in range(n):
        v = adjacency[i]
        if type(v) is not int or v < 0 or v >> n:
            _mask(v, f"adjacency[{i}]", n)  # raises with the twin's message
        adj[i] = <uint64_t>v
    return n


cdef inline list _members(uint64_t mask, int n):
    cdef int i
    return [i for i in range(n) if (mask >> i) & 1]


def mask_indices(mask):
    """Set bits of ``mask`` (a 64-bit mask), ascending."""
    cdef uint64_t m = _mask(mask, "mask", _MAX_GPUS)
    cdef list out = []
    while m:
        out.append(__builtin_ctzll(m))
        m &= m - 1
    return out


def nvlink_islands(adjacency):
    """Connected components of two or more GPUs, sorted, ordered by lowest GPU."""
    cdef uint64_t adj[_MAX_GPUS]
    cdef int n = _adjacency(adjacency, adj), i, start
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
    cdef uint64_t adj[_MAX_GPUS]
    cdef int n = _adjacency(adjacency, adj)
    cdef list found = []
    cdef uint64_t everyone = ((<uint64_t>1) << n) - 1 if n < 64 else <uint64_t>0xFFFFFFFFFFFFFFFF
    _expand(0, everyone, 0, adj, found, n)
    found.sort()
    return found



# ---------------------------------------------------------------------------------------------
# Allocation solver: the same objective, results, tie-breaks and errors as
# agent/topology/_pure/solver.py:AllocationSolver (read that one for the contract).
# ---------------------------------------------------------------------------------------------

cdef inline uint64_t _low(uint64_t m) noexcept nogil:
    return m & (~m + 1)


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


cdef struct _Twins:
    # the free GPUs in groups of interchangeable ones: ``prefix[i][j]`` holds the lowest j
    # of group i and ``rows[i][j]`` the sum of their rows (scores with every available GPU),
    # ``before[i]`` how many GPUs the groups before i hold together
    int m
    int size[_EXACT]
    int before[_EXACT + 1]
    uint64_t prefix[_EXACT][_EXACT + 1]
    long long rows[_EXACT][_EXACT + 1]
    uint64_t available
    int k
    bint one_group  # the GPUs left over form at most one group: P_k(rest) = score(rest)
    long long score  # of the available GPUs
    long long* table
    long long* memo


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

    cdef inline bint rejects_numa(self, long long c1, long long sc, int nu) noexcept:
        """Cannot enter either: full, and (c1, sc) equal to its last entry's with more NUMA
        nodes (call after :meth:`rejects` let the entry through)."""
        cdef int w = self.count - 1
        return self.count == self.cap and c1 == self.c1[w] and sc == self.sc[w] and nu > self.nu[w]

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
    cdef long long s[_MAX_GPUS][_MAX_GPUS]
    cdef uint64_t numa_bit[_MAX_GPUS]
    cdef uint64_t node_gpus[_MAX_GPUS]  # GPUs of each distinct NUMA id, n_nodes of them
    cdef int n_nodes
    cdef int twin_of[_MAX_GPUS]  # lowest GPU interchangeable with each GPU (itself if none)
    cdef long long* table
    cdef long long* memo[_EXACT + 1]  # by k: k <= popcount(mask) <= _EXACT (partition_value)
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
        if n > _MAX_GPUS:
            raise ValueError(f"at most {_MAX_GPUS} GPUs, got {n}")
        if len(numa) != n:
            raise ValueError(f"numa has {len(numa)} entries for {n} GPUs")
        for i in range(n):
            row = scores[i]
            if len(row) != n:
                raise ValueError(f"scores[{i}] has {len(row)} entries for {n} GPUs")
            for j in range(n):
                v = row[j]
                if type(v) is not int or not 0 <= v <= SCORE_MAX:
                    _int(v, f"scores[{i}][{j}]", 0, SCORE_MAX)
                self.s[i][j] = <long long>v
            if self.s[i][i] != 0:
                raise ValueError(f"scores[{i}][{i}] must be 0, got {self.s[i][i]}")
        for i in range(n):
            for j in range(i + 1, n):
                if self.s[i][j] != self.s[j][i]:
                    raise ValueError(
                        f"scores are not symmetric: scores[{i}][{j}] = {self.s[i][j]}, "
                        f"scores[{j}][{i}] = {self.s[j][i]}"
                    )
        for i in range(n):
            _int(numa[i], f"numa[{i}]", 0, _MAX_GPUS - 1)
        self.n = n
        for i in range(n):
            self.numa_bit[i] = (<uint64_t>1) << <int>numa[i]
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
        self._find_twins()

    def __dealloc__(self):
        cdef int k
        if self._mutex != NULL:
            PyThread_free_lock(self._mutex)
        free(self.table)
        for k in range(_EXACT + 1):
            free(self.memo[k])

    cdef void _find_twins(self) noexcept:
        """GPUs a and b are interchangeable when they are on the same NUMA node and score
        alike with every other GPU: swapping them changes no criterion but the last."""
        cdef int a, b, x, same
        for a in range(self.n):
            self.twin_of[a] = a
            for b in range(a):
                if self.twin_of[b] != b or self.numa_bit[a] != self.numa_bit[b]:
                    continue
                same = 1
                for x in range(self.n):
                    if x != a and x != b and self.s[a][x] != self.s[b][x]:
                        same = 0
                        break
                if same:
                    self.twin_of[a] = b
                    break

    cdef int _acquire(self) except -1:
        if not PyThread_acquire_lock(self._mutex, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self._mutex, WAIT_LOCK)
        return 0

    cdef inline void _release(self) noexcept:
        PyThread_release_lock(self._mutex)

    # ------------------------------------------------------------------ small helpers
    cdef long long _set_score(self, uint64_t mask) noexcept:
        cdef int members[_MAX_GPUS]
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
        """Sum of pair scores within ``mask``."""
        return self._set_score(_mask(mask, "mask", self.n))

    cdef int _request(self, available, required, k, uint64_t* a, uint64_t* r) except -1:
        """The twin's ``_request``: check a rank/best_mask call; the size is returned."""
        cdef int n_avail, n_req, kk
        a[0] = _mask(available, "available", self.n)
        r[0] = _mask(required, "required", self.n)
        if r[0] & ~a[0]:
            raise ValueError("required GPUs must be available")
        n_avail = __builtin_popcountll(a[0])
        kk = <int>_int(k, "size", 1, self.n)
        n_req = __builtin_popcountll(r[0])
        if not n_req <= kk <= n_avail:
            raise ValueError(f"size {kk} impossible with {n_avail} available and {n_req} required")
        return kk

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
            if self.n > _EXACT:  # callers compress first; never 2**n for a big node
                raise ValueError(f"no exact tables above {_EXACT} GPUs")
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
        if not 1 <= k <= _EXACT or self.n > _EXACT:
            raise ValueError(f"no exact tables above {_EXACT} GPUs")
        if self.memo[k] == NULL:
            size = (<uint64_t>1) << self.n
            self.memo[k] = <long long*>malloc(size * sizeof(long long))
            if self.memo[k] == NULL:
                raise MemoryError()
            memset(self.memo[k], 0xff, size * sizeof(long long))  # all -1
            self.memo[k][0] = 0
        return self.memo[k]

    def partition_value(self, mask, k):
        """See the twin: ``P_k(mask)``, exact, for a mask of at most EXACT_MAX_GPUS GPUs."""
        cdef uint64_t m = _mask(mask, "mask", self.n)
        cdef int kk = <int>_int(k, "size", 1, self.n)
        cdef int count = __builtin_popcountll(m)
        cdef long long v
        if count > _EXACT:
            raise ValueError(
                f"partition_value is exact for at most {_EXACT} GPUs, the mask has {count}"
            )
        if kk > count:  # one group of them all (also keeps k within the memo tables)
            return self._set_score(m)
        if self.n > _EXACT:
            self._acquire()
            try:
                members, sub = self._sub(mask)
            finally:
                self._release()
            return sub.partition_value(((<uint64_t>1) << count) - 1, kk)
        self._acquire()
        try:
            self._table()
            v = self._partition(m, kk, self._memo_for(kk))
        finally:
            self._release()
        return v

    cdef long long _partition(self, uint64_t mask, int k, long long* memo) noexcept:
        cdef long long v = memo[mask], best = -1
        if v >= 0:
            return v
        cdef uint64_t low = _low(mask), rest = mask ^ low
        cdef uint64_t members[_MAX_GPUS]
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
        cdef int idx[_MAX_GPUS]
        cdef uint64_t acc[_MAX_GPUS + 1]
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

    def best_score(self, k):
        """See the twin."""
        cdef int kk = <int>_int(k, "size", 1, self.n)
        self._acquire()
        try:
            return self._best_score(kk)
        finally:
            self._release()

    cdef object _best_score(self, int k):
        cdef uint64_t mask, size, everyone
        cdef long long best = -1, v
        cdef long long* table
        cdef int i
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
    def rank(self, available, required, k, top=1):
        """See the twin: the ``top`` best sets, each ``(mask, criterion1, score, numa_count,
        cut)``, best first."""
        cdef uint64_t a, r
        cdef int kk = self._request(available, required, k, &a, &r)
        cdef int tt = <int>_int(top, "top", 1, COUNT_MAX)
        if tt > _MAX_CANDIDATES:
            tt = _MAX_CANDIDATES  # never more candidates than this: same result, bounded memory
        self._acquire()
        try:
            return self._rank(a, r, kk, tt)
        finally:
            self._release()

    def best_mask(self, available, required, k):
        """``rank(available, required, k, 1)[0][0]``: the best set as a mask."""
        cdef uint64_t a, r
        cdef int kk = self._request(available, required, k, &a, &r)
        self._acquire()
        try:
            return self._best_mask(a, r, kk)
        finally:
            self._release()

    cdef list _rank(self, uint64_t available, uint64_t required, int k, int top):
        if __builtin_popcountll(available) > _EXACT:
            return self._heuristic(available, required, k, top)
        if self.n > _EXACT:
            return self._ranked_compressed(available, required, k, top)
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
        if n_avail > _EXACT or self.n > _EXACT:
            return <uint64_t>self._rank(available, required, k, 1)[0][0]
        self._top1.count = 0
        self._exact_into(available, required, k, self._top1)
        return self._top1.g[0]

    cdef int _exact_into(self, uint64_t available, uint64_t required, int k,
                         _TopList best) except -1:
        cdef long long* table = self._table()
        cdef long long* memo = self._memo_for(k)
        if best.cap == 1 and self._exact_by_twins(available, required, k, best):
            return 0
        cdef uint64_t members[_MAX_GPUS]
        cdef uint64_t acc[_MAX_GPUS + 1]
        cdef int idx[_MAX_GPUS]
        cdef uint64_t free_mask = available & ~required, g, rest, m, all_free = free_mask
        cdef int c = 0, t = k - __builtin_popcountll(required), i, j, inserts = 0
        cdef bint flip
        cdef long long sc, c1, cut
        cdef long long row[_MAX_GPUS]  # row[a]: total score of a with the other available GPUs
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

    cdef bint _exact_by_twins(self, uint64_t available, uint64_t required, int k,
                              _TopList best) except -1:
        """The best set alone (``best`` holds one entry), enumerating one set per choice of
        how many GPUs each group of interchangeable free GPUs gives, and from each group its
        lowest: the other sets of that choice tie with it on criteria 1-4 and lose on 5.
        False (nothing done) when no two free GPUs are interchangeable."""
        cdef _Twins tw
        cdef uint64_t free_mask = available & ~required, m
        cdef int g, slot, c = __builtin_popcountll(free_mask)
        cdef int slot_of[_MAX_GPUS]  # by group (its lowest GPU on the node)
        memset(slot_of, 0xff, sizeof(slot_of))  # all -1
        cdef long long row[_MAX_GPUS]
        cdef long long required_rows = 0
        tw.m = 0
        m = free_mask
        while m:
            g = __builtin_ctzll(m)
            m &= m - 1
            slot = slot_of[self.twin_of[g]]
            if slot < 0:
                slot = slot_of[self.twin_of[g]] = tw.m
                tw.m += 1
                tw.size[slot] = 0
                tw.prefix[slot][0] = 0
            tw.prefix[slot][tw.size[slot] + 1] = tw.prefix[slot][tw.size[slot]] | ((<uint64_t>1) << g)
            tw.size[slot] += 1
        if tw.m == c:
            return False
        self._rows(available, row)
        m = required
        while m:
            required_rows += row[__builtin_ctzll(m)]
            m &= m - 1
        tw.before[0] = 0
        for slot in range(tw.m):
            tw.before[slot + 1] = tw.before[slot] + tw.size[slot]
            tw.rows[slot][0] = 0
            for g in range(tw.size[slot]):
                tw.rows[slot][g + 1] = tw.rows[slot][g] + row[__builtin_ctzll(
                    tw.prefix[slot][g + 1] ^ tw.prefix[slot][g])]
        tw.available = available
        tw.k = k
        tw.one_group = __builtin_popcountll(available) - k <= k
        tw.table = self.table
        tw.score = self.table[available]
        tw.memo = self._memo_for(k)
        self._twins_walk(&tw, tw.m, k - __builtin_popcountll(required), required,
                         required_rows, best)  # k <= popcount(available): the groups hold it
        return True

    cdef void _twins_walk(self, _Twins* tw, int slot, int left, uint64_t g, long long rows,
                          _TopList best) noexcept:
        """Every choice of counts from the groups before ``slot`` adding ``left`` GPUs to
        ``g`` (whose rows sum to ``rows``); the first group takes what is left."""
        cdef int j, i = slot - 1
        if i == 0:
            if left <= tw.size[0]:
                self._twins_leaf(tw, g | tw.prefix[0][left], rows + tw.rows[0][left], best)
            return
        for j in range(min(left, tw.size[i]) + 1):
            if left - j <= tw.before[i]:  # the groups before this one can hold the rest
                self._twins_walk(tw, i, left - j, g | tw.prefix[i][j], rows + tw.rows[i][j], best)

    cdef inline void _twins_leaf(self, _Twins* tw, uint64_t g, long long rows,
                                 _TopList best) noexcept:
        cdef int nu
        cdef long long sc = tw.table[g], c1
        cdef long long cut = rows - 2 * sc  # the pair scores from g to the rest
        if tw.one_group:  # score(g) + score(rest) = score(available) - cut
            c1 = tw.score - cut
        else:
            c1 = tw.memo[tw.available ^ g]
            if c1 < 0:
                c1 = self._partition(tw.available ^ g, tw.k, tw.memo)
            c1 += sc
        if not best.rejects(c1, sc):
            nu = self._numa_count(g)
            if not best.rejects_numa(c1, sc, nu):
                best.insert(g, c1, sc, nu, cut)

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

    cdef tuple _sub(self, available):
        """The twin's ``_sub``: the GPUs of ``available`` and a solver on them alone."""
        cdef int i
        sub = self._subs.get(available)
        if sub is None:
            members = [i for i in range(self.n) if (available >> i) & 1]
            sub_scores = [[self.s[a][b] for b in members] for a in members]
            numa = [__builtin_ctzll(self.numa_bit[a]) for a in members]
            if len(self._subs) >= _SUB_CACHE_SIZE:
                self._subs.clear()
            sub = self._subs[available] = (members, AllocationSolver(sub_scores, numa))
        return sub

    cdef list _ranked_compressed(self, uint64_t available, uint64_t required, int k, int top):
        cdef int i
        cdef AllocationSolver solver
        sub = self._sub(available)
        members, solver = sub
        sub_required = 0
        for i, gpu in enumerate(members):
            if (required >> gpu) & 1:
                sub_required |= 1 << i
        out = []
        solver._acquire()
        try:
            ranked = solver._rank(((<uint64_t>1) << len(members)) - 1, sub_required, k, top)
        finally:
            solver._release()
        for g, c1, sc, numa_count, cut in ranked:
            real = 0
            for i, gpu in enumerate(members):
                if (g >> i) & 1:
                    real |= 1 << gpu
            out.append((real, c1, sc, numa_count, cut))
        return out

    # ------------------------------------------------------------------ bounded search
    cdef uint64_t _grow(self, uint64_t g, uint64_t pool, int size) noexcept:
        cdef long long gain[_MAX_GPUS]
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
        cdef uint64_t seen[_MAX_GPUS]
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



    # ------------------------------------------------------------------ replicas
    def replica_ranks(self, start, free, required, size, packed):
        """See the twin: the ranks a time-sliced request gets, ascending."""
        cdef long long bounds[_MAX_GPUS + 1]
        cdef long long nfree[_MAX_GPUS]
        cdef long long tk[_MAX_GPUS]
        cdef long long ld[_MAX_GPUS]
        cdef long long counts[_MAX_GPUS]
        cdef int n = self.n, g
        cdef Py_ssize_t nf, nr, i = 0, j = 0, a, b, a_end, b_end
        cdef long long need
        cdef long long* fr = NULL
        cdef long long* rq = NULL
        cdef list out = []
        _bounds(start, n, bounds)
        nf = len(free)
        nr = len(required)
        fr = <long long*>malloc((nf + nr + 1) * sizeof(long long))
        if fr == NULL:
            raise MemoryError()
        rq = fr + nf
        try:
            _ranks(free, "free", bounds[n], fr)
            _ranks(required, "required", bounds[n], rq)
            while i < nf and j < nr:
                if fr[i] == rq[j]:
                    raise ValueError(f"rank {fr[i]} is both free and required")
                if fr[i] < rq[j]:
                    i += 1
                else:
                    j += 1
            need = _int(size, "size", nr, nr + nf) - nr
            _per_gpu(fr, nf, bounds, n, nfree)
            _per_gpu(rq, nr, bounds, n, tk)
            for g in range(n):
                ld[g] = bounds[g + 1] - bounds[g] - nfree[g] - tk[g] if nfree[g] or tk[g] else 0
            self._acquire()
            try:
                self._replica_counts(nfree, tk, ld, need, bool(packed), counts)
            finally:
                self._release()
            # GPU by GPU: its required ranks merged with its first counts[g] free ones
            i = j = 0
            for g in range(n):
                a, a_end = i, i + counts[g]
                b, b_end = j, j + tk[g] - counts[g]
                while a < a_end or b < b_end:
                    if b == b_end or (a < a_end and fr[a] < rq[b]):
                        out.append(fr[a])
                        a += 1
                    else:
                        out.append(rq[b])
                        b += 1
                i += nfree[g] + counts[g]
                j = b_end
            return out
        finally:
            free_mem(fr)

    cdef inline uint64_t _in_request(self, long long* taken) noexcept:
        cdef uint64_t m = 0
        cdef int g
        for g in range(self.n):
            if taken[g]:
                m |= (<uint64_t>1) << g
        return m

    cdef int _replica_counts(self, long long* nfree, long long* taken, long long* load,
                             long long need, bint packed, long long* counts) except -1:
        """Per GPU, how many more replicas to take (``counts``); ``nfree`` and ``taken`` are
        updated as replicas move into the request. The caller holds the lock."""
        cdef int n = self.n, g, i, j, start_t, end_t, tier_len, n_group, t
        cdef long long level, best0, best1, key0, key1, c
        cdef int group[_MAX_GPUS]
        cdef uint64_t in_req, tier_mask, picks
        memset(counts, 0, n * sizeof(long long))
        while need > 0 and not packed:
            # one round: each GPU at the lowest level of use in this request gets one more
            # replica, least loaded first; a partly taken tier of equal load goes to topology
            level = -1
            for g in range(n):
                if nfree[g] and (level < 0 or taken[g] < level):
                    level = taken[g]
            n_group = 0
            for g in range(n):  # ascending index, then stable insertion by load
                if nfree[g] and taken[g] == level:
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
                    picks = 0
                    for i in range(start_t, start_t + t):
                        picks |= (<uint64_t>1) << group[i]
                else:
                    in_req = self._in_request(taken)
                    tier_mask = 0
                    for i in range(start_t, end_t):
                        tier_mask |= (<uint64_t>1) << group[i]
                    picks = self._best_mask(
                        in_req | tier_mask, in_req, __builtin_popcountll(in_req) + <int>need
                    ) & ~in_req
                need -= __builtin_popcountll(picks)
                while picks:
                    g = __builtin_ctzll(picks)
                    picks &= picks - 1
                    nfree[g] -= 1
                    taken[g] += 1
                    counts[g] += 1
                start_t = end_t
        while need > 0:  # packed: key (not in the request, -(load + taken)), smallest first
            best0 = 2
            best1 = 0
            tier_mask = 0
            for g in range(n):
                if not nfree[g]:
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
                in_req = self._in_request(taken)
                g = __builtin_ctzll(self._best_mask(
                    in_req | tier_mask, in_req, __builtin_popcountll(in_req) + 1) & ~in_req)
            c = need if need < nfree[g] else nfree[g]
            nfree[g] -= c
            taken[g] += c
            counts[g] += c
            need -= c
        return 0
