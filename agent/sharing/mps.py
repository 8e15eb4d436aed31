"""MPS (``sharing.mps``): the replicas of a GPU are clients of one MPS server, started by a
control daemon the agent supervises (:mod:`agent.sharing.mps_daemon`), as NVIDIA's device
plugin does.

- Checked on the node: MPS is refused, naming the GPU and the field, where it cannot run: a
  MIG device, a GPU NVML reports in compute mode Prohibited or Exclusive_Thread, a compute
  capability below 3.5 (:func:`mps_refusal`, which DRA claims asking for MPS meet too), or
  more replicas than the GPU's MPS server takes clients.
- A container's share gets what NVIDIA's plugin hands it, so CUDA in the pod finds the
  resource's control daemon: ``CUDA_MPS_PIPE_DIRECTORY`` and the pipe directory mounted
  there from ``<mpsRoot>/<resource>/pipe``, and ``<mpsRoot>/shm`` as ``/dev/shm``; plus the
  client limits matching the daemon's defaults (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), scaled by the replicas the container holds.
- Each MPS resource has a supervisor, its control daemon: the replicas are served while it
  answers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from agent.config import Config, TimeSlicingResource
from agent.containers import ContainerAdditions, ContainerDevice, Mount
from agent.errors import ConfigError
from agent.formats import GPU_RESOURCE
from agent.sharing.base import PlannedShare, Share, Supervisor
from agent.sharing.mps_daemon import MpsControlDaemon, MpsDaemonSpec
from agent.sharing.mps_paths import (
    MPS_CONTAINER_ROOT,
    MPS_SHM_PATH,
    mps_memory_limit_mib,
    mps_resource_dir,
    mps_shm_dir,
    mps_thread_percentage,
)
from agent.topology.model import Gpu, Topology

MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
#: MPS needs compute capability 3.5; its server takes 16 clients per GPU below 7.0 (Volta),
#: 48 from there on (nvidia-cuda-mps-control(1)).
MPS_MIN_COMPUTE_CAPABILITY = (3, 5)
MPS_MAX_CLIENTS = ((7, 0), 48, 16)


class Mps:
    """The MPS instance of :class:`agent.sharing.base.Sharing`."""

    strategy = "mps"
    section = "sharing.mps"

    def entries(self, config: Config) -> tuple[TimeSlicingResource, ...]:
        return config.mps

    def check(self, planned: Iterable[PlannedShare], topology: Topology, config: Config) -> None:
        where = config.config_file or "configuration"
        for p in planned:
            gpu, at = p.gpu, f"{where}: sharing.mps.resources[{p.entry}]"
            if p.mig is not None:
                raise ConfigError(
                    f"{at}: MPS cannot share MIG devices: GPU {gpu.index} is in MIG mode and"
                    f" migStrategy {config.mig_strategy} serves its MIG devices as {GPU_RESOURCE}"
                )
            why = mps_refusal(gpu)
            if why is not None:
                raise ConfigError(f"{at}: GPU {gpu.index} cannot run MPS: {why}")
            cc = gpu.compute_capability
            newer, many, few = MPS_MAX_CLIENTS
            limit = many if cc is None or cc >= newer else few
            if p.replicas > limit:
                raise ConfigError(
                    f"{at}.replicas: {p.replicas} is more MPS clients than GPU {gpu.index}'s MPS server"
                    f" accepts ({limit} per GPU{'' if cc is None else f' at compute capability {cc[0]}.{cc[1]}'})"
                )

    def capable(self, topology: Topology) -> bool:
        """GFD's ``mps.capable`` rule (no GPU in MIG mode) and NVML's word on the others: no
        GPU in compute mode Prohibited or below compute capability 3.5."""
        return not any(g.mig_enabled or mps_refusal(g) is not None for g in topology.gpus)

    def additions(self, share: Share, topology: Topology, devices: Sequence[ContainerDevice],
                  config: Config) -> ContainerAdditions | None:
        """The pipe directory, and the limits of the replicas held: per GPU, ``held`` times a
        replica's threads and memory; one thread percentage for the container (CUDA takes
        one), the smallest; memory by the device's CUDA ordinal in the container (its place
        in ``devices``)."""
        pipe = mps_resource_dir(MPS_CONTAINER_ROOT, share.resource, "pipe")
        envs = {MPS_PIPE_ENV: pipe}
        shares = [
            min(100, held * mps_thread_percentage(share.replicas[index]))
            for index, held in share.held.items() if held and index in share.replicas
        ]
        if shares:
            envs[MPS_THREAD_PERCENTAGE_ENV] = str(min(shares))
        limits = []
        for ordinal, device in enumerate(devices):
            index = device.gpu.index
            held, replicas = share.held.get(index, 0), share.replicas.get(index, 0)
            per_replica = mps_memory_limit_mib(topology.gpus[index], replicas) if held and replicas else None
            if per_replica is not None:
                limits.append(f"{ordinal}={held * per_replica}M")
        if limits:
            envs[MPS_MEMORY_LIMIT_ENV] = ",".join(limits)
        mounts = (Mount(pipe, mps_resource_dir(config.mps_root, share.resource, "pipe")),
                  Mount(MPS_SHM_PATH, mps_shm_dir(config.mps_root)))
        return ContainerAdditions(envs, mounts)

    def supervisor(self, resource: str, replicas: Mapping[int, int], topology: Topology, config: Config,
                   on_change: Callable[[], None], probe_s: float) -> Supervisor | None:
        spec = MpsDaemonSpec.for_resource(resource, replicas, topology)
        return MpsControlDaemon(spec, config.mps_root, config.mps_control_binary, on_change, probe_s=probe_s)

    def same_supervisor(self, running: Supervisor, wanted: Supervisor) -> bool:
        """The same GPUs, limits, root and program: its pods keep their MPS server."""
        return (isinstance(running, MpsControlDaemon) and isinstance(wanted, MpsControlDaemon)
                and (running.spec, running.mps_root, running.program) == (wanted.spec, wanted.mps_root, wanted.program))


def mps_refusal(gpu: Gpu) -> str | None:
    """Why NVML's word on ``gpu`` rules MPS out (compute mode Prohibited or Exclusive_Thread,
    compute capability below 3.5), or None. MPS runs in Default and Exclusive_Process only."""
    if gpu.compute_mode == "Prohibited":
        return ("NVML reports its compute mode Prohibited (no CUDA context can be made on it); set it to Default"
                " or Exclusive_Process (nvidia-smi -c) or leave it out of the devices")
    if gpu.compute_mode == "Exclusive_Thread":
        return ("NVML reports its compute mode Exclusive_Thread, in which no MPS server runs; set it to Default"
                " or Exclusive_Process (nvidia-smi -c) or leave it out of the devices")
    cc = gpu.compute_capability
    if cc is not None and cc < MPS_MIN_COMPUTE_CAPABILITY:
        return f"compute capability {cc[0]}.{cc[1]}, MPS needs 3.5 or newer"
    return None


MPS = Mps()
