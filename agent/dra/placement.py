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
``unranked``: a claim holding a MIG device, or a GPU the policy does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from agent.dra.gpusets import SetPolicy

DEVICE_PLUGIN_CHOICE = "device_plugin_choice"
OTHER = "other"
UNRANKED = "unranked"
#: every value of ``gpu_agent_dra_claim_placements_total{placement}``
PLACEMENTS = (DEVICE_PLUGIN_CHOICE, OTHER, UNRANKED)

__all__ = ["DEVICE_PLUGIN_CHOICE", "OTHER", "PLACEMENTS", "UNRANKED", "Placement", "rank"]


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
