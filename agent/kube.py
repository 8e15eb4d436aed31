"""The one API-server client builder: every conversation the agent has with the API server
(reading ResourceClaims, publishing ResourceSlices, keeping the NodeFeature of the label
sink) goes through a client built here, from ``--kubeconfig`` or, when it is unset, the pod's
in-cluster service account (``KUBERNETES_SERVICE_HOST`` and the mounted token).

:class:`CustomObjects` is the small door the label sink uses for one kind of namespaced
custom object (``CustomObjectsApi``): plain JSON data in and out, 404 as None, every other
failure one :class:`ApiCallError` with the server's status code, reason and message.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from agent.config import Config
from agent.errors import AgentError, ConfigError, shorten

#: Where the kubelet mounts the service account's namespace beside its token.
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def api_client(config: Config) -> Any:
    """A ``kubernetes.client.ApiClient`` from ``config.kubeconfig``, or the in-cluster
    configuration when it is empty. Raises ConfigError naming what is wrong.

    The client does not retry on its own: every caller already does, in its own loop (the
    slice publisher with backoff, the label sink at its next re-assertion; the kubelet calls
    NodePrepareResources again), and
    urllib3's retries would each log a warning of their own (three per request with the
    API server down) and hold the caller meanwhile. Callers log one line per change of
    state instead."""
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
    was not reached); ``state`` is stable across retries of the same failure (for logging
    once per change)."""

    def __init__(self, what: str, status: int | None, reason: str, message: str) -> None:
        where = f"HTTP {status} {reason}" if status is not None else f"API server unreachable ({reason})"
        super().__init__(f"{what}: {where}: {shorten(message, 600)}")
        self.status = status
        self.reason = reason
        self.state = f"{status} {reason}" if status is not None else f"unreachable {reason}"


class CustomObjects:
    """Namespaced custom objects of one kind (``group``/``version``/``plural``). The client
    is built on first use by ``client_factory`` and dropped after a connection failure; each
    request waits at most ``timeout_s`` (callers on the daemon's main thread: a stop must not
    wait long behind an API server that does not answer)."""

    def __init__(self, client_factory: Callable[[], Any], group: str, version: str, plural: str,
                 *, timeout_s: float = 5.0) -> None:
        self._client_factory = client_factory
        self.group, self.version, self.plural = group, version, plural
        self.timeout_s = timeout_s
        self._client: Any = None

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
        from kubernetes.client.exceptions import ApiException

        if self._client is None:
            try:
                self._client = self._client_factory()
            except Exception as exc:  # ConfigError: the kubeconfig or in-cluster files changed
                raise ApiCallError(what, None, type(exc).__name__, f"cannot configure the client: {exc}") from None
        api = client.CustomObjectsApi(self._client)
        try:
            resp = getattr(api, method)(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
        except ApiException as exc:
            if exc.status == 404 and missing_ok:
                return None
            reason, message = _status_of(exc)
            raise ApiCallError(what, exc.status, reason, message) from None
        except Exception as exc:  # urllib3 connection errors, timeouts, TLS
            self.close()
            raise ApiCallError(what, None, type(exc).__name__, str(exc)) from None
        try:
            out = json.loads(resp.data) if resp.data else {}
        except ValueError as exc:
            raise ApiCallError(what, resp.status, "BadResponse", f"the answer is not JSON: {exc}") from None
        return out if isinstance(out, dict) else {}


def _status_of(exc: Any) -> tuple[str, str]:
    """(reason, message) of the ``Status`` the API server answered with."""
    try:
        body = json.loads(exc.body)
        return str(body.get("reason") or exc.reason), str(body.get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason), str(exc.reason)
