"""The node's DRA devices for one topology (:class:`DraView`): built once per topology by
:class:`agent.dra.servers.DraServers` and shared by the kubelet plugin (which devices a
claim's names stand for) and the slice publisher (which it publishes, in which order), so
both answer from the same devices and the same policy."""

from __future__ import annotations

from agent.dra.devices import DeviceRefs
from agent.dra.gpusets import SetPolicy
from agent.dra.migslots import dynamic_gpus
from agent.topology.model import Topology

__all__ = ["DraView"]


class DraView:
    """``topology``'s DRA devices by name (``devices``) and the device plugin's policy on its
    whole GPUs (``policy``, which orders the singles and chooses the sets). With
    ``dynamic_mig``, the GPUs offering dynamic MIG have no static MIG device. Immutable once
    built; thread-safe as its parts are."""

    def __init__(self, topology: Topology, dynamic_mig: bool = False) -> None:
        self.topology = topology
        self.devices = DeviceRefs(topology, dynamic_gpus(topology) if dynamic_mig else ())
        self.policy = SetPolicy(topology)
