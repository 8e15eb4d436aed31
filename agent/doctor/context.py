"""What the checks share: the settings the agent would run with, and the node as read once
(NVML and sysfs, or a simulated machine), the resources the agent would serve, the
API-server client and the DRA versions it serves, each opened on first use by whichever
check needs it first and kept for the others (thread-safe: the checks run at once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from agent.config import Config
from agent.errors import AgentError

if TYPE_CHECKING:  # pragma: no cover
    from agent.deviceplugin.resources import PluginResource
    from agent.hw.nvml.backend import NvmlBackend
    from agent.hw.sim.machines import SimulatedMachine
    from agent.topology.model import Topology

__all__ = ["API_TIMEOUT_S", "DoctorContext", "NodeRead", "Unavailable"]

#: How long each API-server request of a check waits at most (s).
API_TIMEOUT_S = 3.0

_T = TypeVar("_T")


class Unavailable(AgentError):
    """What a check needs could not be had (NVML did not load, no API-server access); the
    message says why. A check depending on it reports it as a WARN naming the check that
    FAILs for it."""


class _Once(Generic[_T]):
    """A value made on first use, once, by the first caller (the others wait); an
    exception is kept and raised again to every caller."""

    def __init__(self, make: Callable[[], _T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._done = False
        self._value: _T | None = None
        self._error: BaseException | None = None

    def get(self) -> _T:
        with self._lock:
            if not self._done:
                try:
                    self._value = self._make()
                except Exception as exc:
                    self._error = exc
                self._done = True
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def made(self) -> _T | None:
        """The value if it was made, without making it."""
        with self._lock:
            return self._value if self._done else None


@dataclass(frozen=True)
class NodeRead:
    """The node as read once: the initialised backend and the topology built from it."""

    backend: NvmlBackend
    topology: Topology
    sim: SimulatedMachine | None


class DoctorContext:
    """The settings (``config``; ``config_error`` when the configuration file did not load
    and ``config`` holds the rest), the ``--simulate`` machine, the environment, where the
    kubelet's configuration file is, and the lazily read node and API client."""

    def __init__(self, config: Config, *, simulate: str | None, env: Mapping[str, str],
                 kubelet_config: str, config_error: str | None = None,
                 xid_watch_s: float = 1.0) -> None:
        self.config = config
        self.config_error = config_error
        self.simulate = simulate
        self.env = env
        self.kubelet_config = kubelet_config
        self.xid_watch_s = xid_watch_s
        self._node: _Once[NodeRead] = _Once(self._read_node)
        self._resources: _Once[tuple[PluginResource, ...]] = _Once(self._build_resources)
        self._api: _Once[Any] = _Once(self._api_client)
        self._resource_versions: _Once[list[str]] = _Once(self._discover_resource_versions)

    # ------------------------------------------------------------------ the node
    def node(self) -> NodeRead:
        """The node as read; :class:`Unavailable` when NVML (or the simulated machine) did
        not open, with the reason."""
        return self._node.get()

    def _read_node(self) -> NodeRead:
        from agent.discovery import open_backend, read_topology

        try:
            backend, sim = open_backend(self.simulate, self.config.sysfs_root)
        except AgentError as exc:
            raise Unavailable(str(exc)) from None
        try:
            backend.init()
        except AgentError as exc:
            if sim is not None:
                sim.close()
            raise Unavailable(str(exc)) from None
        try:
            return NodeRead(backend, read_topology(backend, sim), sim)
        except AgentError as exc:
            backend.shutdown()
            if sim is not None:
                sim.close()
            raise Unavailable(f"NVML loaded but the node could not be read: {exc}") from None

    @property
    def sysfs_root(self) -> str:
        """The sysfs tree the agent reads: the simulated machine's, or ``--sysfs-root``."""
        sim = self.node().sim
        return sim.sysfs_root if sim is not None else self.config.sysfs_root

    def resources(self) -> tuple[PluginResource, ...]:
        """The device-plugin resources the agent would serve on this node with this
        configuration; ConfigError as the agent would refuse them."""
        return self._resources.get()

    def _build_resources(self) -> tuple[PluginResource, ...]:
        from agent.deviceplugin.resources import build_resources

        return build_resources(self.node().topology, self.config)

    # ------------------------------------------------------------------ the API server
    @property
    def cluster_configured(self) -> bool:
        """Whether there is a way to the API server: ``--kubeconfig`` or an in-cluster
        service account (``KUBERNETES_SERVICE_HOST``)."""
        return bool(self.config.kubeconfig or self.env.get("KUBERNETES_SERVICE_HOST"))

    @property
    def cluster_needed(self) -> list[str]:
        """What the agent needs the API server for with these settings (empty: nothing)."""
        needs = []
        if self.config.mode == "dra":
            needs.append("DRA (ResourceSlices, ResourceClaims)")
        if self.config.labels_sink == "nodefeature":
            needs.append("the NodeFeature label sink")
        if self.config.config_file_srcdir:
            needs.append("per-node configs (the node's label)")
        if self.config.node_condition == "on":
            needs.append("the GPUHealthy Node condition")
        return needs

    def api(self) -> Any:
        """The API-server client the agent would build (:func:`agent.kube.api_client`);
        :class:`Unavailable` when none can be built."""
        return self._api.get()

    def _api_client(self) -> Any:
        from agent.kube import api_client

        if not self.cluster_configured:
            raise Unavailable("no --kubeconfig and no in-cluster service account (KUBERNETES_SERVICE_HOST unset)")
        try:
            return api_client(self.config)
        except AgentError as exc:
            raise Unavailable(str(exc)) from None

    def resource_versions(self) -> list[str]:
        """The ``resource.k8s.io`` versions the API server serves, discovered once as the
        agent discovers them (:func:`agent.kube.resource_versions`); :class:`Unavailable`
        when there is no client, :class:`agent.kube.ApiCallError` when it cannot be asked."""
        return self._resource_versions.get()

    def _discover_resource_versions(self) -> list[str]:
        from agent.kube import resource_versions

        return resource_versions(self.api(), API_TIMEOUT_S)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Release NVML, the simulated machine and the API client, where opened."""
        node = self._node.made()
        if node is not None:
            node.backend.shutdown()
            if node.sim is not None:
                node.sim.close()
        api = self._api.made()
        if api is not None:
            try:
                api.close()
            except Exception:  # closing a pool must not fail the report
                pass
