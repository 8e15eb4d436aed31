"""Machines with MIG geometry for the dynamic MIG tests and ``bench/quality_mig.py``: a
built-in machine whose MIG-capable GPUs carry the simulator's geometry
(:func:`agent.hw.sim.mig_geometry.geometry_for`), as discovery gives it."""

from __future__ import annotations

import dataclasses

from agent.discovery import load_topology
from agent.hw.sim.mig_geometry import geometry_for
from agent.topology.model import Topology


def mig_topology(machine: str) -> Topology:
    """``machine`` (a built-in name or spec file) with every GPU's MIG geometry where the
    simulator knows it (kept where discovery already gave one)."""
    topology = load_topology(machine)
    gpus = tuple(g if g.mig_geometry is not None else dataclasses.replace(g, mig_geometry=geometry_for(g.name))
                 for g in topology.gpus)
    return Topology.from_facts(dataclasses.replace(topology.facts, gpus=gpus))
