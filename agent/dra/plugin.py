"""The kubelet-facing DRA plugin: registration, the DRA service, and the socket watch.

- ``<plugins_registry_dir>/<driver>-reg.sock`` serves ``pluginregistration.Registration``
  (:class:`agent.kubelet.registration.WatcherRegistrationServicer`): the kubelet's plugin
  watcher finds the socket, calls ``GetInfo`` (type ``DRAPlugin``, the driver name, the DRA
  endpoint, the services served) and reports the outcome with
  ``NotifyRegistrationStatus``; a refusal is logged with the kubelet's reason and we keep
  serving (the kubelet tries again when it restarts or the socket is re-created).
- ``<plugins_dir>/<driver>/dra.sock`` serves ``DRAPlugin`` in both API versions,
  ``k8s.io.kubelet.pkg.apis.dra.v1`` and ``...v1beta1``, through thin servicers over one
  :class:`ClaimPreparer`, and the device-health stream ``DRAResourceHealth`` in ``v1alpha1``
  and ``v1beta1`` (:mod:`agent.dra.health_stream`); the registration lists all four.
- A :class:`agent.kubelet.plugin_socket.SocketKeeper` (the device plugin's too) serves
  either socket again when it vanishes (a kubelet restart can clear its directories; the
  watcher then registers us again from the new socket), never over another live server,
  with backoff and one log line per outage. Only its thread starts and stops the servers
  once started; the lock guards the registration flag and is never held across I/O
  (serving, stopping, logging), so :meth:`DraPlugin.ready` (the readiness probe) never
  waits for a socket being created again.

Nothing here calls NVML: answers come from the frozen topology and the health state.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Protocol

import grpc

from agent._proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from agent.config import Config
from agent.dra.cdi import remove_stale_spec_temps
from agent.dra.checkpoint import Checkpoint
from agent.dra.claims import ClaimReader
from agent.dra.health_stream import HEALTH_SERVICES, HealthStreams, HealthWatch
from agent.dra.mig_lifecycle import MigOperations
from agent.dra.placement import PlacementRanker
from agent.dra.prepare import ClaimPreparer, ClaimRef, HealthView
from agent.dra.view import DraView
from agent.errors import AgentError, shorten
from agent.kubelet.plugin_socket import Served, SocketKeeper
from agent.kubelet.registration import WatcherRegistrationServicer, add_watcher_registration
from agent.kubelet.unix_server import UnixGrpcServer
from agent.retry import Outage

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
#: The service names the kubelet looks for in ``supported_versions`` (DRAPluginService in
#: k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1}/types.go), newest first.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CHECKPOINT_DIR = "claims"


# ---------------------------------------------------------------------- servicers
class _DraServicer:
    """Translates one API version's messages to :class:`ClaimPreparer` calls and back."""

    pb: Any = None

    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        out = self.pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            result = self.preparer.prepare(ClaimRef(claim.namespace, claim.uid, claim.name))
            entry = out.claims[claim.uid]
            if result.error:
                entry.error = result.error
                if not result.logged:
                    log.warning("NodePrepareResources: %s", result.error)
                continue
            for d in result.devices:
                entry.devices.add(
                    request_names=[d.request] if d.request else [],
                    pool_name=d.pool, device_name=d.device, cdi_device_ids=list(d.cdi_ids),
                )
        return out

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        out = self.pb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            error = self.preparer.unprepare(ClaimRef(claim.namespace, claim.uid, claim.name))
            entry = out.claims[claim.uid]
            if error:
                entry.error = error
                log.warning("NodeUnprepareResources: %s", error)
        return out


class DraV1Servicer(_DraServicer, dra_v1_pb2_grpc.DRAPluginServicer):
    """``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/*``."""

    pb = dra_v1_pb2


class DraV1beta1Servicer(_DraServicer, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    """``/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/*``."""

    pb = dra_v1beta1_pb2


class PluginHealth(HealthView, HealthWatch, Protocol):
    """What the plugin reads of :class:`agent.health.HealthState`: whether a GPU is healthy
    (prepare), and its changes (the health stream)."""


# ---------------------------------------------------------------------- the plugin
class DraPlugin:
    """The DRA kubelet plugin of one node: serves, registers, keeps its sockets.

    ``health`` is the :class:`agent.health.HealthState` (read, and waited on by the health
    streams),
    ``claim_reader`` a :class:`agent.dra.claims.ClaimReader` (production:
    ``KubernetesClaimReader(agent.kube.api_client(config))``). The pool served is ``node_name``
    (default ``config.node_name``), as the slice publisher names it. The checkpoint lives
    in ``<plugins_dir>/<driver>/claims/`` (one file per prepared claim).

    ``start()`` raises AgentError when a socket cannot be bound; ``ready()`` is true once
    both sockets serve and the kubelet has confirmed the registration.
    ``on_kubelet_restart`` is called (on the watch thread, no lock held) after the
    registration socket was found gone and served again: the kubelet restarted, and the
    daemon reads the topology again. ``on_placement`` is told the placement of each claim
    prepared anew (:mod:`agent.dra.placement`: ``device_plugin_choice``, ``other`` or
    ``unranked``; on the ranking thread, after the prepare answered, no lock held).
    ``mig`` cuts the MIG instances of dynamic MIG devices (the backend's MigControl; None:
    none can be cut); what a crash interrupted is settled at :meth:`start`.
    """

    def __init__(
        self,
        config: Config,
        view: DraView,
        health: PluginHealth,
        claim_reader: ClaimReader,
        *,
        on_kubelet_restart: Callable[[], None] | None = None,
        on_placement: Callable[[str], None] | None = None,
        node_name: str | None = None,
        mig: MigOperations | None = None,
        poll_s: float = 0.5,
        max_workers: int = 8,
    ) -> None:
        self.config = config
        self.node_name = node_name if node_name is not None else config.node_name
        if not self.node_name:
            raise AgentError("DRA mode needs the node name (--node-name or NODE_NAME): it names the device pool")
        self.driver_name = config.driver_name
        self.registration_socket = os.path.join(config.plugins_registry_dir, f"{self.driver_name}-reg.sock")
        self.plugin_dir = os.path.join(config.plugins_dir, self.driver_name)
        self.endpoint = os.path.join(self.plugin_dir, "dra.sock")
        # No fsync: the checkpoint must survive an agent restart, which the page cache does.
        # After a power loss the CDI specs (tmpfs) are gone and the kubelet prepares again; a
        # torn file fails its checksum and the claim is recomputed from the API server. An
        # fsync per prepare would cost 5-40 ms on a busy disk, the whole latency budget.
        self.checkpoint = Checkpoint(os.path.join(self.plugin_dir, CHECKPOINT_DIR), fsync=False)
        self.placements = PlacementRanker(on_placement)
        self.preparer = ClaimPreparer(
            view, config, health, claim_reader, self.checkpoint,
            node_name=self.node_name, on_prepared=self.placements.submit, mig=mig,
        )
        self.poll_s = poll_s
        self._v1 = DraV1Servicer(self.preparer)
        self._v1beta1 = DraV1beta1Servicer(self.preparer)
        self.health_streams = HealthStreams(health, self._served_devices, self.node_name)
        self._on_kubelet_restart = on_kubelet_restart
        self._dra_server, self._reg_server, self._keeper = self._sockets(max_workers)
        # Lock order: ``_lock`` is a leaf guarding ``_registered`` (written by the gRPC worker
        # of NotifyRegistrationStatus and by the keeper's thread), held only to read or
        # assign it, never across I/O. ``_refusal_lock`` serialises the refusals' log lines
        # (NotifyRegistrationStatus only); nothing else waits on it.
        self._lock = threading.Lock()
        self._registered = False
        self._refusal_lock = threading.Lock()
        self._refused = Outage(
            log, f"registering DRA driver {self.driver_name}", level=logging.ERROR, recovered_level=None,
            per_reason=True,
            retrying="still serving; the kubelet retries when it restarts or the registration socket is re-created",
        )

    def _sockets(self, max_workers: int) -> tuple[UnixGrpcServer, UnixGrpcServer, SocketKeeper]:
        """The DRA service's server, the registration's, and the keeper serving both again
        when they vanish (none started)."""
        self._registration = WatcherRegistrationServicer(
            PLUGIN_TYPE, self.driver_name, self.endpoint, SUPPORTED_VERSIONS + HEALTH_SERVICES,
            self._registration_status,
        )
        dra = UnixGrpcServer(self.endpoint, self._add_dra, name="dra", max_workers=max_workers)
        reg = UnixGrpcServer(self.registration_socket, self._add_registration, name="dra-reg", max_workers=2)
        keeper = SocketKeeper(
            log, "DRA socket watch", thread_name="dra-socket-watch", poll_s=self.poll_s,
            on_vanished=self._vanished, on_served=self._served,
        )
        keeper.keep([dra, reg], ["the DRA service", "the DRA registration"])
        return dra, reg, keeper

    def _add_dra(self, server: grpc.Server) -> None:
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(self._v1, server)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(self._v1beta1, server)
        self.health_streams.add_to(server)

    def _add_registration(self, server: grpc.Server) -> None:
        add_watcher_registration(self._registration, server)

    # ------------------------------------------------------------------ lifecycle
    def _served_devices(self) -> dict[str, Any]:
        """The devices the health stream reports: the single GPUs and MIG devices, and the
        GPU sets and dynamic MIG devices prepared claims of this node hold (which are
        published follows the occupancy; a pod's device is what the kubelet asks about)."""
        refs = self.preparer.devices
        out = dict(refs)
        for pool, name in sorted(self.checkpoint.devices()):
            if pool == self.node_name and name not in out and name in refs:
                out[name] = refs[name]
        topology = self.preparer.view.topology
        for claim in self.checkpoint:
            for name, ref in self.preparer.mig.cut_devices(claim, topology).items():
                out.setdefault(name, ref)
        return out

    def start(self) -> None:
        """Settle what a crash interrupted (dynamic MIG), serve the DRA service, then the
        registration socket (the kubelet may dial the endpoint as soon as it sees the
        registration socket), then watch both."""
        os.makedirs(self.config.cdi_dir, exist_ok=True)
        removed = remove_stale_spec_temps(self.config.cdi_dir, self.driver_name)
        if removed:
            log.info("CDI directory %s: removed %d temp file(s) of interrupted writes", self.config.cdi_dir, removed)
        self.preparer.recover()
        self._dra_server.start()
        try:
            self._reg_server.start()
        except AgentError:
            self._dra_server.stop(0)
            raise
        log.info(
            "DRA plugin %s: serving %s, registration on %s (%d prepared claims checkpointed)",
            self.driver_name, self.endpoint, self.registration_socket, len(self.checkpoint),
        )
        self.placements.start()  # claims prepared before it starts wait for it
        self.preparer.resume()
        self._keeper.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop watching, stop registration first (the kubelet stops sending us claims),
        then the DRA service; remove our sockets. Prepared claims stay checkpointed."""
        self._keeper.stop(self.poll_s + 2.0)
        with self._lock:
            self._registered = False
        self._reg_server.stop(grace_s)
        self.health_streams.close()
        self._dra_server.stop(grace_s)
        self.placements.stop(grace_s)
        self.preparer.close()

    def ready(self) -> bool:
        """Both sockets serve and the kubelet has confirmed our registration."""
        with self._lock:
            registered = self._registered
        return registered and self._dra_server.socket_present() and self._reg_server.socket_present()

    def live(self) -> bool:
        """False once a socket could not be served for
        :data:`agent.kubelet.plugin_socket.UNSERVED_LIMIT_S` (the keeper's liveness)."""
        return self._keeper.serving()

    def set_topology(self, view: DraView, config: Config) -> None:
        """Prepare new claims from ``view`` (of the topology the daemon read again) and
        ``config`` (its DRA settings unchanged); sockets, the registration and the prepared
        claims stay as they are."""
        self.preparer.set_topology(view, config)

    # ------------------------------------------------------------------ internals
    def _registration_status(self, registered: bool, error: str) -> None:
        with self._lock:
            self._registered = registered
        with self._refusal_lock:  # said once per reason
            if not registered:
                self._refused.failed(f"the kubelet refused it: {shorten(error, 400) if error else 'no reason given'}")
                return
            self._refused.recovered()
        log.info("kubelet registered DRA driver %s (endpoint %s)", self.driver_name, self.endpoint)

    def _vanished(self, server: Served) -> None:
        if server is self._reg_server:
            # before serving again: the kubelet's registration of the new socket, which may
            # come at once, must not be overwritten
            with self._lock:
                self._registered = False

    def _served(self, server: Served) -> None:
        if server is self._reg_server and self._on_kubelet_restart is not None:
            self._on_kubelet_restart()  # the kubelet cleared its registry: it restarted
