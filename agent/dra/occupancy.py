"""What a rendering of the node's slices follows (:class:`Occupancy`): the devices prepared
claims hold and what the pool holds now; and what follows from it, the GPU sets to publish and
which published devices are being withdrawn (the rule: :mod:`agent.dra.withdrawal`; why:
:mod:`agent.dra.gpusets`). :func:`agent.dra.slices.render_slices` turns that into devices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

from agent.dra.devices import device_name
from agent.dra.gpusets import GpuSet, SetPolicy
from agent.dra.withdrawal import (
    held_through_sets,
    sets_to_keep,
    sets_to_withdraw,
    singles_to_withdraw,
)
from agent.topology.model import Topology

__all__ = ["NOTHING_HELD", "Occupancy"]


@dataclass(frozen=True)
class Occupancy:
    """What the publication follows: ``held``, every device a prepared claim of this node
    holds (name -> GPU indices); ``published``, the set devices in the pool now (names, as
    the API server has them; the rule of :func:`agent.dra.withdrawal.sets_to_keep` keeps them
    while a claim may hold them); ``expired``, of those, the ones whose withdrawal taint has
    been published for the grace period (:mod:`agent.dra.withdrawal`), or None for no grace:
    a published set that must go (:func:`agent.dra.withdrawal.sets_to_withdraw`) stays, tainted,
    until named here; with None (or where the API server keeps no taints) it goes at once.
    ``withdrawing``: the published sets carrying the withdrawal taint now; one stays tainted
    until it goes, even once its GPUs are free again, unless it is the policy's choice again or
    a prepared claim holds it (so what lagging claims find is what withdrawing at once leaves).
    ``singles``: the single devices in the pool now (names; None: not known, none withdrawn);
    with those and a grace, the single of a GPU held through a set is withdrawn the same way
    (:func:`agent.dra.withdrawal.singles_to_withdraw`)."""

    held: Mapping[str, Collection[int]] = field(default_factory=dict)
    published: Collection[str] = ()
    expired: Collection[str] | None = None
    withdrawing: Collection[str] = ()
    singles: Collection[str] | None = None

    @property
    def held_gpus(self) -> set[int]:
        return {g for gpus in self.held.values() for g in gpus}

    @property
    def via_sets(self) -> set[int]:
        """The GPUs prepared claims hold through a set device."""
        return held_through_sets(self.held)

    def sets(self, policy: SetPolicy, free: Collection[int], graced: bool) -> tuple[list[GpuSet], set[str]]:
        """The sets to publish, in order, and those of them being withdrawn (to carry the
        withdrawal taint): the policy's sets on ``free``, then those a claim may hold: the
        published ones the rule keeps and the ones prepared claims hold; then (``graced``: the
        server keeps taints) the published ones being withdrawn whose grace has not run out."""
        kept = sets_to_keep(self.published, self.held)
        held = [GpuSet(tuple(sorted(g))) for name, g in self.held.items() if name.startswith("gpuset-")]
        withdrawing: list[GpuSet] = []
        if graced and self.expired is not None:
            gone = set(self.expired) | {s.name for s in held}
            tainted = set(self.withdrawing)
            withdrawing = [s for s in [*sets_to_withdraw(self.published, self.held),
                                       *(k for k in kept if k.name in tainted)] if s.name not in gone]
            kept = [k for k in kept if k.name not in tainted]
        chosen = policy.sets(free)
        sets = policy.sets(free, [*kept, *held, *withdrawing], chosen)
        untainted = {s.name for s in chosen}  # the policy's choice again: an ordinary set
        return sets, {s.name for s in withdrawing} - untainted

    def single_withdrawals(self, topology: Topology) -> tuple[set[str], set[str]]:
        """The whole GPUs' single devices to publish tainted and those to leave out
        (:func:`agent.dra.withdrawal.singles_to_withdraw`); none without a grace or where the
        pool's singles are not known."""
        if self.expired is None or self.singles is None:
            return set(), set()
        whole = {g.index: device_name(g) for g in topology.gpus if not g.mig_enabled}
        return singles_to_withdraw(self.held, whole, self.singles, self.expired)


#: A node where no claim holds anything and nothing is published yet.
NOTHING_HELD = Occupancy()
