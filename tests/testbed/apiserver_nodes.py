"""The stand-in API server's Node status subresource and core/v1 Events (issue 35), mixed
into :class:`tests.testbed.apiserver_stub.ApiServerStub`. Upstream behaviour followed:

- **Patch types** (``k8s.io/apiserver/pkg/endpoints/handlers/patch.go``): the request's
  ``Content-Type`` picks the patch: ``application/strategic-merge-patch+json`` merges lists
  by the merge key the type declares (``NodeStatus.conditions``: ``patchMergeKey: type``,
  ``patchStrategy: merge``; an item ``{"$patch": "delete"}`` removes it), maps recursively, a
  ``null`` deletes a key (``apimachinery/pkg/util/strategicpatch``); ``application/merge-patch+json``
  (RFC 7386) replaces every list whole (so a client that sends its one condition that way
  wipes the kubelet's); any other type is 415 here (JSON patch and apply are not served).
- **Node status** (``pkg/registry/core/node/strategy.go`` ``nodeStatusStrategy``): ``GET`` and
  ``PATCH`` of ``nodes/<name>/status``; a status write keeps the old ``spec`` and
  ``metadata`` (``PrepareForUpdate``, ``ResetObjectMetaForStatus``), bumps the
  ``resourceVersion`` and is admitted as an ``UPDATE`` of ``nodes/status``; a condition
  without ``type`` or with a ``status`` other than True, False, Unknown is 422.
- **Events** (``pkg/registry/core/event``, ``pkg/apis/core/validation/events.go``): create
  (409 ``AlreadyExists``), get, list (``fieldSelector`` on ``involvedObject.*``, ``reason``,
  ``type``; all namespaces at ``/api/v1/events``), strategic merge ``PATCH``; an Event about a
  cluster-scoped object (``involvedObject.namespace`` empty) must live in ``default`` (or the
  involved object's namespace otherwise), ``type`` is Normal or Warning, ``reason`` and
  ``involvedObject.name`` are required (422 otherwise). Events do not expire here (the API
  server's ``--event-ttl``, 1 h): :meth:`NodesAndEvents.expire_event` deletes one as the TTL would.
"""

from __future__ import annotations

import copy
import threading
import uuid as uuidlib
from typing import Any, Callable

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
#: list fields merged by key in a strategic merge patch (path from the object's root)
MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}


def strategic_merge(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """``patch`` applied to ``target`` (a copy), strategic-merge style (see the module)."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target)
    for key, value in patch.items():
        here = (*path, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and here in MERGE_KEYS and isinstance(out.get(key), list):
            merge_key = MERGE_KEYS[here]
            items = [copy.deepcopy(i) for i in out[key]]
            for item in value:
                at = next((n for n, old in enumerate(items) if old.get(merge_key) == item.get(merge_key)), None)
                if item.get("$patch") == "delete":
                    if at is not None:
                        del items[at]
                elif at is None:
                    items.append(copy.deepcopy(item))
                else:
                    items[at] = strategic_merge(items[at], item, here)
            out[key] = items
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value, here)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merged, ``null`` deletes, everything else (lists too) replaced."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class NodesAndEvents:
    """The mixin: expects the stub's ``_lock``, ``_nodes``, ``_next_rv``, ``_admit``,
    ``_record``, ``_changed`` and its :class:`ApiError` / ``invalid`` (handed in as ``errors``)."""

    _lock: threading.RLock
    _nodes: dict[str, dict[str, Any]]
    _changed: threading.Condition

    def _init_events(self) -> None:
        self._core_events: dict[tuple[str, str], dict[str, Any]] = {}

    # ------------------------------------------------------------------ test helpers
    def node_conditions(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._nodes[name].get("status", {}).get("conditions") or [])

    def node_condition(self, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.node_conditions(name) if c.get("type") == type_), None)

    def set_node_condition(self, name: str, condition: dict[str, Any]) -> None:
        """Write a condition as another writer (the kubelet) would."""
        with self._lock:
            node = self._nodes[name]
            node.update(strategic_merge(node, {"status": {"conditions": [condition]}}))
            node["metadata"]["resourceVersion"] = self._next_rv()  # type: ignore[attr-defined]
            self._record("nodes", "MODIFIED", node)  # type: ignore[attr-defined]

    def condition_history(self, name: str, type_: str) -> list[dict[str, Any]]:
        """Every state the Node's condition ``type_`` went through, one per write that changed
        the Node (what a watch of the Node saw)."""
        with self._lock:
            nodes = [o for _, resource, _, o in self._events if resource == "nodes"  # type: ignore[attr-defined]
                     and o["metadata"]["name"] == name]
            found = [next((c for c in (o.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)
                     for o in nodes]
            return [copy.deepcopy(c) for c in found if c is not None]

    def core_events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(e) for (ns, _), e in sorted(self._core_events.items())
                    if namespace is None or ns == namespace]

    def expire_event(self, namespace: str, name: str) -> None:
        with self._lock:
            del self._core_events[(namespace, name)]

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Block until ``predicate()`` (re-checked on every write, and every 50 ms)."""
        import time

        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))
            return True

    # ------------------------------------------------------------------ routes
    def _patched(self, current: dict[str, Any], body: dict[str, Any], content_type: str) -> dict[str, Any]:
        kind = content_type.split(";")[0].strip()
        if kind == STRATEGIC:
            return strategic_merge(current, body)
        if kind == MERGE:
            return merge_patch(current, body)
        raise self._error(415, f"the stand-in serves no {kind or 'untyped'} patch")

    def _node_status_route(self, method: str, name: str, body: dict[str, Any] | None,
                           content_type: str) -> tuple[int, dict[str, Any]]:
        node = self._nodes.get(name)
        if node is None:
            raise self._error(404, f'nodes "{name}" not found', name=name, kind="nodes")
        if method == "GET":
            return 200, copy.deepcopy(node)
        if method != "PATCH":
            raise self._error(405, f"{method} is not served by the stand-in for nodes/status")
        new = self._patched(node, body or {}, content_type)
        new["spec"], new["metadata"] = copy.deepcopy(node.get("spec", {})), copy.deepcopy(node["metadata"])
        causes = []
        for i, condition in enumerate((new.get("status") or {}).get("conditions") or []):
            if not condition.get("type"):
                causes.append((f"status.conditions[{i}].type", "Required value"))
            if condition.get("status") not in ("True", "False", "Unknown"):
                causes.append((f"status.conditions[{i}].status",
                               f"Unsupported value: {condition.get('status')!r}: supported values: "
                               '"False", "True", "Unknown"'))
        if causes:
            raise self._invalid("Node", "", name, causes)
        self._admit("UPDATE", node, new)  # type: ignore[attr-defined]
        new["metadata"]["resourceVersion"] = self._next_rv()  # type: ignore[attr-defined]
        self._nodes[name] = new
        self._record("nodes", "MODIFIED", new)  # type: ignore[attr-defined]
        return 200, copy.deepcopy(new)

    def _events_route(self, method: str, namespace: str | None, name: str | None, query: dict[str, str],
                      body: dict[str, Any] | None, content_type: str) -> tuple[int, dict[str, Any]]:
        from tests.testbed.apiserver_stub import _selected

        if name is None and method == "GET":
            items = [copy.deepcopy(e) for (ns, _), e in sorted(self._core_events.items())
                     if (namespace is None or ns == namespace) and _selected(e, query)]
            return 200, {"kind": "EventList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)},
                         "items": items}
        if namespace is None:
            raise self._error(405, f"{method} is not served on /api/v1/events")
        if name is None and method == "POST":
            return self._create_core_event(namespace, body or {})
        current = self._core_events.get((namespace, name or ""))
        if current is None:
            raise self._error(404, f'events "{name}" not found', name=name, kind="events")
        if method == "GET":
            return 200, copy.deepcopy(current)
        if method == "PATCH":
            new = self._patched(current, body or {}, content_type)
            new["metadata"] = {**current["metadata"], "resourceVersion": self._next_rv()}  # type: ignore[attr-defined]
            self._check_event(namespace, new)
            self._core_events[(namespace, name or "")] = new
            self._changed.notify_all()
            return 200, copy.deepcopy(new)
        raise self._error(405, f"{method} is not served by the stand-in for events")

    def _check_event(self, namespace: str, obj: dict[str, Any]) -> None:
        involved = obj.get("involvedObject") or {}
        causes = []
        # about a cluster-scoped object: the Event's namespace is empty or default; else the object's
        allowed = (namespace,) if involved.get("namespace") else ("", "default")
        if (involved.get("namespace") or namespace) not in allowed or (involved.get("namespace") and
                                                                       involved["namespace"] != namespace):
            causes.append(("involvedObject.namespace",
                           f"Invalid value: {involved.get('namespace', '')!r}: does not match event.namespace"))
        if obj.get("type") not in ("Normal", "Warning"):
            causes.append(("type", f"Unsupported value: {obj.get('type')!r}: supported values: \"Normal\", \"Warning\""))
        if not obj.get("reason"):
            causes.append(("reason", "Required value"))
        if not involved.get("name"):
            causes.append(("involvedObject.name", "Required value"))
        if causes:
            raise self._invalid("Event", "", (obj.get("metadata") or {}).get("name", ""), causes)

    def _create_core_event(self, namespace: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        meta = obj.setdefault("metadata", {})
        if meta.setdefault("namespace", namespace) != namespace:
            raise self._error(400, "the namespace of the provided object does not match the namespace sent on the request")
        name = meta.get("name") or ""
        if not name:
            raise self._invalid("Event", "", "", [("metadata.name", "Required value: name or generateName is required")])
        self._check_event(namespace, obj)
        if (namespace, name) in self._core_events:
            raise self._error(409, f'events "{name}" already exists', reason="AlreadyExists", name=name, kind="events")
        self._admit("CREATE", None, obj)  # type: ignore[attr-defined]
        meta.update(uid=str(uuidlib.uuid4()), resourceVersion=self._next_rv())  # type: ignore[attr-defined]
        self._core_events[(namespace, name)] = obj
        self._changed.notify_all()
        return 201, copy.deepcopy(obj)

    # the stub's error constructors, bound by the stub module (no import cycle)
    _error: Callable[..., Exception]
    _invalid: Callable[..., Exception]
    _rv: int
