"""The API calls of the Node health publisher, and their dry-run twin.

:class:`KubeNodeApi` talks to the API server through :class:`agent.kube.CoreObjects` (one
client, built from ``--kubeconfig`` or in-cluster, dropped after a connection failure):

- the node's conditions: ``GET nodes/<node>/status`` once at start (to keep a standing
  condition's ``lastTransitionTime`` across an agent restart) and a strategic merge patch of
  ``nodes/<node>/status`` holding only the agent's condition (``conditions`` merge by ``type``,
  as ``NodeStatus`` declares ``patchMergeKey: type``: the kubelet's and other writers'
  conditions stay as they are);
- Events on the Node (``core/v1``, namespace ``default``, the ``involvedObject`` a Node
  reference whose ``uid`` is the node's name, as the kubelet and node-problem-detector write
  theirs and ``kubectl describe node`` finds them): create, then a strategic merge patch of
  ``count``, ``lastTimestamp`` and ``message`` for each repeat (client-go's ``eventLogger``).

Every failure is one :class:`agent.kube.ApiCallError`. :class:`DryRunNodeApi` writes nothing
and logs what it would write (``health.nodeCondition: dry-run``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from agent.health.node_events import EVENTS_NAMESPACE
from agent.kube import CoreObjects

log = logging.getLogger(__name__)

__all__ = ["DryRunNodeApi", "KubeNodeApi", "NodeApi"]



class NodeApi(Protocol):
    """What the publisher writes; each call raises ApiCallError on failure."""

    def read_conditions(self, node: str) -> list[dict[str, Any]]: ...

    def patch_condition(self, node: str, condition: dict[str, Any]) -> None: ...

    def create_event(self, body: dict[str, Any]) -> dict[str, Any] | None: ...

    def patch_event(self, name: str, patch: dict[str, Any]) -> bool:
        """False when the Event is gone (404: its TTL ran out)."""
        ...

    def read_event(self, name: str) -> dict[str, Any] | None: ...


class KubeNodeApi:
    """:class:`NodeApi` through :class:`agent.kube.CoreObjects`."""

    def __init__(self, objects: CoreObjects) -> None:
        self.objects = objects

    def read_conditions(self, node: str) -> list[dict[str, Any]]:
        conditions = (self.objects.read_node_status(node).get("status") or {}).get("conditions") or []
        return [c for c in conditions if isinstance(c, dict)]

    def patch_condition(self, node: str, condition: dict[str, Any]) -> None:
        self.objects.patch_node_status(node, {"status": {"conditions": [condition]}})

    def create_event(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self.objects.create_event(EVENTS_NAMESPACE, body)

    def patch_event(self, name: str, patch: dict[str, Any]) -> bool:
        return self.objects.patch_event(EVENTS_NAMESPACE, name, patch) is not None

    def read_event(self, name: str) -> dict[str, Any] | None:
        return self.objects.read_event(EVENTS_NAMESPACE, name)


class DryRunNodeApi:
    """Writes nothing: each write is one INFO line saying what it would have been."""

    def read_conditions(self, node: str) -> list[dict[str, Any]]:
        return []

    def patch_condition(self, node: str, condition: dict[str, Any]) -> None:
        log.info("dry-run: would set Node %s condition %s=%s reason %s: %s", node, condition["type"],
                 condition["status"], condition["reason"], condition["message"])

    def create_event(self, body: dict[str, Any]) -> dict[str, Any] | None:
        log.info("dry-run: would create %s Event %s on Node %s: %s", body["type"], body["reason"],
                 body["involvedObject"]["name"], body["message"])
        return body

    def patch_event(self, name: str, patch: dict[str, Any]) -> bool:
        log.info("dry-run: would update Event %s: count %s: %s", name, patch.get("count"), patch.get("message"))
        return True

    def read_event(self, name: str) -> dict[str, Any] | None:
        return None
