"""Reading ResourceClaims from the API server, for NodePrepareResources.

:class:`ClaimReader` is what the kubelet plugin needs: one ``get(namespace, name)`` that
returns the claim as plain JSON data (the same shape in ``resource.k8s.io`` v1, v1beta2 and
v1beta1 for everything read here: ``metadata.uid`` and ``status.allocation.devices.results``).
:class:`KubernetesClaimReader` implements it with the official ``kubernetes`` client (built
by :func:`agent.kube.api_client`); the served version is discovered once, on first use
(``v1``, else ``v1beta2``, else ``v1beta1``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Protocol

from agent.errors import AgentError, shorten

log = logging.getLogger(__name__)

GROUP = "resource.k8s.io"
#: Versions we read, most preferred first.
VERSIONS = ("v1", "v1beta2", "v1beta1")


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
        versions: tuple[str, ...] = VERSIONS,
    ) -> None:
        from kubernetes import client

        self._api = client.CustomObjectsApi(api_client)
        self._apis = client.ApisApi(api_client)
        self.timeout_s = timeout_s
        self._versions = versions
        self._version: str | None = None
        self._lock = threading.Lock()
        self._count_error = count_error
        # the cause reads fail with now (None: they work); a leaf lock, never held to log
        self._failing: str | None = None
        self._failing_lock = threading.Lock()

    @property
    def version(self) -> str:
        """The ``resource.k8s.io`` version read (discovered on first use)."""
        with self._lock:
            if self._version is None:
                self._version = self._discover()
            return self._version

    def _discover(self) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            groups = self._apis.get_api_versions(_request_timeout=self.timeout_s)
        except ApiException as exc:
            raise ClaimReadError(f"API discovery failed: HTTP {exc.status} {shorten(exc.reason)}",
                                 f"HTTP {exc.status}") from None
        except Exception as exc:  # urllib3 connection errors
            raise ClaimReadError(f"API server unreachable: {_short(exc)}", "unreachable") from None
        served: list[str] = []
        for group in groups.groups or ():
            if group.name == GROUP:
                served = [v.version for v in group.versions or ()]
        for version in self._versions:
            if version in served:
                log.info("reading ResourceClaims as %s/%s", GROUP, version)
                return version
        raise ClaimReadError(
            f"the API server serves no {GROUP} version this agent reads "
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
        with self._failing_lock:
            new, self._failing = exc.cause != self._failing, exc.cause
        if new:
            log.warning(
                "cannot read ResourceClaims: %s (each claim read meanwhile fails the same way, counted in"
                " gpu_agent_claim_read_errors_total; the kubelet retries)", exc,
            )

    def _works(self) -> None:
        with self._failing_lock:
            was, self._failing = self._failing, None
        if was is not None:
            log.info("ResourceClaims are read again")

    def _read(self, namespace: str, name: str) -> Mapping[str, Any]:
        from kubernetes.client.exceptions import ApiException

        version = self.version
        claim = f"ResourceClaim {shorten(namespace)}/{shorten(name, 253)}"  # as the caller got them
        try:
            obj = self._api.get_namespaced_custom_object(
                GROUP, version, namespace, "resourceclaims", name, _request_timeout=self.timeout_s
            )
        except ApiException as exc:
            if exc.status == 404:
                raise ClaimNotFound(f"{claim} not found") from None
            raise ClaimReadError(f"reading {claim}: HTTP {exc.status} {shorten(exc.reason)}",
                                 f"HTTP {exc.status}") from None
        except Exception as exc:
            raise ClaimReadError(f"reading {claim}: {_short(exc)}", "unreachable") from None
        if not isinstance(obj, Mapping):
            raise ClaimReadError(f"reading {claim}: the answer is not an object", "not an object")
        return obj


def _short(exc: BaseException) -> str:
    """An exception from the client on one line, shortened (it may quote the request URL)."""
    return shorten(" ".join(str(exc).split()), 200)
