# cython: language_level=3
"""Compiled topology engine (``agent._topo``).

Works on plain arrays only: adjacency bitmasks (``adjacency[i]`` has bit j set when GPUs
i and j share an NVLink), never NVML handles or dataclasses. ``agent/topology/_pure.py``
is the readable twin; both must return identical results.
"""

from libc.stdint cimport uint64_t

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
