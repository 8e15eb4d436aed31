"""Pod attribution: which container holds which GPU, and which pod each GPU process is of.

Two sources, one record (:class:`ContainerRef`, the unit per-pod series are told by):

- :mod:`agent.attribution.holders`: the kubelet's pod-resources API (the devices allocated to
  each container), refreshed on its own timer into an immutable ``Attribution``;
- :mod:`agent.attribution.pod_processes`: the processes NVML lists on each GPU, mapped to
  containers through their cgroups (:mod:`agent.attribution.cgroups`, under the host's
  ``/proc``) and the runtime's CRI API.

The metrics (:mod:`agent.metrics`) read both; nothing here renders a metric.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ContainerRef:
    """A container of a pod, the unit GPU series are attributed to."""

    namespace: str
    pod: str
    container: str
