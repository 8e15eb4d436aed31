"""The NodeFeature label sink: the node's labels as one ``nfd.k8s-sigs.io/v1alpha1``
``NodeFeature`` object, the way GFD publishes them with ``useNodeFeatureAPI``.

NFD's master reads NodeFeature objects of every namespace (unless its namespace selector
narrows that), picks those labelled ``nfd.node.kubernetes.io/node-name: <node>`` for a node and
applies their ``spec.labels`` to the Node. So the object here is:

- named ``gpu-topology-agent-<node>`` in the agent's namespace (:func:`agent.kube.own_namespace`),
  labelled with the node name, ``spec.labels`` holding exactly the labels the feature file
  would hold (and nothing else in ``spec``);
- owned by the agent's pod (``POD_NAME`` and ``POD_UID`` from the downward API,
  ``blockOwnerDeletion: false`` as NFD's worker does), so the garbage collector deletes it
  with the pod: uninstalling removes the labels even without a clean stop;
- compared with what the API server holds at every write (the daemon re-asserts the labels
  every ``label_interval_s``): deleted, it is created again; edited by someone else (its
  labels, its node-name label, its owner), it is put back; a conditional update (the
  ``resourceVersion`` read) never overwrites a change it has not seen;
- deleted on a clean stop, unless another pod of the agent has taken it over since.

API-server failures (403 where RBAC forbids, 5xx, no answer) never stop the agent: each is
logged once when it starts or changes (its status, reason and message) and once when a write
works again (:class:`agent.retry.Outage`), and :meth:`NodeFeatureSink.write` raises
:class:`agent.errors.LabelWriteError`, so the publisher counts every failed write
(``gpu_agent_label_write_errors_total``) and the agent is not ready until a write works, as
with the feature file: a DaemonSet's rollout waits for its new pods to be ready, so an agent
that cannot publish its labels (RBAC missing, NFD not installed, the API server away) holds
the rollout instead of spreading over the nodes; labels published before an outage stay on
the node meanwhile. The publisher tries again with backoff
(:mod:`agent.labels.publishing`), then every ``label_interval_s`` once a write works.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

from agent.config import Config
from agent.errors import ConfigError, LabelWriteError
from agent.kube import ApiCallError, CustomObjects, own_namespace
from agent.retry import Outage

log = logging.getLogger(__name__)

GROUP = "nfd.k8s-sigs.io"
VERSION = "v1alpha1"
PLURAL = "nodefeatures"
#: The label NFD's master selects a node's NodeFeature objects by.
NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"
NAME_PREFIX = "gpu-topology-agent"
_CONFLICT_RETRIES = 3
_MAX_NAME = 253  # a DNS subdomain


def object_name(node_name: str) -> str:
    """``gpu-topology-agent-<node>`` (the admission policy of the manifests checks this name)."""
    return f"{NAME_PREFIX}-{node_name}"


def pod_owner(config: Config) -> dict[str, Any] | None:
    """The owner reference to the agent's pod, or None when its name or UID is not known."""
    if not (config.pod_name and config.pod_uid):
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": config.pod_name, "uid": config.pod_uid,
            "blockOwnerDeletion": False}


class NodeFeatureSink:
    """One NodeFeature object for ``node_name`` in ``namespace`` through ``objects``."""

    def __init__(self, objects: CustomObjects, *, node_name: str, namespace: str,
                 owner: dict[str, Any] | None) -> None:
        self.objects = objects
        self.node_name = node_name
        self.namespace = namespace
        self.owner = owner
        self.name = object_name(node_name)
        self.where = f"NodeFeature {namespace}/{self.name}"
        # said once per ApiCallError.state, the recovery once
        self._outage = Outage(log, f"publishing the labels as {self.where}", level=logging.ERROR, per_reason=True,
                              retrying="not ready; retrying with backoff")

    @classmethod
    def from_config(cls, config: Config) -> NodeFeatureSink:
        """The sink of ``--labels-sink nodefeature``. Raises ConfigError at start when the
        node name, the namespace or the API-server access is missing."""
        if not config.node_name:
            raise ConfigError("--labels-sink nodefeature needs the node name: set --node-name or NODE_NAME"
                              " (the downward API's spec.nodeName)")
        if len(object_name(config.node_name)) > _MAX_NAME:
            raise ConfigError(f"--node-name {config.node_name[:40]}...: too long for the NodeFeature name"
                              f" {NAME_PREFIX}-<node> (at most {_MAX_NAME} characters)")
        namespace = own_namespace(config)
        owner = pod_owner(config)
        if owner is None:
            log.warning("POD_NAME or POD_UID is not set: the NodeFeature has no owner and is removed"
                        " only by a clean stop (set both from the downward API)")
        objects = CustomObjects.from_config(config, GROUP, VERSION, PLURAL)
        return cls(objects, node_name=config.node_name, namespace=namespace, owner=owner)

    # ------------------------------------------------------------------ LabelSink
    def write(self, labels: Mapping[str, str]) -> bool:
        """Make the object hold ``labels``; True if it was created or changed. An API-server
        failure raises LabelWriteError (logged here once per change of state, see the module)."""
        try:
            changed = self._reconcile(dict(labels))
        except ApiCallError as exc:
            hint = {403: " (the agent's RBAC must allow it: see docs/labels.md, NodeFeature)",
                    404: f" (is NFD installed? no {PLURAL}.{GROUP}/{VERSION} API)"}.get(exc.status or 0, "")
            self._outage.failed(f"{exc}{hint}", key=exc.state)
            raise LabelWriteError(f"cannot publish the labels as {self.where}: {exc}") from exc
        self._outage.recovered()
        return changed

    def remove(self) -> None:
        """Delete the object, unless another pod of the agent owns it now or it changed since
        it was read (a precondition on its resourceVersion). Failures are logged."""
        try:
            current = self.objects.get(self.namespace, self.name)
            if current is None:
                return
            owners = current.get("metadata", {}).get("ownerReferences") or []
            if self.owner is not None and not any(o.get("uid") == self.owner["uid"] for o in owners):
                log.info("left %s in place: another pod owns it now", self.where)
                return
            rv = current.get("metadata", {}).get("resourceVersion")
            if self.objects.delete(self.namespace, self.name, resource_version=rv):
                log.info("deleted %s", self.where)
        except ApiCallError as exc:
            log.warning("could not delete %s: %s", self.where, exc)
        finally:
            self.objects.close()

    # ------------------------------------------------------------------ internals
    def _desired(self, labels: dict[str, str], current: dict[str, Any] | None) -> dict[str, Any]:
        """``current`` (whatever else others put in its metadata is kept) with our node label,
        owner and spec; a new object when there is none."""
        obj: dict[str, Any] = copy.deepcopy(current) if current is not None else {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeFeature",
            "metadata": {"name": self.name, "namespace": self.namespace}}
        meta: dict[str, Any] = obj.setdefault("metadata", {})
        meta.setdefault("labels", {})[NODE_NAME_LABEL] = self.node_name
        if self.owner is not None:
            meta["ownerReferences"] = [dict(self.owner)]
        obj["spec"] = {"labels": labels}
        return obj

    def _reconcile(self, labels: dict[str, str]) -> bool:
        for _ in range(_CONFLICT_RETRIES):
            current = self.objects.get(self.namespace, self.name)
            want = self._desired(labels, current)
            if current is None:
                try:
                    self.objects.create(self.namespace, want)
                except ApiCallError as exc:
                    if exc.status == 409:  # created meanwhile (AlreadyExists): read it again
                        continue
                    raise
                log.info("created %s with %d labels", self.where, len(labels))
                return True
            if want == current:
                return False
            try:
                done = self.objects.replace(self.namespace, self.name, want)
            except ApiCallError as exc:
                if exc.status == 409:  # changed since it was read: read it again
                    continue
                raise
            if done is None:  # deleted since it was read: create it
                continue
            log.info("updated %s: %d labels", self.where, len(labels))
            return True
        raise ApiCallError(f"update {self.where}", 409, "Conflict",
                           f"still conflicting after {_CONFLICT_RETRIES} tries")
