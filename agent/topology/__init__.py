"""Frozen topology model and the engine that derives facts from it."""

from agent.topology.model import Gpu, Link, MigDevice, Nic, PcieLevel, Topology, pair_score

__all__ = ["Gpu", "Link", "MigDevice", "Nic", "PcieLevel", "Topology", "pair_score"]
