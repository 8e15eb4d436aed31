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
- ``/api/v1/nodes/<name>``: get, objects put in by the test (:meth:`add_node`);
- feature gates (``disabled_features``, upstream's gate names): with
  ``DRAPartitionableDevices`` off a written slice loses ``sharedCounters``,
  ``perDeviceNodeSelection`` and every device's ``consumesCounters`` / ``nodeName`` /
  ``nodeSelector`` / ``allNodes``, with ``DRADeviceTaints`` off every device's ``taints``,
  silently, unless the stored slice being updated already uses them (``dropDisabledFields``
  in ``pkg/registry/resource/resourceslice/strategy.go``). A device taint written without
  ``timeAdded`` gets the current time (the field is "added automatically during create or
  update if not set", ``k8s.io/api/resource/v1`` ``DeviceTaint``);
- failures on demand: :meth:`fail` answers matching requests with a ``Status`` error (403,
  500, ...), :meth:`go_down` / :meth:`come_up` close and reopen the listening socket on the same
  port (connection refused in between).

Errors are ``Status`` objects with ``code``, ``reason`` and ``message``, as the client expects.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid as uuidlib
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlsplit

GROUP = "resource.k8s.io"
ALL_VERSIONS = ("v1", "v1beta2", "v1beta1")
FEATURE_GATES = ("DRAPartitionableDevices", "DRADeviceTaints")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MAX_DEVICES = 128

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
        if self.details:
            body["details"] = self.details
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


class ApiServerStub:
    """Start with :meth:`start` (or as a context manager); point the client at :attr:`url`."""

    def __init__(self, served_versions: Iterable[str] = ALL_VERSIONS, *,
                 disabled_features: Iterable[str] = ()) -> None:
        self.served_versions = tuple(served_versions)
        unknown = set(self.served_versions) - set(ALL_VERSIONS)
        if unknown:
            raise ValueError(f"unknown resource.k8s.io versions {sorted(unknown)}")
        self.disabled_features = frozenset(disabled_features)
        if self.disabled_features - set(FEATURE_GATES):
            raise ValueError(f"unknown feature gates {sorted(self.disabled_features - set(FEATURE_GATES))}")
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

    def add_node(self, name: str, uid: str | None = None) -> str:
        """Add a Node object; returns its UID."""
        with self._lock:
            uid = uid or str(uuidlib.uuid4())
            self._nodes[name] = {
                "kind": "Node", "apiVersion": "v1",
                "metadata": {"name": name, "uid": uid, "resourceVersion": self._next_rv(),
                             "creationTimestamp": _now()},
                "spec": {}, "status": {},
            }
            return uid

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
            self._slices.pop(name)
            self._changed.notify_all()

    def modify_slice(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Change a stored slice as another writer would (bumps its resourceVersion)."""
        with self._lock:
            obj = self._slices[name]
            change(obj)
            obj["metadata"]["resourceVersion"] = self._next_rv()
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

    def handle(self, method: str, raw_path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        parts = urlsplit(raw_path)
        path = parts.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            self.requests.append(Request(method, path, parts.query))
            try:
                failure = self._injected(method, path)
                if failure is not None:
                    raise failure
                return self._route(method, path, query, body)
            except ApiError as exc:
                return exc.code, exc.status()

    def _route(self, method: str, path: str, query: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        seg = [s for s in path.split("/") if s]
        if method == "GET":
            if seg == ["version"]:
                return 200, {"major": "1", "minor": "34", "gitVersion": "v1.34.0-stub"}
            if seg == ["api"]:
                return 200, {"kind": "APIVersions", "versions": ["v1"],
                             "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
            if seg == ["api", "v1"]:
                return 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                    {"name": "nodes", "singularName": "node", "namespaced": False, "kind": "Node",
                     "verbs": ["get", "list"]}]}
            if seg == ["apis"]:
                groups = [self._group()] if self.served_versions else []
                return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
            if seg == ["apis", GROUP]:
                if not self.served_versions:
                    raise ApiError(404, "the server could not find the requested resource")
                return 200, {"kind": "APIGroup", "apiVersion": "v1", **self._group()}
            if len(seg) == 3 and seg[:2] == ["apis", GROUP]:
                self._version(seg[2])
                return 200, self._resource_list(seg[2])
            if len(seg) == 4 and seg[:3] == ["api", "v1", "nodes"]:
                node = self._nodes.get(seg[3])
                if node is None:
                    raise ApiError(404, f'nodes "{seg[3]}" not found', name=seg[3], kind="nodes")
                return 200, copy.deepcopy(node)
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
            if method == "GET":
                items = [self._as_version(o, version) for k, o in sorted(self._slices.items())
                         if _selected(o, query)]
                return 200, {"kind": "ResourceSliceList", "apiVersion": f"{GROUP}/{version}",
                             "metadata": {"resourceVersion": str(self._rv)}, "items": items}
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
            del self._slices[name]
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

    def _create_slice(self, version: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._check_slice(version, obj)
        self._drop_disabled(obj, None)
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
        meta["resourceVersion"] = self._next_rv()
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        self._slices[name] = obj
        self._changed.notify_all()
        return 201, self._as_version(obj, version)

    def _update_slice(self, version: str, name: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._check_slice(version, obj)
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
        self._drop_disabled(obj, current)
        meta["uid"] = current["metadata"]["uid"]
        meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]
        changed = obj["spec"] != current["spec"]
        meta["generation"] = current["metadata"]["generation"] + (1 if changed else 0)
        meta["resourceVersion"] = self._next_rv()
        self._slices[name] = obj
        self._changed.notify_all()
        return 200, self._as_version(obj, version)

    def _drop_disabled(self, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """``dropDisabledFields`` of the slice strategy, then the taints' ``timeAdded``."""
        spec = obj.get("spec") or {}
        old_devices = [_device_body(d) for d in ((old or {}).get("spec") or {}).get("devices") or ()]
        devices = [_device_body(d) for d in spec.get("devices") or ()]
        if "DRADeviceTaints" in self.disabled_features and not any(d.get("taints") for d in old_devices):
            for d in devices:
                d.pop("taints", None)
        partitionable = ("consumesCounters", "nodeName", "nodeSelector", "allNodes")
        old_spec = (old or {}).get("spec") or {}
        in_use = bool(old_spec.get("sharedCounters") or old_spec.get("perDeviceNodeSelection")
                      or any(d.get(k) for d in old_devices for k in partitionable))
        if "DRAPartitionableDevices" in self.disabled_features and not in_use:
            spec.pop("sharedCounters", None)
            spec.pop("perDeviceNodeSelection", None)
            for d in devices:
                for k in partitionable:
                    d.pop(k, None)
        for d in devices:
            for t in d.get("taints") or ():
                t.setdefault("timeAdded", _now())

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


def _device_body(device: dict[str, Any]) -> dict[str, Any]:
    """A device's fields (inside ``basic`` in v1beta1)."""
    return device.get("basic") or device


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
        code, payload = self.server_stub.handle(self.command, self.path, body)
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve
