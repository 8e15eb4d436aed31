"""Sharing a GPU between containers: the interface (:mod:`agent.sharing.base`) and the
configured instance, time-slicing (:mod:`agent.sharing.timeslicing`) or MPS
(:mod:`agent.sharing.mps`)."""

from __future__ import annotations

from agent.config import Config
from agent.sharing.base import Sharing
from agent.sharing.mps import MPS
from agent.sharing.timeslicing import TIME_SLICING


def sharing_for(config: Config) -> Sharing:
    """The configured sharing: MPS under ``sharing.mps``, else time-slicing (which shares
    nothing while ``sharing.timeSlicing`` is empty)."""
    return MPS if config.mps else TIME_SLICING


def strategy_label(config: Config) -> str:
    """GFD's ``gpu.sharing-strategy``: the configured sharing's name (``time-slicing``,
    ``mps``) when a resource is shared into more than one replica, else ``none``."""
    sharing = sharing_for(config)
    return sharing.strategy if any(r.replicas > 1 for r in sharing.entries(config)) else "none"
