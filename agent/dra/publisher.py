"""The ResourceSlice publisher: keeps the node's pool in the API server equal to the topology,
its health (unhealthy GPUs tainted) and its occupancy, with the official ``kubernetes`` client.

One thread owns all API calls. At start it asks discovery once which ``resource.k8s.io``
versions are served (``v1`` preferred, else ``v1beta2``, else ``v1beta1``), decides once
whether to publish GPU sets (``dra.gpuSets``; ``auto`` asks ``/version``:
:func:`agent.dra.gpusets.gpu_sets_decision`, said in one log line and
``gpu_agent_dra_gpu_sets_mode``) and reads the Node's UID (for the owner reference; a Node it
may not read is published without one). Then it makes the pool match what
:func:`agent.dra.slices.render_slices` renders for the devices prepared claims hold (the
checkpoint) and the set devices the pool has now: create what is missing, update what
differs (a stale ``resourceVersion`` answered with 409 is re-read and retried), delete this
driver's other slices of the node. A health change, a prepared or an unprepared claim wakes
the thread at once (re-published well within a second).

**Generations.** The scheduler's allocator skips a pool with fewer slices of its newest
generation than ``resourceSliceCount`` (incomplete) or with a device name twice (invalid). A
re-publication that moves no device from one slice to another (up to 64 devices are one
device slice; above, the single GPUs and the sets have slices of their own) rewrites the
changed slices under the same pool generation: any view the scheduler can have holds each
slice once, each device at most once, and every device a claim may hold (the single GPUs
always, a set kept by the rule of :mod:`agent.dra.withdrawal` in both publications), so the
pool is never incomplete. Nor invalid: the counter slice, which declares only the counters
devices consume (:mod:`agent.dra.counters`), is first widened where the devices will consume
a counter it lacks, and narrowed after them (:mod:`agent.dra.pool_writes` plans the writes). The API reference asks
for a new generation on every change so that consumers never mix two versions of a pool;
mixing is harmless when no device moves, and a new generation would make the pool
incomplete from its first write to its last. Any other change raises the generation above
every generation seen, in every slice.

**Read-back.** Every write is answered with the object as stored; where the server dropped
fields of a feature (a gate off drops them without an error, :mod:`agent.dra.readback`), the
publisher stops writing at once, logs why (once per feature), reports it to ``events``
(``gpu_agent_dra_api_feature``) and publishes again without the feature: the single GPUs
only when the counters were dropped (GPU sets without their counters would let a set and
its members be allocated twice), and devices of unhealthy GPUs left out instead of tainted
when the taints were dropped, but those a prepared claim of this node uses (``prepared``),
which stay until the claim is unprepared. The counter slice is written first and a pool is
complete only once all its slices carry the new generation, so the scheduler never allocates
from set devices whose counters were dropped (unless a stored counter slice kept its counters
and only a newly created device slice lost them: then for one round trip).

The API server being unreachable, or refusing, never stops the agent: the thread retries with
a capped exponential backoff, logs each failure once per change of reason and the recovery once
(:class:`agent.retry.Outage`), and :meth:`ready` stays False until the slices have been
published once.

Size: above 400 lines because it is one thread and the only code that talks to the API server
about ResourceSlices: its loop, the sync decision and the handful of calls it makes with their
failure reasons belong together; the read-back comparison is :mod:`agent.dra.readback`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Collection, Mapping

from agent.dra.devices import gpus_of, parse_mig_slot_name, parse_set_name
from agent.dra.gpusets import gpu_sets_decision
from agent.dra.pool_writes import plan_writes
from agent.dra.publish_settings import (
    HealthSource,
    PreparedDevices,
    PublisherEvents,
    PublishSettings,
)
from agent.dra.readback import (
    DEVICE_TAINTS,
    PARTITIONABLE_DEVICES,
    dropped_features,
    keep_taint_times,
)
from agent.dra.slices import API_VERSIONS, SETS_API_VERSIONS, Occupancy, render_slices
from agent.dra.view import DraView
from agent.dra.withdrawal import expired, stamp_withdrawals, withdrawal_taint, withdrawal_times
from agent.errors import AgentError
from agent.kube import (
    RESOURCE_GROUP,
    ApiCallError,
    call,
    pick_version,
    resource_versions,
    server_version,
)
from agent.retry import Backoff, Outage
from agent.worker import Worker

log = logging.getLogger(__name__)

__all__ = ["SlicePublisher"]

#: Why publishing goes on without a feature, logged once when the server drops it.
_WITHOUT = {
    PARTITIONABLE_DEVICES: "the counters (sharedCounters, consumesCounters): the API server does not keep"
                           " partitionable devices (feature gate DRAPartitionableDevices off?); publishing the"
                           " single GPUs only, no GPU sets (restart the agent once the gate is on)",
    DEVICE_TAINTS: "the device taints: the API server does not keep them (feature gate DRADeviceTaints off?);"
                   " devices of unhealthy GPUs are left out instead, but those a prepared claim of this node"
                   " uses, which stay untainted until it is unprepared; GPU sets are withdrawn at once, without"
                   " the grace period",
}


_REQUEST_TIMEOUT_S = 10.0
_CONFLICT_RETRIES = 5


def _gpus(view: DraView, name: str) -> tuple[int, ...]:
    """The GPUs a prepared device holds: as the view resolves it, or a dynamic MIG device's
    GPU as its name says."""
    found = gpus_of(view.devices, name)
    slot = parse_mig_slot_name(name) if not found else None
    return found if slot is None else (slot[0],)


class _Failure(AgentError):
    """A failed step that is no API call (no client, no DRA API served), with a stable
    ``state`` for log-once, as :class:`agent.kube.ApiCallError` has."""

    def __init__(self, state: str, message: str) -> None:
        super().__init__(message)
        self.state = state


class SlicePublisher(Worker):
    """Publish the node's ResourceSlices and keep them current.

    ``client_factory()`` returns a ``kubernetes.client.ApiClient`` (called in the publisher's
    thread, again after a failure to build one; production: :func:`agent.kube.api_client`,
    which leaves retrying to the publisher's own loop). ``view`` is the node's devices and
    the policy ordering them (:class:`agent.dra.view.DraView`, the plugin's). ``settings`` says for which node
    and driver, and how to retry. ``health`` (an :class:`agent.health.HealthState`,
    optional) is subscribed to: its unhealthy GPUs and every set holding one get a taint with
    the settings' effect saying why, removed on recovery. Without it, call :meth:`update`.
    ``prepared`` (the plugin's checkpoint, optional) tells which devices stay while the
    server keeps no taints. ``events`` hears which features the API server keeps.
    """

    thread_name = "slice-publisher"

    def __init__(
        self,
        client_factory: Callable[[], Any],
        view: DraView,
        settings: PublishSettings,
        *,
        health: HealthSource | None = None,
        prepared: PreparedDevices | None = None,
        events: PublisherEvents | None = None,
    ) -> None:
        super().__init__()
        self.client_factory = client_factory
        self.settings = settings
        self.node_name = settings.node_name
        self.driver_name = settings.driver_name
        self._view = view
        self._unhealthy: dict[int, str] = {}
        self._health = health
        self._prepared = prepared
        self._events = events
        #: the features the API server keeps, as far as seen (a dropped one stays dropped)
        self.kept = {PARTITIONABLE_DEVICES: True, DEVICE_TAINTS: True}
        self._cond = threading.Condition()
        self._dirty = True
        self._ready = threading.Event()
        self._client: Any = None
        # each failure said once per reason (ApiCallError.state), the recovery once
        self._outage = Outage(log, f"publishing the ResourceSlices of node {self.node_name}", per_reason=True)
        # what the thread learnt (the thread's own state)
        self.api_version: str | None = None
        self.gpu_sets: bool | None = None  # decided at discovery
        self.node_uid: str | None = None
        self._node_read = False
        self.generation = 0  # the pool generation last published
        self._withdrawal_due = float("inf")  # wall time the next withdrawal grace runs out
        if health is not None:
            self._unhealthy = dict(health.snapshot())
            health.add_listener(self._on_health_change)
        if prepared is not None:
            prepared.add_listener(self._on_prepared_change)

    # ------------------------------------------------------------------ public API
    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (:meth:`start` starts it and returns at once; see :meth:`ready`);
        delete the slices if ``delete_on_stop`` (one try, errors logged)."""
        with self._cond:  # set under the lock the loop waits with: no wake-up is lost
            self._stop.set()
            self._cond.notify_all()
        super().stop(timeout_s)
        if self.settings.delete_on_stop and self.api_version is not None:
            try:
                self._delete_all()
            except (ApiCallError, _Failure) as exc:
                log.warning("could not delete the ResourceSlices of node %s on shutdown: %s", self.node_name, exc)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing a pool must not fail shutdown
                pass
            self._client = None

    def ready(self) -> bool:
        """True once the slices have been published (stays True through later API outages:
        what was published is still there for the scheduler)."""
        return self._ready.is_set()

    def update(self, view: DraView | None = None,
               unhealthy: Collection[int] | Mapping[int, str] | None = None) -> None:
        """Publish a new topology's ``view`` and/or the unhealthy GPUs (indices, or index ->
        reason) (returns at once)."""
        with self._cond:
            if view is not None:
                self._view = view
            if unhealthy is not None:
                self._unhealthy = (dict(unhealthy) if isinstance(unhealthy, Mapping)
                                   else {i: "unhealthy" for i in unhealthy})
            self._dirty = True
            self._cond.notify_all()

    def _desired(self, existing: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The slices as they would be published now, for generation :attr:`generation`,
        given the pool as the API server has it (``existing``: the set devices in it stay
        while a claim may hold them, :func:`agent.dra.withdrawal.sets_to_keep`)."""
        with self._cond:
            view, unhealthy = self._view, dict(self._unhealthy)
        prepared = ({device for pool, device in self._prepared.devices() if pool == self.node_name}
                    if self._prepared is not None else set())
        published = {d.get("name", "") for o in existing.values()
                     for d in (o.get("spec") or {}).get("devices") or () if isinstance(d, dict)}
        grace, now = self.settings.withdrawal_grace_s, time.time()
        times = withdrawal_times(existing.values(), self.driver_name, now)
        occupancy = Occupancy({name: _gpus(view, name) for name in sorted(prepared)},
                              sorted(n for n in published if parse_set_name(n) is not None),
                              expired(times, now, grace) if grace > 0 else None, sorted(times),
                              sorted(n for n in published if parse_set_name(n) is None))
        taints = self.kept[DEVICE_TAINTS]
        return render_slices(view.topology, node_name=self.node_name, driver=self.driver_name,
                             api_version=self.api_version or "v1",
                             generation=max(self.generation, 1), node_uid=self.node_uid,
                             unhealthy=unhealthy, occupancy=occupancy,
                             with_sets=bool(self.gpu_sets) and self.kept[PARTITIONABLE_DEVICES],
                             taint_effect=self.settings.taint_effect if taints else None,
                             keep=() if taints else prepared, policy=view.policy,
                             dynamic_mig=self.settings.dynamic_mig and self.kept[PARTITIONABLE_DEVICES],
                             mig_placements=self.settings.mig_placements)

    # ------------------------------------------------------------------ thread
    def _on_health_change(self) -> None:
        if self._health is not None:
            self.update(unhealthy=self._health.snapshot())

    def _on_prepared_change(self) -> None:
        self.update()  # the order and the sets follow what prepared claims hold

    def _run(self) -> None:
        backoff = Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s)
        next_resync = time.monotonic() + self.settings.resync_s
        while True:
            with self._cond:
                # a set's withdrawal grace running out wakes the thread too (wall clock: see
                # agent.dra.withdrawal)
                due = min(next_resync, time.monotonic() + self._withdrawal_due - time.time())
                while not self._stop.is_set() and not self._dirty and time.monotonic() < due:
                    self._cond.wait(max(0.0, due - time.monotonic()))
                if self._stop.is_set():
                    return
                self._dirty = False
            try:
                self._sync()
            except (ApiCallError, _Failure) as exc:
                self._outage.failed(str(exc), key=exc.state)
            except Exception as exc:  # a bug must not kill the thread: say it, back off, retry
                name = type(exc).__name__
                self._outage.failed(f"unexpected {name}: {exc}", key=f"unexpected {name}", level=logging.ERROR,
                                    exc_info=True)
            else:
                self._outage.recovered()
                backoff.reset()
                next_resync = time.monotonic() + self.settings.resync_s
                self._ready.set()
                continue
            with self._cond:
                self._dirty = True
                self._cond.wait_for(self._stop.is_set, timeout=backoff.next())

    # ------------------------------------------------------------------ API calls
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One client call (:func:`agent.kube.call`): JSON data, None for a 404 (callers decide
        what a missing object means); the client is dropped when the server was not reached."""
        return call(what, fn, *args, timeout_s=_REQUEST_TIMEOUT_S, on_unreachable=self._drop_client, **kwargs)

    def _drop_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def _api_client(self) -> Any:
        if self._client is None:
            try:
                self._client = self.client_factory()
            except Exception as exc:
                raise _Failure(f"client {type(exc).__name__}",
                               f"cannot configure the Kubernetes client: {exc}") from None
        return self._client

    def _resource_api(self) -> Any:
        from kubernetes import client

        cls = {"v1": client.ResourceV1Api, "v1beta2": client.ResourceV1beta2Api,
               "v1beta1": client.ResourceV1beta1Api}[self.api_version or "v1"]
        return cls(self._api_client())

    def _discover(self) -> None:
        served = resource_versions(self._api_client(), _REQUEST_TIMEOUT_S)
        version = pick_version(served)
        if version is None:
            raise _Failure("not served", f"the API server serves no {RESOURCE_GROUP} version this agent "
                                         f"publishes ({', '.join(API_VERSIONS)}); served: {served or 'none'}")
        self.api_version = version
        log.info("publishing ResourceSlices as resource.k8s.io/%s (served: %s)", version, ", ".join(served))
        if version not in SETS_API_VERSIONS:
            log.warning("resource.k8s.io/%s has no partitionable devices: publishing the single GPUs only,"
                        " no GPU sets%s (they need resource.k8s.io/%s)", version,
                        " and no dynamic MIG devices" if self.settings.dynamic_mig else "",
                        " or ".join(SETS_API_VERSIONS))
        self._decide_gpu_sets()
        if self._events is not None:
            self._events.dra_api_feature(PARTITIONABLE_DEVICES, version in SETS_API_VERSIONS)
            self._events.dra_api_feature(DEVICE_TAINTS, self.kept[DEVICE_TAINTS])

    def _decide_gpu_sets(self) -> None:
        """Decide once whether to publish GPU sets; say which and why (one line, the metric)."""
        setting = self.settings.gpu_sets
        server = None
        if setting == "auto":
            try:
                server = server_version(self._api_client(), _REQUEST_TIMEOUT_S)
            except ApiCallError as exc:
                if exc.status is None:
                    raise  # not reached: decide once it answers
                log.warning("cannot read the API server's version (%s): deciding without it", exc)
        on, why = gpu_sets_decision(setting, server)
        self.gpu_sets = on
        log.info("GPU sets %s: %s", "published" if on else "not published", why)
        grace = self.settings.withdrawal_grace_s
        if on:
            log.info("withdrawing a GPU set one of whose GPUs is held through another device: %s", (
                f"tainted {self.driver_name}/withdrawn, withdrawn after {grace:g} s" if grace > 0 else
                "withdrawn at once, untainted (safe only while the scheduler's view of the slices does not lag)")
                + f" (dra.gpuSetWithdrawalGraceSeconds {grace:g}); the single device of a GPU held through a set: "
                + ("the same where the API server keeps taints, else it stays published" if grace > 0
                   else "stays published"))
        if self._events is not None:
            self._events.dra_gpu_sets(on, setting)

    def _read_node(self) -> None:
        from kubernetes import client

        try:
            node = self._call(f"read Node {self.node_name}", client.CoreV1Api(self._api_client()).read_node,
                              self.node_name)
        except ApiCallError as exc:
            if exc.status is None:
                raise
            log.warning("cannot read Node %s (%s): slices are published without an owner reference",
                        self.node_name, exc)
            node = None
        else:
            if node is None:
                log.warning("Node %s not found: slices are published without an owner reference", self.node_name)
        self.node_uid = ((node or {}).get("metadata") or {}).get("uid")
        self._node_read = True

    def _ours(self, api: Any) -> dict[str, dict[str, Any]]:
        listed = self._call("list ResourceSlices", api.list_resource_slice,
                            field_selector=f"spec.nodeName={self.node_name}") or {}
        return {o["metadata"]["name"]: o for o in listed.get("items", [])
                if (o.get("spec") or {}).get("driver") == self.driver_name
                and (o.get("spec") or {}).get("nodeName") == self.node_name}

    def _sync(self) -> None:
        if self.api_version is None:
            self._discover()
        if not self._node_read:
            self._read_node()
        api = self._resource_api()
        # a dropped feature ends a round early and the pool is published again without it:
        # at most once per feature
        while not self._publish(api, self._ours(api)):
            pass

    def _publish(self, api: Any, existing: dict[str, dict[str, Any]]) -> bool:
        """Make the pool what :meth:`desired` says; False when the server dropped a feature's
        fields on a write (the round stopped there, :attr:`kept` says which)."""
        want = self._desired(existing)
        for w in want:
            keep_taint_times(w, existing.get(w["metadata"]["name"]))
        first = stamp_withdrawals(want, self.driver_name, time.time())
        self._withdrawal_due = float("inf") if first is None else first + self.settings.withdrawal_grace_s
        plan = plan_writes(existing, want, self.generation)
        if not plan.writes and not plan.deletes:
            self.generation = plan.generation
            self._report(want)
            return True
        now = dict(existing)
        for w in plan.writes:
            stored = now[w["metadata"]["name"]] = self._put(api, w, now.get(w["metadata"]["name"]))
            self.generation = plan.generation
            if self._dropped(w, stored):
                return False
        for name in plan.deletes:
            self._call(f"delete ResourceSlice {name}", api.delete_resource_slice, name)
        log.info("published %d ResourceSlice(s) of node %s, pool generation %d",
                 len(want), self.node_name, plan.generation)
        self._report(want)
        return True

    def _report(self, want: list[dict[str, Any]]) -> None:
        """``gpu_agent_dra_published_devices``: the pool's devices by kind and state."""
        if self._events is None:
            return
        key = withdrawal_taint(self.driver_name)["key"]
        counts: dict[tuple[str, str], int] = {}
        for obj in want:
            for d in obj["spec"].get("devices") or ():
                body = d.get("basic", d)  # v1beta1 nests the device
                kind = ((body.get("attributes") or {}).get(f"{self.driver_name}/type") or {}).get("string", "gpu")
                state = "withdrawing" if any(t.get("key") == key for t in body.get("taints") or ()) else "ordinary"
                counts[(kind, state)] = counts.get((kind, state), 0) + 1
        self._events.dra_published_devices(counts)

    def _dropped(self, sent: dict[str, Any], stored: dict[str, Any]) -> bool:
        """Whether the server dropped a feature still in use from ``sent`` (said once)."""
        dropped = {f for f in dropped_features(sent, stored) if self.kept[f]}
        for feature in sorted(dropped):
            self.kept[feature] = False
            log.warning("ResourceSlice %s was stored without %s", sent["metadata"]["name"], _WITHOUT[feature])
            if self._events is not None:
                self._events.dra_api_feature(feature, False)
        return bool(dropped)

    def _put(self, api: Any, body: dict[str, Any], current: dict[str, Any] | None) -> dict[str, Any]:
        """Create or update ``body``; the object as the server stored it."""
        name = body["metadata"]["name"]
        for _ in range(_CONFLICT_RETRIES):
            if current is None:
                try:
                    created = self._call(f"create ResourceSlice {name}", api.create_resource_slice, body)
                except ApiCallError as exc:
                    if exc.status != 409:
                        raise
                    created = None  # AlreadyExists: someone made it meanwhile; update it
                if created is not None:
                    return dict(created)
            else:
                update = json.loads(json.dumps(body))
                update["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                try:
                    done = self._call(f"update ResourceSlice {name}", api.replace_resource_slice, name, update)
                except ApiCallError as exc:
                    if exc.status != 409:
                        raise
                    # stale resourceVersion: re-read below and try again
                else:
                    if done is None:  # deleted meanwhile: create it
                        current = None
                        continue
                    return dict(done)
            current = self._call(f"read ResourceSlice {name}", api.read_resource_slice, name)
        raise _Failure("409 Conflict", f"ResourceSlice {name}: still conflicting after {_CONFLICT_RETRIES} tries")

    def _delete_all(self) -> None:
        api = self._resource_api()
        for name in sorted(self._ours(api)):
            self._call(f"delete ResourceSlice {name}", api.delete_resource_slice, name)
        log.info("deleted the ResourceSlices of node %s", self.node_name)
