"""Where an MPS resource's control daemon and its clients meet, and what one replica's share
is, defined once for the daemon's supervisor and for what a container gets (NVIDIA's
device plugin's paths and defaults)."""

from __future__ import annotations

import os

from agent.topology.model import Gpu

#: Where NVIDIA's plugin puts a resource's MPS pipe directory in the container (its
#: ``ContainerRoot``), and the shared memory the MPS server and its clients use.
MPS_CONTAINER_ROOT = "/mps"
MPS_SHM_PATH = "/dev/shm"


def mps_resource_dir(root: str, resource: str, kind: str) -> str:
    """``<root>/<resource>/<kind>``: a resource's MPS ``pipe`` or ``log`` directory (the
    resource name keeps its domain: ``/run/nvidia/mps/nvidia.com/gpu/pipe``)."""
    return os.path.join(root, resource, kind)


def mps_shm_dir(root: str) -> str:
    """The shared-memory directory every MPS resource's pods mount as ``/dev/shm``."""
    return os.path.join(root, "shm")


def mps_thread_percentage(replicas: int) -> int:
    """A replica's share of the GPU's threads: ``100 / replicas`` (whole percent), as
    NVIDIA's MPS daemon sets the default active-thread percentage."""
    return max(1, 100 // replicas)


def mps_memory_limit_mib(gpu: Gpu, replicas: int) -> int | None:
    """A replica's pinned device memory: the GPU's memory / replicas (MiB, rounded down, as
    NVIDIA's MPS daemon sets it); None when the memory is not known."""
    return gpu.memory_mib // replicas if gpu.memory_mib else None
