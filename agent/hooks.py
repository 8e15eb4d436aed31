"""What the device plugin reports to the agent's own metrics (``gpu_agent_*``).

A leaf module (it imports nothing of ours): the device-plugin layer may not import
``agent.metrics``, and the metrics layer implements these hooks
(:class:`agent.metrics.self_metrics.AgentMetrics`, checked by mypy because it subclasses
:class:`DevicePluginHooks`). Components hold a hooks object, never ``None``: until the
metrics service is up they hold :data:`NO_HOOKS`. A typo in a hook name is a type error,
not a metric that silently stays at zero.

Every hook is called from a serving thread (gRPC workers, the kubelet watch, the health
watcher's listeners) and must be cheap and never block: no I/O.
"""

from __future__ import annotations

from typing import Protocol


class DevicePluginHooks(Protocol):
    """The device plugin's events, as the self-metrics count them."""

    def registration(self, resource: str) -> None:
        """``resource`` was registered with the kubelet."""
        ...

    def kubelet_restart(self) -> None:
        """The kubelet's socket was re-created (a restarted kubelet)."""
        ...

    def set_device_health(self, resource: str, device_id: str, healthy: bool) -> None:
        """``device_id`` of ``resource`` is now advertised healthy (True) or unhealthy."""
        ...

    def observe_preferred_allocation(self, seconds: float) -> None:
        """One GetPreferredAllocation call took ``seconds`` to answer."""
        ...


class NoHooks:
    """Reports nothing: the hooks before (or without) a metrics service."""

    def registration(self, resource: str) -> None:
        pass

    def kubelet_restart(self) -> None:
        pass

    def set_device_health(self, resource: str, device_id: str, healthy: bool) -> None:
        pass

    def observe_preferred_allocation(self, seconds: float) -> None:
        pass


#: The shared no-op instance (it holds no state).
NO_HOOKS: DevicePluginHooks = NoHooks()
