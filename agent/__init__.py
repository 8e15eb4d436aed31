"""gpu-topology-agent: one Kubernetes node agent for GPU nodes.

Device plugin (kubelet v1beta1), GPU Feature Discovery-compatible labels and
dcgm-exporter-compatible metrics, all driven by one frozen view of the node's topology.
"""

__version__ = "0.1.0"
