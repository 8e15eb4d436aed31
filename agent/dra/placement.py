"""How a prepared claim was placed, against the device plugin's choice: what a cluster can
read of the placement that ``bench/quality_dra.py`` models.

The scheduler allocates from the pool as the agent last published it, ordered so that the
first free device of each kind is the device plugin's choice on the GPUs free then
(:mod:`agent.dra.gpusets`). A claim allocated before the agent heard of the claims allocated
before it (the kubelet prepares after the pod is bound) finds what they left, and may get
other GPUs. At NodePrepareResources the agent compares the claim's whole GPUs with the device
plugin's choice for that many GPUs (what ``GetPreferredAllocation`` and ``gpu-topology-agent
allocate --available`` give) on the GPUs free then: whole, healthy, held by no other prepared
claim, the claim's own included. ``device_plugin_choice``: the same GPUs; ``other``: not (the
claim was allocated from an older publication, or single GPUs only are published and the
first free ones were not that choice, or a claim allocated before it is prepared after it, or
one ended between its allocation and its prepare);
``unranked``: a claim holding a MIG device, or a GPU the policy does not offer, or one whose
ranking failed.

The ranking runs the allocation engine, so it is off the prepare path: NodePrepareResources
records what it needs (:class:`Prepared`: the GPUs free then) and answers; a
:class:`PlacementRanker` thread ranks it after, logs one line (``placed ResourceClaim
<ns>/<name> (uid ...): ...``, after the ``prepared ...`` line) and tells ``on_placement``
(``gpu_agent_dra_claim_placements_total{placement}``). A ranking that fails or is slow never
fails nor delays a prepare.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection

from agent.dra.gpusets import SetPolicy
from agent.errors import AgentError
from agent.worker import Worker

log = logging.getLogger(__name__)

DEVICE_PLUGIN_CHOICE = "device_plugin_choice"
OTHER = "other"
UNRANKED = "unranked"
#: every value of ``gpu_agent_dra_claim_placements_total{placement}``
PLACEMENTS = (DEVICE_PLUGIN_CHOICE, OTHER, UNRANKED)

#: The most prepared claims waiting to be ranked; one more is counted unranked at once.
MAX_PENDING = 1000

__all__ = ["DEVICE_PLUGIN_CHOICE", "MAX_PENDING", "OTHER", "PLACEMENTS", "UNRANKED", "Placement", "PlacementRanker",
           "Prepared", "rank"]


@dataclass(frozen=True)
class Placement:
    """``kind`` (one of :data:`PLACEMENTS`), the claim's whole GPUs and the device plugin's
    choice for that many on the GPUs free when it was prepared (both empty when unranked)."""

    kind: str
    gpus: tuple[int, ...] = ()
    choice: tuple[int, ...] = ()

    def describe(self) -> str:
        """Half a log line: how the claim's GPUs compare with the device plugin's choice."""
        if self.kind == DEVICE_PLUGIN_CHOICE:
            return f"the device plugin's choice for {len(self.gpus)} GPU(s) on the GPUs free"
        if self.kind == OTHER:
            return (f"GPUs {_indices(self.gpus)}, where the device plugin would have given GPUs "
                    f"{_indices(self.choice)} on the GPUs free (allocated from an older publication?)")
        return "not ranked (a MIG device, or a GPU the device plugin does not offer)"


def rank(policy: SetPolicy, gpus: Collection[int], whole: bool, held: Collection[int],
         unhealthy: Collection[int]) -> Placement:
    """The placement of a claim holding ``gpus`` (indices; ``whole``: no MIG device among
    what it holds) while other prepared claims hold ``held`` and ``unhealthy`` are unhealthy."""
    mine = tuple(sorted(set(gpus)))
    if not whole or not mine:
        return Placement(UNRANKED)
    free = policy.free_gpus(set(held) - set(mine), unhealthy)
    if not set(mine) <= set(free):
        return Placement(UNRANKED)
    choice = policy.choose(free, len(mine))
    return Placement(DEVICE_PLUGIN_CHOICE if choice == mine else OTHER, mine, choice)


def _indices(gpus: tuple[int, ...]) -> str:
    return ", ".join(map(str, gpus))


@dataclass(frozen=True)
class Prepared:
    """A claim prepared anew, as ranking it needs it, recorded at its prepare: ``claim`` (as
    the log names it), the policy of the topology it was prepared on, the GPUs of its devices
    (``whole``: no MIG device among them), the GPUs other prepared claims held then and the
    unhealthy ones."""

    claim: str
    policy: SetPolicy
    gpus: tuple[int, ...]
    whole: bool
    held: frozenset[int]
    unhealthy: frozenset[int]


class PlacementRanker(Worker):
    """Ranks the claims :meth:`submit` hands it, in order, on its own thread: one log line
    each and ``on_placement(kind)``. A ranking that raises leaves the claim ``unranked``
    (said in the log) and the thread running; claims still waiting at :meth:`stop` are
    dropped uncounted."""

    thread_name = "dra-placement"

    def __init__(self, on_placement: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.on_placement = on_placement
        self._pending: deque[Prepared] = deque()
        self._cond = threading.Condition()

    def submit(self, prepared: Prepared) -> None:
        """Rank ``prepared`` later (returns at once); beyond :data:`MAX_PENDING` waiting, it is
        counted unranked now."""
        with self._cond:
            full = len(self._pending) >= MAX_PENDING
            if not full:
                self._pending.append(prepared)
                self._cond.notify()
        if full:
            log.warning("placed %s: not ranked (%d claims already wait to be ranked)", prepared.claim, MAX_PENDING)
            self._tell(UNRANKED)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:  # set under the lock the loop waits with: no wake-up is lost
            self._stop.set()
            self._cond.notify_all()
        super().stop(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stop.is_set())
                if self._stop.is_set():
                    return
                prepared = self._pending.popleft()
            self._tell(self._rank(prepared).kind)

    @staticmethod
    def _rank(p: Prepared) -> Placement:
        try:
            placement = rank(p.policy, p.gpus, p.whole, p.held, p.unhealthy)
        except (AgentError, ValueError) as exc:
            log.warning("placed %s: not ranked, the ranking failed: %s", p.claim, exc)
            return Placement(UNRANKED)
        except Exception as exc:  # a bug must not stop the ranking of the claims after it
            log.error("placed %s: not ranked, the ranking failed: %s: %s", p.claim, type(exc).__name__, exc,
                      exc_info=True)
            return Placement(UNRANKED)
        log.info("placed %s: %s", p.claim, placement.describe())
        return placement

    def _tell(self, kind: str) -> None:
        if self.on_placement is not None:
            self.on_placement(kind)
