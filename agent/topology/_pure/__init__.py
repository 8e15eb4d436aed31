"""Pure-Python twin of the ``agent._topo`` extension: the readable reference.

Every public name here has the same arguments, results and errors as its Cython counterpart
in ``ext/_topo.pyx``; tests run both and compare (``tests/test_engine_parity.py``). This is
the kernel only: plain ints and bitmasks in, plain ints and bitmasks out. Device IDs, request
validation and the mapping between the two live at the edge (``agent.topology.deviceids``).

One module per job: ``checks`` (limits and the argument checks every entry point runs),
``graph`` (NVLink islands and cliques), ``solver`` (the allocation objective, exact and
bounded) and ``replicas`` (the time-sliced replica policy the solver applies).
"""

from agent.topology._pure.checks import COUNT_MAX, EXACT_MAX_GPUS, MAX_GPUS, SCORE_MAX, mask_indices
from agent.topology._pure.graph import maximal_cliques, nvlink_islands
from agent.topology._pure.solver import AllocationSolver

__all__ = [
    "COUNT_MAX",
    "EXACT_MAX_GPUS",
    "MAX_GPUS",
    "SCORE_MAX",
    "AllocationSolver",
    "mask_indices",
    "maximal_cliques",
    "nvlink_islands",
]
