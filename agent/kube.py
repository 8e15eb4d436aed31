"""The one API-server client builder: every conversation the agent has with the API server
(reading ResourceClaims, publishing ResourceSlices, keeping the NodeFeature of the label
sink, writing the Node's GPUHealthy condition and Events) goes through a client built here,
from ``--kubeconfig`` or, when it is unset, the pod's in-cluster service account
(``KUBERNETES_SERVICE_HOST`` and the mounted token).

:class:`CustomObjects` is the small door the label sink uses for one kind of namespaced
custom object (``CustomObjectsApi``): plain JSON data in and out, 404 as None, every other
failure one :class:`ApiCallError` with the server's status code, reason and message;
:class:`CoreObjects` the same for the Node health publisher's ``core/v1`` requests.

:func:`call` is that idiom for every other caller (the ResourceClaim reader, the
ResourceSlice publisher, the node-label watch): one client method, JSON data or None for a
404, else one :class:`ApiCallError` whose ``state`` is stable across retries of the same
failure. :func:`resource_versions` is the one ``resource.k8s.io`` discovery and
:func:`server_version` the one ``/version`` probe; :data:`RESOURCE_GROUP` and
:data:`RESOURCE_VERSIONS` name the DRA API once.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Collection

from agent.config import Config
from agent.errors import AgentError, ConfigError, shorten

#: The DRA API group and the versions the agent speaks, most preferred first.
RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSIONS = ("v1", "v1beta2", "v1beta1")

#: Where the kubelet mounts the service account's namespace beside its token.
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _in_cluster_missing(environ: Any) -> str | None:
    """Why the in-cluster configuration cannot load, by the first checks of kubernetes'
    ``InClusterConfigLoader`` (the service's host and port variables); None: it may."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if host is None or port is None:
        return "Service host/port is not set."
    if not host or not port:
        return "Service host/port is set but empty."
    return None


def api_client(config: Config) -> Any:
    """A ``kubernetes.client.ApiClient`` from ``config.kubeconfig``, or the in-cluster
    configuration when it is empty. Raises ConfigError naming what is wrong.

    The client does not retry on its own: every caller already does, in its own loop (the
    slice publisher with backoff, the label sink at its next re-assertion; the kubelet calls
    NodePrepareResources again), and
    urllib3's retries would each log a warning of their own (three per request with the
    API server down) and hold the caller meanwhile. Callers log one line per change of
    state instead.

    Without ``--kubeconfig`` and without the service's host and port in the environment (not
    in a pod), it fails before importing the client library, as its in-cluster loader would:
    that import takes a second or more on a busy node, and a node-local agent asks here at
    start whether it has an API server at all."""
    if not config.kubeconfig and (missing := _in_cluster_missing(os.environ)):
        raise ConfigError(f"no --kubeconfig given and no in-cluster configuration ({missing}); "
                          "run in a pod with a service account or pass --kubeconfig FILE")
    from kubernetes import client
    from kubernetes import config as kube_config

    configuration = client.Configuration()
    if config.kubeconfig:
        try:
            kube_config.load_kube_config(config_file=config.kubeconfig, client_configuration=configuration)
        except Exception as exc:  # the loader raises ConfigException, OSError, yaml errors
            raise ConfigError(f"--kubeconfig {config.kubeconfig}: cannot load: {exc}") from None
    else:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except Exception as exc:
            raise ConfigError(
                f"no --kubeconfig given and no in-cluster configuration ({exc}); "
                "run in a pod with a service account or pass --kubeconfig FILE"
            ) from None
    configuration.retries = False
    return client.ApiClient(configuration)


def own_namespace(config: Config, namespace_file: str = SERVICE_ACCOUNT_NAMESPACE_FILE) -> str:
    """The agent's namespace: ``config.pod_namespace`` (``POD_NAMESPACE`` from the downward
    API), else the service account's namespace file. ConfigError when neither says."""
    if config.pod_namespace:
        return config.pod_namespace
    try:
        with open(namespace_file, encoding="utf-8") as f:
            namespace = f.read(254).strip()
    except OSError as exc:
        raise ConfigError(
            f"the agent's namespace is unknown: set --pod-namespace or POD_NAMESPACE (the downward"
            f" API's metadata.namespace); {namespace_file}: {exc.strerror or exc}"
        ) from None
    if not namespace:
        raise ConfigError(f"the agent's namespace is unknown: {namespace_file} is empty; set POD_NAMESPACE")
    return namespace


class ApiCallError(AgentError):
    """An API request that did not succeed. ``status`` is the HTTP status (None: the server
    was not reached); ``reason`` and ``detail`` what the server (or the connection) said;
    ``state`` is stable across retries of the same failure (for logging once per change)."""

    def __init__(self, what: str, status: int | None, reason: str, message: str) -> None:
        where = f"HTTP {status} {reason}" if status is not None else f"API server unreachable ({reason})"
        self.detail = shorten(message, 600)
        super().__init__(f"{what}: {where}: {self.detail}")
        self.status = status
        self.reason = reason
        self.state = f"{status} {reason}" if status is not None else f"unreachable {reason}"


class _LazyApi:
    """A client built on first use by ``client_factory`` and dropped after a connection
    failure, and the requests of one kubernetes API class (``API``) through :func:`call`: each
    waits at most ``timeout_s``, every failure is one :class:`ApiCallError`."""

    API = "CustomObjectsApi"

    def __init__(self, client_factory: Callable[[], Any], *, timeout_s: float = 5.0) -> None:
        self._client_factory = client_factory
        self.timeout_s = timeout_s
        self._client: Any = None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a pool must not fail a shutdown
                pass

    def _call(self, what: str, method: str, *args: Any, missing_ok: bool = True,
              **kwargs: Any) -> dict[str, Any] | None:
        from kubernetes import client

        if self._client is None:
            try:
                self._client = self._client_factory()
            except Exception as exc:  # ConfigError: the kubeconfig or in-cluster files changed
                raise ApiCallError(what, None, type(exc).__name__, f"cannot configure the client: {exc}") from None
        method_of = getattr(getattr(client, self.API)(self._client), method)
        return call(what, method_of, *args, missing_ok=missing_ok, timeout_s=self.timeout_s,
                    on_unreachable=self.close, **kwargs)


class CustomObjects(_LazyApi):
    """Namespaced custom objects of one kind (``group``/``version``/``plural``). The client
    is built on first use by ``client_factory`` and dropped after a connection failure; each
    request waits at most ``timeout_s`` (callers on the daemon's main thread: a stop must not
    wait long behind an API server that does not answer)."""

    def __init__(self, client_factory: Callable[[], Any], group: str, version: str, plural: str,
                 *, timeout_s: float = 5.0) -> None:
        super().__init__(client_factory, timeout_s=timeout_s)
        self.group, self.version, self.plural = group, version, plural

    @classmethod
    def from_config(cls, config: Config, group: str, version: str, plural: str) -> CustomObjects:
        """Through :func:`api_client` (no client-side retries: callers retry in their loop).
        The client is built at once, so a bad ``--kubeconfig`` fails here (ConfigError)."""
        objects = cls(lambda: api_client(config), group, version, plural)
        objects._client = objects._client_factory()
        return objects

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(f"read {self.plural} {namespace}/{name}", "get_namespaced_custom_object",
                          self.group, self.version, namespace, self.plural, name)

    def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST ``body``; a 404 (no such API: the CRD is not installed) is an ApiCallError."""
        name = body.get("metadata", {}).get("name", "")
        return self._call(f"create {self.plural} {namespace}/{name}", "create_namespaced_custom_object",
                          self.group, self.version, namespace, self.plural, body, missing_ok=False)

    def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """PUT ``body``; its ``metadata.resourceVersion`` makes it conditional (409 if stale)."""
        return self._call(f"update {self.plural} {namespace}/{name}", "replace_namespaced_custom_object",
                          self.group, self.version, namespace, self.plural, name, body)

    def delete(self, namespace: str, name: str, *, resource_version: str | None = None) -> bool:
        """DELETE, only if the object still has ``resource_version`` when given (409 if not);
        False if it was already gone."""
        from kubernetes import client

        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=resource_version) if resource_version else None)
        done = self._call(f"delete {self.plural} {namespace}/{name}", "delete_namespaced_custom_object",
                          self.group, self.version, namespace, self.plural, name, body=options)
        return done is not None



class CoreObjects(_LazyApi):
    """The ``core/v1`` requests of the Node health publisher (its Node's status, Events on it),
    as :class:`CustomObjects` is for custom objects: the client built on first use by
    ``client_factory`` and dropped after a connection failure, every failure one
    :class:`ApiCallError`. Patches are strategic merge patches (the Node status's
    ``conditions`` merge by ``type``)."""

    API = "CoreV1Api"
    SMP = "application/strategic-merge-patch+json"

    def read_node_status(self, name: str) -> dict[str, Any]:
        return self._call(f"read Node {name} status", "read_node_status", name, missing_ok=False) or {}

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._call(f"patch Node {name} status", "patch_node_status", name, patch, missing_ok=False,
                          _content_type=self.SMP) or {}

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("metadata", {}).get("name", "")
        return self._call(f"create Event {namespace}/{name}", "create_namespaced_event", namespace, body,
                          missing_ok=False) or {}

    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """None when the Event is gone (404)."""
        return self._call(f"patch Event {namespace}/{name}", "patch_namespaced_event", name, namespace, patch,
                          _content_type=self.SMP)

    def read_event(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(f"read Event {namespace}/{name}", "read_namespaced_event", name, namespace)



def call(what: str, method: Callable[..., Any], *args: Any, missing_ok: bool = True, timeout_s: float = 10.0,
         on_unreachable: Callable[[], None] | None = None, **kwargs: Any) -> dict[str, Any] | None:
    """Run one ``kubernetes`` client ``method``: the answer as JSON data (``{}`` for an empty
    one), None for a 404 when ``missing_ok``; any other failure is an :class:`ApiCallError`
    (``status`` None: the server was not reached, after which ``on_unreachable()`` runs: a
    caller drops its connection pool there)."""
    from kubernetes.client.exceptions import ApiException

    try:
        resp = method(*args, _preload_content=False, _request_timeout=timeout_s, **kwargs)
    except ApiException as exc:
        if exc.status == 404 and missing_ok:
            return None
        reason, message = _status_of(exc)
        raise ApiCallError(what, exc.status, reason, message) from None
    except Exception as exc:  # urllib3 connection errors, timeouts, TLS
        if on_unreachable is not None:
            on_unreachable()
        raise ApiCallError(what, None, type(exc).__name__, " ".join(str(exc).split())) from None
    try:
        out = json.loads(resp.data) if resp.data else {}
    except ValueError as exc:
        raise ApiCallError(what, resp.status, "BadResponse", f"the answer is not JSON: {exc}") from None
    return out if isinstance(out, dict) else {}


def resource_versions(client_: Any, timeout_s: float = 10.0) -> list[str]:
    """The ``resource.k8s.io`` versions the API server serves (discovery of the group;
    none when the group is not served). ApiCallError when it cannot be asked."""
    from kubernetes import client

    group = call(f"discovery of {RESOURCE_GROUP}", client.ResourceApi(client_).get_api_group, timeout_s=timeout_s)
    return [str(v.get("version")) for v in (group or {}).get("versions", []) if isinstance(v, dict)]


def pick_version(served: Collection[str]) -> str | None:
    """The first of :data:`RESOURCE_VERSIONS` that is served."""
    return next((v for v in RESOURCE_VERSIONS if v in served), None)


def server_version(client_: Any, timeout_s: float = 10.0) -> tuple[int, int] | None:
    """(major, minor) of the API server, from ``/version`` (``minor`` may carry a ``+``, as
    managed clusters spell it; ``gitVersion`` ``v1.37.0-alpha.2`` is read when they do not
    say); None when the answer says neither. ApiCallError when it cannot be asked."""
    from kubernetes import client

    info = call("read /version", client.VersionApi(client_).get_code, timeout_s=timeout_s) or {}
    return parse_server_version(str(info.get("major", "")), str(info.get("minor", "")),
                                str(info.get("gitVersion", "")))


def parse_server_version(major: str, minor: str, git_version: str = "") -> tuple[int, int] | None:
    """(major, minor) from ``/version``'s fields, or None."""
    m, n = major.strip(), minor.strip().rstrip("+")
    if m.isdigit() and n.isdigit():
        return int(m), int(n)
    found = re.match(r"^v?(\d+)\.(\d+)(?:[.+-]|$)", git_version.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def _status_of(exc: Any) -> tuple[str, str]:
    """(reason, message) of the ``Status`` the API server answered with."""
    try:
        body = json.loads(exc.body)
        return str(body.get("reason") or exc.reason), str(body.get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason), str(exc.reason)
