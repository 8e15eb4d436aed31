"""DCGM-compatible GPU metrics and the agent's own: the sampler (one thread polling NVML into
immutable snapshots), the collector rendering a snapshot and the pods' attribution
(:mod:`agent.attribution`) as Prometheus families, the field table, the self-metrics, and
the service that runs them behind the HTTP side (:mod:`agent.http`)."""
