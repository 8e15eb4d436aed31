"""CDI (Container Device Interface) specs for prepared claims: one JSON file per claim.

The container runtime reads every ``*.json`` in the CDI directory; the kubelet passes it the
fully-qualified device names we return from NodePrepareResources (``<vendor>/<class>=<name>``).
Per claim we write ``<cdi_dir>/<vendor>-claim_<claim uid>.json`` with

- one CDI device per allocated device, named ``<claim uid>-<device name>``, holding its
  device nodes (``/dev/nvidiaN``, a MIG device's ``/dev/nvidia-caps/nvidia-capN``; a GPU
  set's device holds the nodes of every member GPU);
- spec-wide container edits, applied whenever any device of the claim is injected: the
  control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ... where they exist),
  ``NVIDIA_VISIBLE_DEVICES`` (a dynamic MIG device by its UUID whatever ``deviceIDStrategy``
  says: its NVML index is not known before the topology is read again; and
  ``NVIDIA_IMEX_CHANNELS`` with the channels' nodes) and
  the agent's ``GPU_TOPOLOGY_*`` variables for the claim's whole device set; and the
  claim's NCCL topology file (``<nccl.hostDir>/claim-<uid>.xml``, its GPUs and their nearest
  NICs) mounted read-only with ``NCCL_TOPO_FILE`` naming it, removed with the spec.

The facts come from :func:`agent.containers.container_facts`, which the device plugin's
Allocate renders too, so both modes hand a container the same device nodes and environment
for the same GPUs. Files are written atomically (:func:`agent.files.write_json_atomic`), so
the runtime never reads half a spec.
"""

from __future__ import annotations

import os
import re
from typing import Any, Collection, Mapping, Sequence

from agent.config import Config
from agent.containers import (
    IMEX_CHANNELS_ENV,
    VISIBLE_DEVICES_ENV,
    ContainerAdditions,
    ContainerFacts,
    DeviceNode,
    Mount,
    container_facts,
    nccl_additions,
)
from agent.dra.devices import DeviceRef, parse_mig_slot_name
from agent.files import remove_file, remove_stale_temps, write_json_atomic
from agent.nccl.host_dir import NcclFile, NcclFiles, claim_key
from agent.topology.model import Topology

#: The CDI spec version written: 0.6.0 is read by containerd >= 1.7 and CRI-O >= 1.28 and
#: has everything used here (env, deviceNodes with hostPath and permissions).
CDI_VERSION = "0.6.0"
#: The CDI class of our devices; the vendor is the driver name.
CDI_CLASS = "gpu"

_CDI_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.:-]*$")
def cdi_kind(driver_name: str) -> str:
    """``<vendor>/<class>``: ``gpu.gpu-agent.io/gpu``."""
    return f"{driver_name}/{CDI_CLASS}"


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    return f"{claim_uid}-{device_name}"


def cdi_device_id(driver_name: str, claim_uid: str, device_name: str) -> str:
    """The fully-qualified CDI device name the kubelet hands the runtime."""
    return f"{cdi_kind(driver_name)}={cdi_device_name(claim_uid, device_name)}"


def spec_path(cdi_dir: str, driver_name: str, claim_uid: str) -> str:
    """Where a claim's spec lives; a pure function of the UID, so an unprepare finds it
    even without the checkpoint."""
    return os.path.join(cdi_dir, f"{_spec_prefix(driver_name)}{claim_uid}.json")


def _spec_prefix(driver_name: str) -> str:
    return f"{driver_name}-claim_"


def remove_stale_spec_temps(cdi_dir: str, driver_name: str) -> int:
    """Remove the temp files of this driver's claim specs that writes the agent was killed in
    left in ``cdi_dir``; the number removed. The CDI directory is shared: every other file
    (other tools' specs and temp files) is left."""
    prefix = _spec_prefix(driver_name)
    return remove_stale_temps(cdi_dir, lambda name: name.startswith(prefix))


class CdiSpecWriter:
    """Builds, writes and removes the claim specs. Thread-safe: it only reads frozen state,
    and each claim has its own file."""

    def __init__(self, topology: Topology, config: Config, nccl_files: NcclFiles | None = None) -> None:
        self.topology = topology
        self.driver_name = config.driver_name
        self.cdi_dir = config.cdi_dir
        self.config = config
        self.nccl_files = nccl_files  # the DRA servers' (one per host directory), None: off

    def build(self, claim_uid: str, devices: Sequence[DeviceRef], nccl_file: NcclFile | None = None,
              device_additions: Mapping[str, ContainerAdditions] | None = None) -> dict[str, Any]:
        """The CDI spec for a claim's devices (at least one; no GPU in two of them), with
        the claim's NCCL topology file mounted where there is one, and what a device's
        containers get beyond the claim's (``device_additions`` by device name: its share
        of an MPS daemon) in that device's entry."""
        for d in devices:
            name = cdi_device_name(claim_uid, d.name)
            if not _CDI_NAME.match(name):
                raise ValueError(f"CDI device name {name!r} is not valid")
        facts = container_facts(self.topology, [p for d in devices for p in d.parts], self.config,
                                additions=nccl_additions(nccl_file, self.config))
        by_uuid = {p.uuid for d in devices if parse_mig_slot_name(d.name) is not None for p in d.parts}
        own = facts.own_nodes()
        nodes_of = {h.device.uuid: {n.path for n in h.nodes} for h in facts.devices}
        return {
            "cdiVersion": CDI_VERSION,
            "kind": cdi_kind(self.driver_name),
            "devices": [
                {
                    "name": cdi_device_name(claim_uid, d.name),
                    "containerEdits": {"deviceNodes": [
                        _node(n) for n in own if any(n.path in nodes_of[p.uuid] for p in d.parts)
                    ], **_added((device_additions or {}).get(d.name))},
                }
                for d in devices
            ],
            "containerEdits": {
                "env": [f"{k}={v}" for k, v in _envs(facts, by_uuid).items()],
                "deviceNodes": [_node(n) for n in (*facts.common_nodes, *(c.node for c in facts.imex_channels))],
                **({"mounts": [_mount(m) for m in facts.mounts]} if facts.mounts else {}),
            },
        }

    def write(self, claim_uid: str, devices: Sequence[DeviceRef], other_devices: Sequence[str] = (),
              device_additions: Mapping[str, ContainerAdditions] | None = None) -> str:
        """Write the claim's NCCL topology file and its spec, each atomically; returns the
        spec's path. OSError when either cannot be written. ``other_devices``: the names of
        the claim's devices from other drivers; a NIC of the node among them (by its name,
        or its bus ID spelt with dashes) goes into the NCCL file besides the nearest."""
        parts = [p for d in devices for p in d.parts]
        nccl = None
        if self.nccl_files is not None and all(p.mig is None for p in parts):  # MIG: no file
            gpus = sorted({p.gpu.index for p in parts})
            extra = [n for n in self.topology.nics if _names_nic(other_devices, n.name, n.pci_bus_id)]
            nccl = self.nccl_files.write(claim_key(claim_uid), self.topology, gpus, extra)
        spec = self.build(claim_uid, devices, nccl, device_additions)
        path = spec_path(self.cdi_dir, self.driver_name, claim_uid)
        # No fsync: the CDI directory is a tmpfs on nodes (/var/run/cdi), and after a power
        # loss the kubelet prepares its claims again anyway; the rename alone keeps the
        # runtime from ever reading half a spec.
        write_json_atomic(path, spec, fsync=False)
        return path

    @staticmethod
    def has_spec(path: str) -> bool:
        """Whether a claim's spec is at ``path`` (the runtime can inject its devices)."""
        return os.path.isfile(path)

    def remove(self, path: str, claim_uid: str | None = None) -> None:
        """Remove a claim's spec written at ``path`` (none there is fine), and with
        ``claim_uid`` its NCCL topology file; OSError when either cannot be removed."""
        remove_file(path)
        if claim_uid is not None and self.nccl_files is not None:
            self.nccl_files.remove(claim_key(claim_uid))


def _envs(facts: ContainerFacts, by_uuid: Collection[str] = ()) -> dict[str, str]:
    """``NVIDIA_VISIBLE_DEVICES`` (the IDs as ``deviceIDStrategy`` says; the devices of
    UUIDs ``by_uuid`` by UUID) and the IMEX channels, as NVIDIA's plugin sets them with
    ``envvar``, then the facts' own."""
    ids = [h.device.uuid if h.device.uuid in by_uuid else h.id for h in facts.devices]
    envs = {VISIBLE_DEVICES_ENV: ",".join(ids)}
    if facts.imex_channels:
        envs[IMEX_CHANNELS_ENV] = ",".join(str(c.id) for c in facts.imex_channels)
    envs.update(facts.envs)
    return envs


def _names_nic(names: Sequence[str], nic_name: str, bus_id: str | None) -> bool:
    """Whether a device name of another driver names this NIC: its RDMA device name
    (``mlx5_0``) or its bus ID with ':' and '.' as '-' (``pci-0000-19-00-0``)."""
    dashed = re.sub(r"[:.]", "-", bus_id or "").lower()
    return any(n == nic_name or (dashed and n.lower().endswith(dashed)) for n in names)


def _added(additions: ContainerAdditions | None) -> dict[str, Any]:
    """A device entry's env and mounts for ``additions``."""
    if additions is None:
        return {}
    return {"env": [f"{k}={v}" for k, v in additions.envs.items()], "mounts": [_mount(m) for m in additions.mounts]}


def _mount(mount: Mount) -> dict[str, Any]:
    return {"hostPath": mount.host_path, "containerPath": mount.container_path,
            "options": ["ro" if mount.read_only else "rw", "nosuid", "nodev", "bind"]}


def _node(node: DeviceNode) -> dict[str, str]:
    out = {"path": node.path, "permissions": node.permissions}
    if node.host_path != node.path:
        out["hostPath"] = node.host_path
    return out
