"""The DRA mode's servers as the daemon runs them: the kubelet plugin and the ResourceSlice
publisher behind the same five calls as the device-plugin mode's manager (start, ready,
live, set_topology, stop), so the daemon runs "the servers" without knowing which.

No device-plugin socket is served in this mode: a GPU is never handed out by both. The
publisher follows health through its own subscription and the prepared claims through the
plugin's checkpoint: the order and the GPU sets follow the occupancy
(:mod:`agent.dra.gpusets`), re-published after each prepare and unprepare.
"""

from __future__ import annotations

from typing import Callable, Protocol

from agent.config import Config
from agent.dra.claims import KubernetesClaimReader
from agent.dra.mig_lifecycle import MigOperations
from agent.dra.plugin import DraPlugin
from agent.dra.publish_settings import PublisherEvents, PublishSettings
from agent.dra.publisher import SlicePublisher
from agent.dra.view import DraView
from agent.health import HealthState
from agent.kube import api_client
from agent.topology.model import Topology

#: Seconds the publisher may take to stop (one last delete of the slices when configured).
PUBLISHER_STOP_S = 3.0


class DraEvents(PublisherEvents, Protocol):
    """What DRA mode reports (the agent's self-metrics,
    :class:`agent.metrics.self_metrics.AgentMetrics`): the publisher's events and the claims
    that could not be read. Cheap, no I/O."""

    def claim_read_error(self) -> None:
        """A ResourceClaim could not be read from the API server (its prepare fails)."""
        ...

    def dra_claim_placement(self, placement: str) -> None:
        """A claim was prepared anew, placed as ``placement`` says
        (:mod:`agent.dra.placement`)."""
        ...


class DraServers:
    """``plugin`` and ``publisher`` (not yet started), served from ``config``."""

    def __init__(self, plugin: DraPlugin, publisher: SlicePublisher) -> None:
        self.plugin = plugin
        self.publisher = publisher

    @classmethod
    def from_config(
        cls,
        topology: Topology,
        config: Config,
        health: HealthState,
        on_kubelet_restart: Callable[[], None],
        *,
        events: DraEvents,
        mig: MigOperations | None = None,
    ) -> DraServers:
        """The real ones: ResourceClaims read and slices published with the client
        :func:`agent.kube.api_client` builds (``config.kubeconfig``, or the in-cluster
        configuration); ConfigError when neither can be loaded. Each claim that could not be
        read, each claim's placement, and which DRA features the API server keeps, are
        reported to ``events`` (the agent's self-metrics); the publisher keeps the devices of
        prepared claims while the API server keeps no taints. Both serve one
        :class:`agent.dra.view.DraView` of ``topology``. ``mig`` (the backend's MigControl)
        cuts the MIG instances of dynamic MIG devices."""
        view = DraView(topology, config.dynamic_mig == "on")
        plugin = DraPlugin(
            config, view, health, KubernetesClaimReader(api_client(config), count_error=events.claim_read_error),
            on_kubelet_restart=on_kubelet_restart, on_placement=events.dra_claim_placement, mig=mig,
        )
        publisher = SlicePublisher(lambda: api_client(config), view, PublishSettings.from_config(config),
                                   health=health, prepared=plugin.checkpoint, events=events)
        return cls(plugin, publisher)

    def start(self) -> None:
        """Serve the kubelet plugin (AgentError when a socket cannot be bound), then start
        publishing (in the background)."""
        self.plugin.start()
        self.publisher.start()

    def ready(self) -> bool:
        """The kubelet registered the plugin and the scheduler can see our devices."""
        return self.plugin.ready() and self.publisher.ready()

    def live(self) -> bool:
        """The plugin's sockets are served (or failed to be for less than the keeper's limit)."""
        return self.plugin.live()

    def set_topology(self, topology: Topology, config: Config) -> None:
        """Prepare new claims from (topology, config) and publish the topology; the sockets,
        the registration and the prepared claims stay. The DRA settings apply at start only:
        the daemon hands over a ``config`` that keeps them
        (:func:`agent.config.keep_start_settings`). Both get one new
        :class:`agent.dra.view.DraView` of ``topology``."""
        view = DraView(topology, config.dynamic_mig == "on")
        self.plugin.set_topology(view, config)
        self.publisher.update(view=view)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop the plugin (sockets removed, claims kept checkpointed), then the publisher
        (slices kept unless ``deleteSlicesOnShutdown``), even if the first fails."""
        try:
            self.plugin.stop(grace_s)
        finally:
            self.publisher.stop(PUBLISHER_STOP_S)

