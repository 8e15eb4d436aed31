"""The mode's servers: the small interface the daemon runs them through, and the factory
that picks them by ``config.mode``.

Device-plugin mode serves :class:`agent.deviceplugin.manager.DevicePluginManager`, DRA mode
:class:`agent.dra.servers.DraServers`; both have the five calls of :class:`Servers`, so the
daemon runs "the servers" without knowing which (mypy checks both against it here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from agent.config import Config
from agent.deviceplugin.manager import DevicePluginManager
from agent.health import HealthState
from agent.metrics.self_metrics import AgentMetrics
from agent.topology.model import Topology

if TYPE_CHECKING:  # a device-plugin node never loads the DRA side
    from agent.dra.mig_lifecycle import MigOperations


class Servers(Protocol):
    """The kubelet-facing servers of one mode, as the daemon runs them."""

    def start(self) -> None:
        """Serve (registration may go on in the background). AgentError when a socket
        cannot be bound, ConfigError when the topology cannot be served as configured."""
        ...

    def ready(self) -> bool:
        """The kubelet can use us now. Never waits on I/O (the readiness probe calls it)."""
        ...

    def live(self) -> bool:
        """False when the servers cannot serve and will not recover by themselves (a socket
        that could not be served for a while): the pod should be restarted. Never waits on I/O
        (the liveness probe calls it)."""
        ...

    def set_topology(self, topology: Topology, config: Config) -> None:
        """Serve (topology, config) from now on; on an AgentError the running ones stay."""
        ...

    def stop(self, grace_s: float = 1.0) -> None:
        """Close streams, stop serving, remove our sockets."""
        ...


#: (topology, config, health, on_kubelet_restart) -> the mode's servers (not yet started);
#: they call ``on_kubelet_restart`` (from their own thread) when the kubelet restarted.
ServersFactory = Callable[[Topology, Config, HealthState, Callable[[], None]], Servers]


def servers_for(mode: str, agent_metrics: AgentMetrics, mig: MigOperations | None = None) -> ServersFactory:
    """The real servers of ``mode``, reporting to ``agent_metrics``: the device plugins (the
    devices they offer the kubelet included), or DRA (its dynamic MIG devices cut through
    ``mig``, the hardware backend's MigControl)."""
    if mode == "dra":
        # imported here: a device-plugin node never loads the DRA stubs and clients
        from agent.dra.servers import DraServers

        def dra(
            topology: Topology, config: Config, health: HealthState, on_kubelet_restart: Callable[[], None]
        ) -> DraServers:
            return DraServers.from_config(topology, config, health, on_kubelet_restart, events=agent_metrics, mig=mig)

        return dra

    def device_plugins(
        topology: Topology, config: Config, health: HealthState, on_kubelet_restart: Callable[[], None]
    ) -> DevicePluginManager:
        return DevicePluginManager(
            topology, config, health, events=agent_metrics, on_kubelet_restart=on_kubelet_restart
        )

    return device_plugins
