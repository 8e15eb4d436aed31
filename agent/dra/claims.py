"""Reading ResourceClaims from the API server, for NodePrepareResources.

:class:`ClaimReader` is what the kubelet plugin needs: one ``get(namespace, name)`` that
returns the claim as plain JSON data (the same shape in ``resource.k8s.io`` v1, v1beta2 and
v1beta1 for everything read here: ``metadata.uid`` and ``status.allocation.devices.results``).
:class:`KubernetesClaimReader` implements it with the official ``kubernetes`` client (built
by :func:`agent.kube.api_client`, called through :func:`agent.kube.call`); the served
version is discovered once, on first use (:func:`agent.kube.resource_versions`: ``v1``, else
``v1beta2``, else ``v1beta1``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Protocol

from agent.errors import AgentError, shorten
from agent.kube import RESOURCE_GROUP, RESOURCE_VERSIONS, ApiCallError, call, resource_versions
from agent.retry import Outage

log = logging.getLogger(__name__)


class ClaimNotFound(AgentError):
    """The API server has no such ResourceClaim (404)."""


class ClaimReadError(AgentError):
    """The claim could not be read: API server unreachable, forbidden, no DRA API, ...
    ``cause`` names what fails without naming the claim (every claim read while the API
    server is down fails the same way: one state, said once)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class ClaimReader(Protocol):
    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The ResourceClaim as JSON data; raises ClaimNotFound or ClaimReadError."""
        ...


class KubernetesClaimReader:
    """:class:`ClaimReader` over the official client. ``timeout_s`` bounds each request.

    Reads that fail are one state per cause, not one log line per claim: the first failure
    of a cause is logged (the API server unreachable, an HTTP status), the next ones only
    counted (``count_error``, once per claim that could not be read: the agent's
    ``gpu_agent_claim_read_errors_total``), and the first read that works again says so.
    Each claim's own error still goes to the kubelet. The client must not retry on its own
    (:func:`agent.kube.api_client`): the kubelet retries NodePrepareResources.
    """

    def __init__(
        self,
        api_client: Any,
        *,
        count_error: Callable[[], None] | None = None,
        timeout_s: float = 5.0,
        versions: tuple[str, ...] = RESOURCE_VERSIONS,
    ) -> None:
        from kubernetes import client

        self._client = api_client
        self._api = client.CustomObjectsApi(api_client)
        self.timeout_s = timeout_s
        self._versions = versions
        self._version: str | None = None
        self._lock = threading.Lock()
        self._count_error = count_error
        # the cause reads fail with now, said once per cause; guarded by a leaf lock (held
        # while the Outage logs: logging never calls back into this reader)
        self._outage = Outage(log, "reading ResourceClaims", per_reason=True, retrying=(
            "each claim read meanwhile fails the same way, counted in gpu_agent_claim_read_errors_total;"
            " the kubelet retries"))
        self._outage_lock = threading.Lock()

    @property
    def version(self) -> str:
        """The ``resource.k8s.io`` version read (discovered on first use)."""
        with self._lock:
            if self._version is None:
                self._version = self._discover()
            return self._version

    def _discover(self) -> str:
        try:
            served = resource_versions(self._client, self.timeout_s)
        except ApiCallError as exc:
            raise ClaimReadError(str(exc), _cause(exc)) from None
        for version in self._versions:
            if version in served:
                log.info("reading ResourceClaims as %s/%s", RESOURCE_GROUP, version)
                return version
        raise ClaimReadError(
            f"the API server serves no {RESOURCE_GROUP} version this agent reads "
            f"(served: {shorten(', '.join(served), 200) or 'none'};"
            f" expected one of {', '.join(self._versions)});"
            " is DynamicResourceAllocation enabled?",
            "no DRA API",
        )

    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            obj = self._read(namespace, name)
        except ClaimReadError as exc:
            self._fails(exc)
            raise
        except ClaimNotFound:
            self._works()  # the API server answered
            raise
        self._works()
        return obj

    def _fails(self, exc: ClaimReadError) -> None:
        if self._count_error is not None:
            self._count_error()
        with self._outage_lock:
            self._outage.failed(str(exc), key=exc.cause)

    def _works(self) -> None:
        with self._outage_lock:
            self._outage.recovered()

    def _read(self, namespace: str, name: str) -> Mapping[str, Any]:
        version = self.version
        claim = f"ResourceClaim {shorten(namespace)}/{shorten(name, 253)}"  # as the caller got them
        try:
            obj = call(f"reading {claim}", self._api.get_namespaced_custom_object, RESOURCE_GROUP, version,
                       namespace, "resourceclaims", name, timeout_s=self.timeout_s)
        except ApiCallError as exc:
            raise ClaimReadError(str(exc), _cause(exc)) from None
        if obj is None:
            raise ClaimNotFound(f"{claim} not found")
        return obj


def _cause(exc: ApiCallError) -> str:
    """What fails, without naming the claim: one state for every claim read meanwhile."""
    return "unreachable" if exc.status is None else f"HTTP {exc.status}"
