"""What the device plugin reports as it serves: the agent's self-metrics implement this
(:class:`agent.metrics.self_metrics.AgentMetrics`, built before the device plugin and passed
to its constructor; the daemon's call is where mypy checks that it fits).

Every method is called from a serving thread (gRPC workers, the kubelet watch) and must be
cheap and never block: no I/O.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class DevicePluginEvents(Protocol):
    """The device plugin's events, as the self-metrics count them."""

    def registration(self, resource: str) -> None:
        """``resource`` was registered with the kubelet."""
        ...

    def kubelet_restart(self) -> None:
        """The kubelet's socket was re-created (a restarted kubelet)."""
        ...

    def registration_failure(self, resource: str) -> None:
        """A registration of ``resource`` with the kubelet failed (it is retried)."""
        ...

    def stream_refused(self, resource: str) -> None:
        """A ListAndWatch stream of ``resource`` was refused: the streams' cap was reached."""
        ...

    def observe_preferred_allocation(self, seconds: float) -> None:
        """One GetPreferredAllocation call took ``seconds`` to answer."""
        ...

    def devices_offered(self, offers: Sequence[tuple[str, str, bool]]) -> None:
        """The kubelet is offered exactly ``offers`` now: (resource, device ID, healthy) each,
        the whole table, reported whenever it changes."""
        ...
