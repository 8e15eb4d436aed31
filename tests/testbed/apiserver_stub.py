"""An in-process stand-in for the Kubernetes API server, over real HTTP on 127.0.0.1.

No API server can run on these machines, so the DRA tests talk to this one through the
official ``kubernetes`` client. It keeps the semantics that client (and our code) relies on,
nothing more:

- discovery: ``/api``, ``/api/v1``, ``/apis``, ``/apis/resource.k8s.io`` and
  ``/apis/resource.k8s.io/<version>`` list only the versions it is told to serve
  (``served_versions``, preferred first); a request for another version is a 404;
- ``resourceslices`` (cluster-scoped): create (409 ``AlreadyExists``; ``generateName``),
  get (404), list (``fieldSelector`` on ``spec.nodeName``, ``spec.driver``, ``metadata.name``;
  ``labelSelector`` with ``k=v``), update (PUT; 409 ``Conflict`` when the body's
  ``metadata.resourceVersion`` is stale, an empty one updates unconditionally; ``spec.nodeName``
  and ``spec.driver`` are immutable, 422), delete (404); every write bumps a global
  ``resourceVersion`` as etcd does. One object store serves all versions (no conversion: the
  stored object is returned with the requested ``apiVersion``). A few of the API server's own
  validations are kept (kind and apiVersion match the URL, at most 128 devices, device names
  are DNS labels and unique) so that a bad slice fails here as it would there;
- ``resourceclaims`` (namespaced): get and list, objects put in by the test (:meth:`put_claim`);
- ``/api/v1/nodes/<name>``: get, objects put in by the test (:meth:`add_node`); its ``status``
  subresource and core/v1 Events: :mod:`tests.testbed.apiserver_nodes`;
- ``/version``: ``server_version`` (``"1.37"`` by default) as the API server answers it
  (``k8s.io/apimachinery/pkg/version.Info``: ``major``, ``minor``, ``gitVersion``, ...;
  ``apiserver/pkg/endpoints/discovery/version.go``), unauthenticated as upstream's
  ``system:public-info-viewer`` allows;
- failures on demand: :meth:`fail` answers matching requests with a ``Status`` error (403,
  500, ...), :meth:`go_down` / :meth:`come_up` close and reopen the listening socket on the same
  port (connection refused in between).

Errors are ``Status`` objects with ``code``, ``reason`` and ``message``, as the client expects.

Added for the NodeFeature label sink and the API server "as the agent meets it" (issue 18),
each following the named upstream code:

- ``nodefeatures.nfd.k8s-sigs.io/v1alpha1`` (namespaced; NFD's CRD
  ``deployment/base/nfd-crds/nfd-api-crds.yaml``, served by the apiextensions server): get,
  list (``labelSelector``), create (409 ``AlreadyExists``), update (PUT; 409 ``Conflict`` on a
  stale ``metadata.resourceVersion``, an empty one updates unconditionally; 404 when absent:
  a CRD's update never creates), delete with ``preconditions`` (``uid``, ``resourceVersion``:
  409 ``Precondition failed``, as ``registry/generic/registry.Store.Delete``); the structural
  schema's checks (``spec`` required, ``spec.labels`` a map of strings, the name a DNS
  subdomain) answer 422 and unknown ``spec`` fields are pruned. ``nfd_installed=False``: no
  such API (404 on every request, absent from discovery), as before NFD is installed;
- **422 in the server's shape** (:func:`invalid`, ``apimachinery/pkg/api/errors.NewInvalid``):
  reason ``Invalid``, ``<Kind>.<group> "<name>" is invalid: <field>: <detail>`` and
  ``details`` with ``name``, ``group``, ``kind`` and one ``causes`` entry per field error;
  the ResourceSlice validations above answer in it too;
- **fields of disabled features dropped on write** (``disabled_features``,
  ``pkg/registry/resource/resourceslice/strategy.go`` ``dropDisabledFields``): a created or
  updated slice loses the fields of each disabled gate in :data:`SLICE_FEATURE_FIELDS`, unless
  the stored slice already uses them; the write succeeds and the answer and later reads show
  the object without them; a device taint written without ``timeAdded`` gets the current time
  (the field is "added automatically during create or update if not set", ``k8s.io/api/resource/v1``
  ``DeviceTaint``);
- **watch** (``?watch=true`` on slices, nodes and nodefeatures; ``apiserver/pkg/storage/cacher``
  and ``endpoints/handlers/watch.go``): a chunked stream of ``{"type", "object"}`` lines;
  without a ``resourceVersion`` the current objects come first as ``ADDED``; it ends at
  ``timeoutSeconds`` or when the test calls :meth:`ApiServerStub.end_watches`, and the client
  resumes from the last ``resourceVersion`` it saw; after :meth:`ApiServerStub.compact`, a
  resumed watch from before gets one ``ERROR`` event holding a 410 ``Expired`` Status;
- **Node labels and the Node list**, for the per-node config label (issue 18):
  ``/api/v1/nodes`` lists (``fieldSelector`` ``metadata.name``) with the list's
  ``resourceVersion``; :meth:`ApiServerStub.label_node` changes labels as ``kubectl label
  --overwrite`` does (a new ``resourceVersion``, a ``MODIFIED`` event); a watch asked with
  ``allowWatchBookmarks`` gets a ``BOOKMARK`` holding the newest ``resourceVersion`` just
  before its ``timeoutSeconds`` end, as the cacher sends one before a watcher's deadline
  (``cacheWatcher.nextBookmarkTime``), not when :meth:`ApiServerStub.end_watches` cuts it;
- **SelfSubjectAccessReview** (``authorization.k8s.io/v1``, for ``doctor``): the caller's own
  access to a verb on a resource, answered by the same RBAC, allowed to every authenticated
  user; and **dry-run creates** of ResourceSlices (``?dryRun=All``): validated, admitted and
  answered as stored, never stored;
- **authentication, RBAC (403) and admission** (``access``: :class:`apiserver_auth.Access`,
  from the project's manifests under ``daemonset/``): the rules and their upstream sources
  are in :mod:`apiserver_auth`. Without ``access`` every request is allowed, as the DRA tests
  above have always run.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid as uuidlib
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import parse_qs, urlsplit

from tests.testbed.apiserver_auth import Access, Attributes
from tests.testbed.apiserver_nodes import NodesAndEvents

GROUP = "resource.k8s.io"
ALL_VERSIONS = ("v1", "v1beta2", "v1beta1")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MAX_DEVICES = 128
NFD_GROUP = "nfd.k8s-sigs.io"
NFD_VERSION = "v1alpha1"
_NFD_API_GROUP = {"kind": "APIGroup", "apiVersion": "v1", "name": NFD_GROUP,
                  "versions": [{"groupVersion": f"{NFD_GROUP}/{NFD_VERSION}", "version": NFD_VERSION}],
                  "preferredVersion": {"groupVersion": f"{NFD_GROUP}/{NFD_VERSION}", "version": NFD_VERSION}}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
    500: "InternalError", 503: "ServiceUnavailable",
}


class ApiError(Exception):
    def __init__(self, code: int, message: str, reason: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": str(self), "reason": self.reason, "code": self.code,
        }
        details = {k: v for k, v in self.details.items() if v is not None}
        if details:
            body["details"] = details
        return body


@dataclass
class _FailureRule:
    code: int
    method: str | None
    path_contains: str | None
    remaining: int | None  # None: until cleared
    message: str


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    query: str


class ApiServerStub(NodesAndEvents):
    """Start with :meth:`start` (or as a context manager); point the client at :attr:`url`.
    Node status and core/v1 Events: :mod:`tests.testbed.apiserver_nodes`."""

    _error = staticmethod(lambda *a, **k: ApiError(*a, **k))
    _invalid = staticmethod(lambda *a: invalid(*a))

    def __init__(self, served_versions: Iterable[str] = ALL_VERSIONS, *, access: Access | None = None,
                 disabled_features: Iterable[str] = (), nfd_installed: bool = True,
                 server_version: str = "1.37") -> None:
        self.served_versions = tuple(served_versions)
        self.server_version = server_version
        self.access = access  # None: every request is allowed (no authentication, no RBAC)
        self.disabled_features = frozenset(disabled_features)
        self.nfd_installed = nfd_installed  # NFD's NodeFeature CRD is installed
        self._nodefeatures: dict[tuple[str, str], dict[str, Any]] = {}
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, resource, type, object)
        self._compacted_rv = 0  # watches from before this answer 410 Expired
        self._watch_generation = 0  # end_watches() bumps it: open watches end
        self._attrs: Attributes | None = None  # the request being served (under the lock)
        unknown = set(self.served_versions) - set(ALL_VERSIONS)
        if unknown:
            raise ValueError(f"unknown resource.k8s.io versions {sorted(unknown)}")
        self._lock = threading.RLock()
        self._rv = 1000
        self._slices: dict[str, dict[str, Any]] = {}
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._failures: list[_FailureRule] = []
        self.requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._changed = threading.Condition(self._lock)
        self._content_type = ""  # of the request being served (under the lock)
        self._init_events()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ApiServerStub":
        stub = self

        class Handler(_Handler):
            server_stub = stub

        self._server = _Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="apiserver-stub",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.close_connections()  # kept-alive connections must die too
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def go_down(self) -> None:
        """Close the listening socket: connections are refused until :meth:`come_up`."""
        self.stop()

    def come_up(self) -> None:
        """Listen again on the same port, with the same objects."""
        self.start()

    def __enter__(self) -> "ApiServerStub":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ client helpers
    def configuration(self) -> Any:
        """A ``kubernetes.client.Configuration`` pointing at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.retries = False  # a refused connection is an immediate error, as tests expect
        return cfg

    def api_client(self) -> Any:
        from kubernetes import client

        return client.ApiClient(self.configuration())

    # ------------------------------------------------------------------ test controls
    def fail(self, code: int, *, method: str | None = None, path_contains: str | None = None,
             times: int | None = None, message: str | None = None) -> None:
        """Answer requests matching ``method`` and ``path_contains`` with HTTP ``code``
        (``times`` requests, or until :meth:`clear_failures`)."""
        with self._lock:
            self._failures.append(_FailureRule(
                code, method.upper() if method else None, path_contains, times,
                message or f"injected failure {code}"))

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def add_node(self, name: str, uid: str | None = None, labels: dict[str, str] | None = None) -> str:
        """Add a Node object (with ``labels``); returns its UID."""
        with self._lock:
            uid = uid or str(uuidlib.uuid4())
            self._nodes[name] = {
                "kind": "Node", "apiVersion": "v1",
                "metadata": {"name": name, "uid": uid, "resourceVersion": self._next_rv(),
                             "creationTimestamp": _now(), **({"labels": dict(labels)} if labels else {})},
                "spec": {}, "status": {},
            }
            self._record("nodes", "ADDED", self._nodes[name])
            return uid

    def label_node(self, name: str, **labels: str | None) -> None:
        """Set (None: remove) labels of a node, as ``kubectl label --overwrite``:
        ``label_node("n1", **{"nvidia.com/device-plugin.config": "a"})``."""
        with self._lock:
            meta = self._nodes[name]["metadata"]
            current = meta.setdefault("labels", {})
            for key, value in labels.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
            meta["resourceVersion"] = self._next_rv()
            self._record("nodes", "MODIFIED", self._nodes[name])

    def put_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Store a ResourceClaim (``metadata.namespace``/``name`` required; a UID is assigned
        when absent). Returns the stored copy."""
        obj = copy.deepcopy(claim)
        meta = obj.setdefault("metadata", {})
        ns, name = meta.get("namespace"), meta.get("name")
        if not ns or not name:
            raise ValueError("a claim needs metadata.namespace and metadata.name")
        obj.setdefault("kind", "ResourceClaim")
        obj.setdefault("apiVersion", f"{GROUP}/{self.served_versions[0] if self.served_versions else 'v1'}")
        with self._lock:
            meta.setdefault("uid", str(uuidlib.uuid4()))
            meta["resourceVersion"] = self._next_rv()
            meta.setdefault("creationTimestamp", _now())
            self._claims[(ns, name)] = obj
            return copy.deepcopy(obj)

    def delete_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            self._claims.pop((namespace, name), None)

    def slice_history(self) -> list[list[dict[str, Any]]]:
        """Every state the stored ResourceSlices went through, one after each write, in order:
        what a scheduler's informer, fed one watch event at a time, may have seen."""
        with self._lock:
            events = [(kind, copy.deepcopy(obj)) for _, resource, kind, obj in self._events
                      if resource == "resourceslices"]
        state: dict[str, dict[str, Any]] = {}
        out = []
        for kind, obj in events:
            if kind == "DELETED":
                state.pop(obj["metadata"]["name"], None)
            else:
                state[obj["metadata"]["name"]] = obj
            out.append([state[k] for k in sorted(state)])
        return out

    def slices(self) -> list[dict[str, Any]]:
        """Copies of the stored ResourceSlices, sorted by name."""
        with self._lock:
            return [copy.deepcopy(self._slices[k]) for k in sorted(self._slices)]

    def put_slice(self, obj: dict[str, Any], version: str = "v1") -> dict[str, Any]:
        """Create a slice as another writer would (same checks as a POST); returns it."""
        with self._lock:
            code, out = self._create_slice(version, copy.deepcopy(obj))
            return out

    def delete_slice(self, name: str) -> None:
        """Delete a slice as ``kubectl delete`` would."""
        with self._lock:
            self._record("resourceslices", "DELETED", self._slices.pop(name))
            self._changed.notify_all()

    def modify_slice(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Change a stored slice as another writer would (bumps its resourceVersion)."""
        with self._lock:
            obj = self._slices[name]
            change(obj)
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self._record("resourceslices", "MODIFIED", obj)
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 5.0) -> bool:
        """Block until ``predicate(self.slices())`` is true (re-checked on every write)."""
        import time

        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if predicate(self.slices()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    def count(self, method: str, path_contains: str = "") -> int:
        """How many requests with ``method`` whose path contains ``path_contains`` were served."""
        with self._lock:
            return sum(1 for r in self.requests if r.method == method and path_contains in r.path)

    # ------------------------------------------------------------------ internals
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _injected(self, method: str, path: str) -> ApiError | None:
        for rule in self._failures:
            if rule.method and rule.method != method:
                continue
            if rule.path_contains and rule.path_contains not in path:
                continue
            if rule.remaining is not None:
                if rule.remaining <= 0:
                    continue
                rule.remaining -= 1
            return ApiError(rule.code, rule.message)
        return None

    def handle(self, method: str, raw_path: str, body: bytes,
               headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        path = parts.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            self.requests.append(Request(method, path, parts.query))
            try:
                failure = self._injected(method, path)
                if failure is not None:
                    raise failure
                self._attrs = self._authorize(method, path, query, (headers or {}).get("Authorization"))
                self._content_type = (headers or {}).get("Content-Type", "")
                return self._route(method, path, query, body)
            except ApiError as exc:
                return exc.code, exc.status()
            finally:
                self._attrs = None

    def _route(self, method: str, path: str, query: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        seg = [s for s in path.split("/") if s]
        if method == "GET":
            if seg == ["version"]:
                major, _, minor = self.server_version.partition(".")
                return 200, {"major": major, "minor": minor, "gitVersion": f"v{self.server_version}.0",
                             "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-08-01T00:00:00Z",
                             "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"}
            if seg == ["api"]:
                return 200, {"kind": "APIVersions", "versions": ["v1"],
                             "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
            if seg == ["api", "v1"]:
                return 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                    {"name": "nodes", "singularName": "node", "namespaced": False, "kind": "Node",
                     "verbs": ["get", "list", "watch"]}]}
            if seg == ["apis"]:
                groups = [self._group()] if self.served_versions else []
                groups += [_NFD_API_GROUP] if self.nfd_installed else []
                return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
            if seg == ["apis", GROUP]:
                if not self.served_versions:
                    raise ApiError(404, "the server could not find the requested resource")
                return 200, {"kind": "APIGroup", "apiVersion": "v1", **self._group()}
            if len(seg) == 3 and seg[:2] == ["apis", GROUP]:
                self._version(seg[2])
                return 200, self._resource_list(seg[2])
            if seg == ["api", "v1", "nodes"] and query.get("watch") in ("true", "1"):
                return 200, self._watch("nodes", query, copy.deepcopy)
            if seg == ["api", "v1", "nodes"]:
                return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)},
                             "items": [copy.deepcopy(n) for _, n in sorted(self._nodes.items()) if _selected(n, query)]}
            if len(seg) == 4 and seg[:3] == ["api", "v1", "nodes"]:
                node = self._nodes.get(seg[3])
                if node is None:
                    raise ApiError(404, f'nodes "{seg[3]}" not found', name=seg[3], kind="nodes")
                return 200, copy.deepcopy(node)
        if len(seg) == 5 and seg[:3] == ["api", "v1", "nodes"] and seg[4] == "status":
            return self._node_status_route(method, seg[3], _json(body) if method == "PATCH" else None,
                                           self._content_type)
        if seg == ["api", "v1", "events"]:
            return self._events_route(method, None, None, query, None, self._content_type)
        if len(seg) in (5, 6) and seg[:3] == ["api", "v1", "namespaces"] and seg[4] == "events":
            return self._events_route(method, seg[3], seg[5] if len(seg) == 6 else None, query,
                                      _json(body) if method in ("POST", "PATCH") else None, self._content_type)
        if method == "POST" and seg == ["apis", "authorization.k8s.io", "v1", "selfsubjectaccessreviews"]:
            return self._self_subject_access_review(_json(body))
        if seg[:2] == ["apis", NFD_GROUP] and self.nfd_installed:
            return self._nfd_route(method, seg[2:], query, body)
        if len(seg) >= 4 and seg[:2] == ["apis", GROUP]:
            version = self._version(seg[2])
            rest = seg[3:]
            if rest[0] == "resourceslices":
                return self._slices_route(method, version, rest[1:], query, body)
            if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] == "resourceclaims":
                return self._claims_route(method, version, rest[1], rest[3:], query)
        raise ApiError(404, "the server could not find the requested resource")

    def _group(self) -> dict[str, Any]:
        versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in self.served_versions]
        return {"name": GROUP, "versions": versions, "preferredVersion": versions[0]}

    def _resource_list(self, version: str) -> dict[str, Any]:
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{version}",
                "resources": [
                    {"name": "resourceslices", "singularName": "resourceslice", "namespaced": False,
                     "kind": "ResourceSlice",
                     "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]},
                    {"name": "resourceclaims", "singularName": "resourceclaim", "namespaced": True,
                     "kind": "ResourceClaim",
                     "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]},
                ]}

    def _version(self, version: str) -> str:
        if version not in self.served_versions:
            raise ApiError(404, "the server could not find the requested resource")
        return version

    @staticmethod
    def _as_version(obj: dict[str, Any], version: str) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        out["apiVersion"] = f"{GROUP}/{version}"
        return out

    # ---------------------------------------------------------- resourceslices
    def _slices_route(self, method: str, version: str, rest: list[str], query: dict[str, str],
                      body: bytes) -> tuple[int, dict[str, Any]]:
        if not rest:
            if method == "GET" and query.get("watch") in ("true", "1"):
                return 200, self._watch("resourceslices", query, lambda o: self._as_version(o, version))
            if method == "GET":
                items = [self._as_version(o, version) for k, o in sorted(self._slices.items())
                         if _selected(o, query)]
                return 200, {"kind": "ResourceSliceList", "apiVersion": f"{GROUP}/{version}",
                             "metadata": {"resourceVersion": str(self._rv)}, "items": items}
            if method == "POST" and query.get("dryRun") == "All":
                return self._create_slice(version, _json(body), dry_run=True)
            if method == "POST":
                return self._create_slice(version, _json(body))
            raise ApiError(405, f"{method} not allowed on the collection")
        name = rest[0]
        if method == "GET":
            return 200, self._as_version(self._get_slice(name), version)
        if method == "PUT":
            return self._update_slice(version, name, _json(body))
        if method == "DELETE":
            obj = self._get_slice(name)
            self._admit("DELETE", obj, None)
            del self._slices[name]
            self._record("resourceslices", "DELETED", obj)
            self._changed.notify_all()
            return 200, self._as_version(obj, version)
        raise ApiError(405, f"{method} not allowed on a resourceslice")

    def _get_slice(self, name: str) -> dict[str, Any]:
        obj = self._slices.get(name)
        if obj is None:
            raise ApiError(404, f'resourceslices.{GROUP} "{name}" not found',
                           name=name, group=GROUP, kind="resourceslices")
        return obj

    def _check_slice(self, version: str, obj: dict[str, Any]) -> None:
        if obj.get("kind") != "ResourceSlice":
            raise ApiError(400, f"kind {obj.get('kind')!r} is not ResourceSlice")
        if obj.get("apiVersion") != f"{GROUP}/{version}":
            raise ApiError(400, f"the API version in the data ({obj.get('apiVersion')}) does not match "
                                f"the expected API version ({GROUP}/{version})")
        spec = obj.get("spec") or {}
        for field_name in ("driver",):
            if not spec.get(field_name):
                raise ApiError(422, f"spec.{field_name}: Required value")
        pool = spec.get("pool") or {}
        if not pool.get("name") or "resourceSliceCount" not in pool or "generation" not in pool:
            raise ApiError(422, "spec.pool: name, generation and resourceSliceCount are required")
        devices = spec.get("devices") or []
        if len(devices) > _MAX_DEVICES:
            raise ApiError(422, f"spec.devices: Too many: {len(devices)}: must have at most {_MAX_DEVICES} items")
        seen: set[str] = set()
        for i, dev in enumerate(devices):
            name = dev.get("name", "")
            if not _DNS_LABEL.match(name):
                raise ApiError(422, f"spec.devices[{i}].name: Invalid value: {name!r}: must be a DNS label")
            if name in seen:
                raise ApiError(422, f"spec.devices[{i}].name: Duplicate value: {name!r}")
            seen.add(name)

    def _create_slice(self, version: str, obj: dict[str, Any], *, dry_run: bool = False) -> tuple[int, dict[str, Any]]:
        """Create; with ``dry_run`` (``?dryRun=All``) every step but storing: validation, the
        fields of disabled features dropped, admission, and the object as it would be stored
        answered, with no resourceVersion (``registry/generic/registry.DryRunnableStorage``)."""
        self._checked_slice(version, obj, None)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise ApiError(422, "metadata.name: Required value: name or generateName is required")
            meta["name"] = prefix + uuidlib.uuid4().hex[:5]
        name = meta["name"]
        if name in self._slices:
            raise ApiError(409, f'resourceslices.{GROUP} "{name}" already exists', reason="AlreadyExists",
                           name=name, group=GROUP, kind="resourceslices")
        meta["uid"] = str(uuidlib.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if dry_run:
            self._admit("CREATE", None, obj)
            return 201, self._as_version(obj, version)
        meta["resourceVersion"] = self._next_rv()
        self._admit("CREATE", None, obj)
        self._slices[name] = obj
        self._record("resourceslices", "ADDED", obj)
        self._changed.notify_all()
        return 201, self._as_version(obj, version)

    def _update_slice(self, version: str, name: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._checked_slice(version, obj, self._slices.get(name))
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        current = self._get_slice(name)
        rv = meta.get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise ApiError(409, f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": the object '
                                "has been modified; please apply your changes to the latest version and try again",
                           reason="Conflict", name=name, group=GROUP, kind="resourceslices")
        for field_name in ("nodeName", "driver"):
            if obj["spec"].get(field_name) != current["spec"].get(field_name):
                raise ApiError(422, f"spec.{field_name}: Invalid value: field is immutable")
        meta["uid"] = current["metadata"]["uid"]
        meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]
        changed = obj["spec"] != current["spec"]
        meta["generation"] = current["metadata"]["generation"] + (1 if changed else 0)
        self._admit("UPDATE", current, obj)
        meta["resourceVersion"] = self._next_rv()
        self._slices[name] = obj
        self._record("resourceslices", "MODIFIED", obj)
        self._changed.notify_all()
        return 200, self._as_version(obj, version)

    # ---------------------------------------------------------- resourceclaims
    def _claims_route(self, method: str, version: str, namespace: str, rest: list[str],
                      query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            raise ApiError(405, f"{method} is not served by the stand-in for resourceclaims")
        if not rest:
            items = [self._as_version(o, version) for (ns, _), o in sorted(self._claims.items())
                     if ns == namespace and _selected(o, query)]
            return 200, {"kind": "ResourceClaimList", "apiVersion": f"{GROUP}/{version}",
                         "metadata": {"resourceVersion": str(self._rv)}, "items": items}
        obj = self._claims.get((namespace, rest[0]))
        if obj is None:
            raise ApiError(404, f'resourceclaims.{GROUP} "{rest[0]}" not found',
                           name=rest[0], group=GROUP, kind="resourceclaims")
        return 200, self._as_version(obj, version)


    # =====================================================================================
    # Added for the NodeFeature label sink (issue 18); kept apart from the DRA parts above.
    # ---------------------------------------------------------- authentication, RBAC, admission
    def _authorize(self, method: str, path: str, query: dict[str, str],
                   authorization: str | None) -> Attributes | None:
        """401 without a known token, 403 where RBAC allows nothing (see apiserver_auth)."""
        if self.access is None:
            return None
        user = self.access.authenticate(authorization)
        if user is None:
            raise ApiError(401, "Unauthorized")
        attrs = request_attributes(user, method, path, query)
        basic_user = (attrs.verb, attrs.group, attrs.resource) == (
            "create", "authorization.k8s.io", "selfsubjectaccessreviews")  # system:basic-user
        if not basic_user and not self.access.rbac.allowed(attrs):
            if not attrs.resource_request:
                raise ApiError(403, f'forbidden: User "{user.name}" cannot {attrs.verb} path "{path}"')
            raise ApiError(403, self.access.rbac.forbidden_message(attrs), name=attrs.name or None,
                           group=attrs.group, kind=attrs.resource)
        return attrs

    def _admit(self, operation: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """The validating admission policies of the manifests (422 Invalid when one denies)."""
        attrs = self._attrs
        if self.access is None or attrs is None:
            return
        if attrs.name == "" and new is not None:
            attrs = replace(attrs, name=new.get("metadata", {}).get("name", ""))
        denial = self.access.admission_denial(attrs, operation, old, new)
        if denial is not None:
            raise ApiError(422, denial, reason="Invalid", name=attrs.name, group=attrs.group, kind=attrs.resource)

    def _self_subject_access_review(self, review: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``SelfSubjectAccessReview`` (``pkg/registry/authorization/selfsubjectaccessreview``):
        the requesting user's own access to ``spec.resourceAttributes``, answered in
        ``status.allowed`` (with the RBAC authorizer's ``reason``) and never a 403 for a denied
        verb; every authenticated user may create one (the ``system:basic-user`` ClusterRole).
        Without ``access`` every request is allowed."""
        attrs = (review.get("spec") or {}).get("resourceAttributes")
        if not isinstance(attrs, dict):
            raise invalid("SelfSubjectAccessReview", "authorization.k8s.io", "",
                          [("spec.resourceAttributes", "Required value: exactly one of"
                            " nonResourceAttributes or resourceAttributes must be specified")])
        allowed, reason = True, ""
        if self.access is not None and self._attrs is not None:
            asked = Attributes(self._attrs.user, str(attrs.get("verb") or ""), str(attrs.get("group") or ""),
                               str(attrs.get("resource") or ""), str(attrs.get("subresource") or ""),
                               str(attrs.get("namespace") or ""), str(attrs.get("name") or ""))
            allowed = self.access.rbac.allowed(asked)
            reason = "RBAC: allowed by a binding of the manifests" if allowed else ""
        out = copy.deepcopy(review)
        out.update({"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                    "status": {"allowed": allowed, **({"reason": reason} if reason else {})}})
        return 201, out

    # ---------------------------------------------------------- watch
    def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        """A watch event at the object's resourceVersion (a DELETED one at a new version, as
        etcd's delete revision)."""
        rv = int(obj.get("metadata", {}).get("resourceVersion") or 0)
        if kind == "DELETED":
            rv = int(self._next_rv())
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(rv)
        self._events.append((rv, resource, kind, copy.deepcopy(obj)))
        self._changed.notify_all()

    def end_watches(self) -> None:
        """End every open watch (the API server does so at its timeout, or on restart):
        clients must resume from the last resourceVersion they saw."""
        with self._lock:
            self._watch_generation += 1
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the event history (etcd compaction): a watch resumed from an older
        resourceVersion gets a 410 Expired ERROR event and must list again."""
        with self._lock:
            self._compacted_rv = self._rv
            self._events.clear()

    def _watch(self, resource: str, query: dict[str, str],
               render: Callable[[dict[str, Any]], dict[str, Any]]) -> "WatchStream":
        since = query.get("resourceVersion") or "0"
        if not since.isdigit():
            raise ApiError(400, f"invalid resourceVersion {since!r}")
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        return WatchStream(self, resource, int(since), query, render, timeout_s, self._watch_generation)

    def _current_of(self, resource: str) -> list[dict[str, Any]]:
        stores: dict[str, Any] = {"resourceslices": self._slices, "nodes": self._nodes,
                                  "nodefeatures": self._nodefeatures}
        return [stores[resource][k] for k in sorted(stores[resource])]

    # ---------------------------------------------------------- disabled features, 422 shape
    def _checked_slice(self, version: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """The slice validation above, answered in the API server's ``Invalid`` shape, then
        the fields of disabled features dropped (``dropDisabledFields``)."""
        try:
            self._check_slice(version, obj)
        except ApiError as exc:
            if exc.code != 422 or exc.details:
                raise
            name = obj.get("metadata", {}).get("name") or ""
            field_path, _, detail = str(exc).partition(": ")
            raise invalid("ResourceSlice", GROUP, name, [(field_path, detail)]) from None
        drop_disabled_slice_fields(self.disabled_features, obj, old)
        for device in (obj.get("spec") or {}).get("devices") or []:
            for taint in (device.get("basic") or device).get("taints") or []:
                taint.setdefault("timeAdded", _now())

    # ---------------------------------------------------------- nodefeatures (NFD's CRD)
    def nodefeatures(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Copies of the stored NodeFeatures (of ``namespace``), sorted by namespace and name."""
        with self._lock:
            return [copy.deepcopy(o) for (ns, _), o in sorted(self._nodefeatures.items())
                    if namespace is None or ns == namespace]

    def put_nodefeature(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a NodeFeature as another writer would (no RBAC); returns it."""
        with self._lock:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            key = (meta["namespace"], meta["name"])
            current = self._nodefeatures.get(key)
            meta["uid"] = current["metadata"]["uid"] if current else str(uuidlib.uuid4())
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = self._next_rv()
            self._nodefeatures[key] = obj
            self._record("nodefeatures", "MODIFIED" if current else "ADDED", obj)
            return copy.deepcopy(obj)

    def delete_nodefeature(self, namespace: str, name: str) -> None:
        """Delete a NodeFeature as ``kubectl delete`` (or the garbage collector) would."""
        with self._lock:
            self._record("nodefeatures", "DELETED", self._nodefeatures.pop((namespace, name)))

    def modify_nodefeature(self, namespace: str, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Change a stored NodeFeature as another writer would (bumps its resourceVersion)."""
        with self._lock:
            obj = self._nodefeatures[(namespace, name)]
            change(obj)
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self._record("nodefeatures", "MODIFIED", obj)

    def wait_for_nodefeatures(self, predicate: Callable[[list[dict[str, Any]]], bool],
                              timeout_s: float = 10.0) -> bool:
        """Block until ``predicate(self.nodefeatures())`` is true (re-checked on every write)."""
        import time

        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self.nodefeatures()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def _nfd_route(self, method: str, rest: list[str], query: dict[str, str],
                   body: bytes) -> tuple[int, Any]:
        if method == "GET" and not rest:
            return 200, _NFD_API_GROUP
        if rest[:1] != [NFD_VERSION]:
            raise ApiError(404, "the server could not find the requested resource")
        rest = rest[1:]
        if method == "GET" and not rest:
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{NFD_GROUP}/{NFD_VERSION}",
                         "resources": [{"name": "nodefeatures", "singularName": "nodefeature", "namespaced": True,
                                        "kind": "NodeFeature", "verbs": ["delete", "deletecollection", "get",
                                                                         "list", "patch", "create", "update",
                                                                         "watch"]}]}
        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] != "nodefeatures" or len(rest) > 4:
            raise ApiError(404, "the server could not find the requested resource")
        namespace, name = rest[1], (rest[3] if len(rest) == 4 else None)
        if name is None:
            if method == "GET" and query.get("watch") in ("true", "1"):
                return 200, self._watch("nodefeatures", query, copy.deepcopy)
            if method == "GET":
                items = [copy.deepcopy(o) for (ns, _), o in sorted(self._nodefeatures.items())
                         if ns == namespace and _selected(o, query)]
                return 200, {"kind": "NodeFeatureList", "apiVersion": f"{NFD_GROUP}/{NFD_VERSION}",
                             "metadata": {"resourceVersion": str(self._rv)}, "items": items}
            if method == "POST":
                return self._create_nodefeature(namespace, _json(body))
            raise ApiError(405, f"{method} not allowed on the collection")
        if method == "GET":
            return 200, copy.deepcopy(self._get_nodefeature(namespace, name))
        if method == "PUT":
            return self._update_nodefeature(namespace, name, _json(body))
        if method == "DELETE":
            return self._delete_nodefeature(namespace, name, _json(body) if body else {})
        raise ApiError(405, f"{method} is not served by the stand-in for nodefeatures")

    def _get_nodefeature(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self._nodefeatures.get((namespace, name))
        if obj is None:
            raise ApiError(404, f'nodefeatures.{NFD_GROUP} "{name}" not found',
                           name=name, group=NFD_GROUP, kind="nodefeatures")
        return obj

    def _check_nodefeature(self, namespace: str, obj: dict[str, Any]) -> None:
        """The CRD's structural schema: kind and apiVersion, a DNS-subdomain name, the URL's
        namespace, ``spec`` required, ``spec.labels`` a map of strings; unknown fields of
        ``spec`` are pruned (as the API server prunes fields the schema does not name)."""
        if obj.get("kind") != "NodeFeature" or obj.get("apiVersion") != f"{NFD_GROUP}/{NFD_VERSION}":
            raise ApiError(400, f"kind/apiVersion {obj.get('kind')}/{obj.get('apiVersion')} is not "
                                f"NodeFeature/{NFD_GROUP}/{NFD_VERSION}")
        meta = obj.setdefault("metadata", {})
        name = meta.get("name") or ""
        if meta.setdefault("namespace", namespace) != namespace:
            raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the request")
        causes = []
        if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
            causes.append(("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain must "
                                            "consist of lower case alphanumeric characters, '-' or '.'"))
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            causes.append(("spec", "Required value"))
        else:
            for key in set(spec) - {"features", "labels"}:
                del spec[key]
            labels = spec.get("labels", {})
            if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
                causes.append(("spec.labels", "Invalid value: must be a map of strings"))
        if causes:
            raise invalid("NodeFeature", NFD_GROUP, name, causes)

    def _create_nodefeature(self, namespace: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._check_nodefeature(namespace, obj)
        meta = obj["metadata"]
        name = meta["name"]
        if (namespace, name) in self._nodefeatures:
            raise ApiError(409, f'nodefeatures.{NFD_GROUP} "{name}" already exists', reason="AlreadyExists",
                           name=name, group=NFD_GROUP, kind="nodefeatures")
        self._admit("CREATE", None, obj)
        meta.update(uid=str(uuidlib.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now(),
                    generation=1)
        self._nodefeatures[(namespace, name)] = obj
        self._record("nodefeatures", "ADDED", obj)
        return 201, copy.deepcopy(obj)

    def _update_nodefeature(self, namespace: str, name: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._check_nodefeature(namespace, obj)
        meta = obj["metadata"]
        if meta.get("name") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        current = self._get_nodefeature(namespace, name)  # update does not create (AllowCreateOnUpdate false)
        rv = meta.get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise ApiError(409, f'Operation cannot be fulfilled on nodefeatures.{NFD_GROUP} "{name}": the object '
                                "has been modified; please apply your changes to the latest version and try again",
                           reason="Conflict", name=name, group=NFD_GROUP, kind="nodefeatures")
        self._admit("UPDATE", current, obj)
        changed = obj.get("spec") != current.get("spec")
        meta.update(uid=current["metadata"]["uid"], creationTimestamp=current["metadata"]["creationTimestamp"],
                    generation=current["metadata"].get("generation", 1) + (1 if changed else 0),
                    resourceVersion=self._next_rv())
        self._nodefeatures[(namespace, name)] = obj
        self._record("nodefeatures", "MODIFIED", obj)
        return 200, copy.deepcopy(obj)

    def _delete_nodefeature(self, namespace: str, name: str, options: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        current = self._get_nodefeature(namespace, name)
        pre = options.get("preconditions") or {}
        for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            want, have = pre.get(key), current["metadata"].get(key)
            if want and want != have:
                raise ApiError(409, f"Precondition failed: {label} in precondition: {want}, {label} in object meta: "
                                    f"{have}", reason="Conflict", name=name, group=NFD_GROUP, kind="nodefeatures")
        self._admit("DELETE", current, None)
        del self._nodefeatures[(namespace, name)]
        self._record("nodefeatures", "DELETED", current)
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": name, "group": NFD_GROUP, "kind": "nodefeatures",
                                 "uid": current["metadata"]["uid"]}}


# ----------------------------------------------------------------------------- issue 18 helpers
def invalid(kind: str, group: str, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """The API server's answer to an object validation refuses (``errors.NewInvalid``): 422,
    reason ``Invalid``, ``<Kind>.<group> "<name>" is invalid: <field>: <detail>, ...`` and
    ``details.causes`` with one ``{reason, message, field}`` per error."""
    message = f'{kind}.{group} "{name}" is invalid: ' + ", ".join(f"{f}: {d}" for f, d in causes)
    if len(causes) > 1:
        message = f'{kind}.{group} "{name}" is invalid: [' + ", ".join(f"{f}: {d}" for f, d in causes) + "]"
    reasons = {"Required value": "FieldValueRequired", "Too many": "FieldValueTooMany",
               "Duplicate value": "FieldValueDuplicate"}
    return ApiError(422, message, reason="Invalid", name=name, group=group, kind=kind, causes=[
        {"reason": next((r for p, r in reasons.items() if d.startswith(p)), "FieldValueInvalid"),
         "message": d, "field": f} for f, d in causes])


def request_attributes(user: Any, method: str, path: str, query: dict[str, str]) -> Attributes:
    """The authorizer's view of a request (``RequestInfoFactory.NewRequestInfo``)."""
    seg = [s for s in path.split("/") if s]
    if seg[:2] == ["api", "v1"]:
        group, rest = "", seg[2:]
    elif seg[:1] == ["apis"] and len(seg) >= 3:
        group, rest = seg[1], seg[3:]
    else:
        rest, group = [], ""
    namespace = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest:
        verb = {"GET": "get", "POST": "post", "PUT": "put", "DELETE": "delete"}.get(method, method.lower())
        return Attributes(user, verb, "", "", resource_request=False, path=path)
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else ""), (rest[2] if len(rest) > 2 else "")
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return Attributes(user, verb, group, resource, sub, namespace, name, True, path)


#: Feature gate -> what ``dropDisabledFields`` (pkg/registry/resource/resourceslice/strategy.go)
#: drops from a written slice while the gate is off and the old slice does not use it.
SLICE_FEATURE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # gate: (spec fields, fields of each device)
    "DRADeviceTaints": ((), ("taints",)),
    "DRAPartitionableDevices": (("sharedCounters", "perDeviceNodeSelection"),
                                ("consumesCounters", "nodeName", "nodeSelector", "allNodes")),
    "DRAConsumableCapacity": ((), ("allowMultipleAllocations",)),
    "DRADeviceBindingConditions": ((), ("bindingConditions", "bindingFailureConditions", "bindsToNode")),
}


def drop_disabled_slice_fields(disabled: frozenset[str], new: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Drop from ``new`` the fields of each disabled gate, unless ``old`` already uses them
    (an update keeps what the gate was on for)."""
    for gate in disabled & set(SLICE_FEATURE_FIELDS):
        spec_fields, device_fields = SLICE_FEATURE_FIELDS[gate]
        if _uses_fields(old, spec_fields, device_fields):
            continue
        spec = new.get("spec") or {}
        for f in spec_fields:
            spec.pop(f, None)
        for device in spec.get("devices") or []:
            for f in device_fields:
                device.pop(f, None)


def _uses_fields(obj: dict[str, Any] | None, spec_fields: tuple[str, ...], device_fields: tuple[str, ...]) -> bool:
    spec = (obj or {}).get("spec") or {}
    return any(spec.get(f) for f in spec_fields) or any(
        d.get(f) for d in spec.get("devices") or [] for f in device_fields)


class WatchStream:
    """One open watch (``?watch=true``), streamed by the HTTP handler outside the lock:
    without a resourceVersion (or "0") the current objects come first as ADDED; then every
    event after the resourceVersion, one JSON object per line. A resourceVersion older than
    the retained history (:meth:`ApiServerStub.compact`) gets one ERROR event with a 410
    ``Expired`` Status, as the real server answers. It ends at ``timeoutSeconds`` or at
    :meth:`ApiServerStub.end_watches`."""

    def __init__(self, stub: ApiServerStub, resource: str, since: int, query: dict[str, str],
                 render: Callable[[dict[str, Any]], dict[str, Any]], timeout_s: float, generation: int) -> None:
        self.stub, self.resource, self.since, self.query = stub, resource, since, query
        self.render, self.timeout_s, self.generation = render, timeout_s, generation

    def events(self) -> Iterable[dict[str, Any]]:
        import time

        deadline = time.monotonic() + self.timeout_s
        while True:
            batch, done = self._next_batch(deadline - time.monotonic())
            yield from batch  # written to the socket outside the lock
            if done:
                return

    def _next_batch(self, left_s: float) -> tuple[list[dict[str, Any]], bool]:
        """(events to send, whether the watch ends after them); waits up to ``left_s``."""
        stub = self.stub
        with stub._changed:
            if self.since == 0:
                self.since = stub._rv
                return [{"type": "ADDED", "object": self.render(o)}
                        for o in stub._current_of(self.resource) if _selected(o, self.query)], False
            if self.since < stub._compacted_rv:
                gone = ApiError(410, f"too old resource version: {self.since} ({stub._compacted_rv})",
                                reason="Expired")
                return [{"type": "ERROR", "object": gone.status()}], True
            for _ in range(2):
                if stub._server is None or stub._watch_generation != self.generation:
                    return [], True
                if left_s <= 0:  # the deadline: a bookmark first, when the client takes them
                    bookmarks = self.query.get("allowWatchBookmarks") in ("true", "1")
                    bookmark = {"type": "BOOKMARK", "object": self.render({"metadata": {"resourceVersion": str(stub._rv)}})}
                    return ([bookmark] if bookmarks else []), True
                pending = [e for e in stub._events if e[0] > self.since and e[1] == self.resource]
                if pending:
                    self.since = pending[-1][0]
                    return [{"type": kind, "object": self.render(obj)} for _, _, kind, obj in pending
                            if _selected(obj, self.query)], False
                stub._changed.wait(min(left_s, 0.5))
                left_s -= 0.5
            return [], False


def _selected(obj: dict[str, Any], query: dict[str, str]) -> bool:
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        key, _, want = term.partition("=")
        want = want.lstrip("=")
        value: Any = obj
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if str(value if value is not None else "") != want:
            return False
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, want = term.partition("=")
        if labels.get(key) != want.lstrip("="):
            return False
    return True


def _json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body or b"{}")
    except ValueError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body is not an object")
    return obj


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._open: set[Any] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        import socket

        with self._open_lock:
            for sock in list(self._open):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Handler(BaseHTTPRequestHandler):
    server_stub: ApiServerStub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet by design
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        code, payload = self.server_stub.handle(self.command, self.path, body,
                                                {"Authorization": self.headers.get("Authorization") or "",
                                                 "Content-Type": self.headers.get("Content-Type") or ""})
        if isinstance(payload, WatchStream):
            self._stream(payload)
            return
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, watch: WatchStream) -> None:
        """A watch response: chunked, one JSON event per line, ended by the last chunk."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in watch.events():
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve
