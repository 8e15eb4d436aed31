"""CDI (Container Device Interface) specs for prepared claims: one JSON file per claim.

The container runtime reads every ``*.json`` in the CDI directory; the kubelet passes it the
fully-qualified device names we return from NodePrepareResources (``<vendor>/<class>=<name>``).
Per claim we write ``<cdi_dir>/<vendor>-claim_<claim uid>.json`` with

- one CDI device per allocated device, named ``<claim uid>-<device name>``, holding its
  device nodes (``/dev/nvidiaN``, a MIG device's ``/dev/nvidia-caps/nvidia-capN``; a GPU
  set's device holds the nodes of every member GPU);
- spec-wide container edits, applied whenever any device of the claim is injected: the
  control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ... where they exist),
  ``NVIDIA_VISIBLE_DEVICES`` and the agent's ``GPU_TOPOLOGY_*`` variables for the claim's
  whole device set. They come from :func:`agent.containers.container_edits`, which the
  device plugin's Allocate answers with too, so both modes hand a container the same
  environment for the same GPUs; and the claim's NCCL topology file
  (``<nccl.hostDir>/claim-<uid>.xml``, its GPUs and their nearest NICs) mounted read-only
  with ``NCCL_TOPO_FILE`` naming it, removed with the spec.

Files are written atomically (a temporary file in the same directory, then a rename), so the
runtime never reads half a spec.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import replace
from typing import Any, Callable, Sequence

from agent.config import Config
from agent.containers import container_edits
from agent.dra.devices import DeviceRef
from agent.ncclfiles import NcclFile, NcclFiles, claim_key
from agent.topology.model import Topology

#: The CDI spec version written: 0.6.0 is read by containerd >= 1.7 and CRI-O >= 1.28 and
#: has everything used here (env, deviceNodes with hostPath and permissions).
CDI_VERSION = "0.6.0"
#: The CDI class of our devices; the vendor is the driver name.
CDI_CLASS = "gpu"

_CDI_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.:-]*$")


def valid_claim_uid(uid: str) -> bool:
    """A UID that can name a CDI device and a file (Kubernetes UIDs are UUIDs)."""
    return bool(_CDI_NAME.match(uid)) and ":" not in uid


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
    return os.path.join(cdi_dir, f"{driver_name}-claim_{claim_uid}.json")


class CdiSpecWriter:
    """Builds and writes the claim specs. Thread-safe: it only reads frozen state, and each
    claim has its own file."""

    def __init__(
        self,
        topology: Topology,
        config: Config,
        *,
        path_exists: Callable[[str], bool] = os.path.exists,
    ) -> None:
        self.topology = topology
        self.driver_name = config.driver_name
        self.cdi_dir = config.cdi_dir
        # What the device plugin's Allocate would answer with the settings CDI needs: device
        # nodes on, NVIDIA_VISIBLE_DEVICES as an env variable (IDs as device_id_strategy says).
        self._config = replace(config, pass_device_specs=True, device_list_strategy=("envvar",))
        self._path_exists = path_exists
        self.nccl_files = NcclFiles.from_config(config)

    def build(self, claim_uid: str, devices: Sequence[DeviceRef], nccl_file: NcclFile | None = None) -> dict[str, Any]:
        """The CDI spec for a claim's devices (at least one; no GPU in two of them), with
        the claim's NCCL topology file mounted where there is one."""
        for d in devices:
            name = cdi_device_name(claim_uid, d.name)
            if not _CDI_NAME.match(name):
                raise ValueError(f"CDI device name {name!r} is not valid")
        edits = container_edits(
            self.topology, [p for d in devices for p in d.parts], self._config, path_exists=self._path_exists,
            nccl_file=nccl_file,
        )
        per_device = {d.name: {path for p in d.parts for path in edits.nodes_by_device[p.uuid]} for d in devices}
        own = {path for paths in per_device.values() for path in paths}
        common = [spec for spec in edits.devices if spec[0] not in own]
        return {
            "cdiVersion": CDI_VERSION,
            "kind": cdi_kind(self.driver_name),
            "devices": [
                {
                    "name": cdi_device_name(claim_uid, d.name),
                    "containerEdits": {"deviceNodes": [_node(s) for s in edits.devices if s[0] in per_device[d.name]]},
                }
                for d in devices
            ],
            "containerEdits": {
                "env": [f"{k}={v}" for k, v in edits.envs.items()],
                "deviceNodes": [_node(s) for s in common],
                **({"mounts": [_mount(m) for m in edits.mounts]} if edits.mounts else {}),
            },
        }

    def write(self, claim_uid: str, devices: Sequence[DeviceRef], other_devices: Sequence[str] = ()) -> str:
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
        spec = self.build(claim_uid, devices, nccl)
        path = spec_path(self.cdi_dir, self.driver_name, claim_uid)
        # No fsync: the CDI directory is a tmpfs on nodes (/var/run/cdi), and after a power
        # loss the kubelet prepares its claims again anyway; the rename alone keeps the
        # runtime from ever reading half a spec.
        write_json_atomic(path, spec, fsync=False)
        return path

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec and NCCL topology file; False when there was no spec."""
        if self.nccl_files is not None:
            self.nccl_files.remove(claim_key(claim_uid))
        try:
            os.unlink(spec_path(self.cdi_dir, self.driver_name, claim_uid))
        except FileNotFoundError:
            return False
        return True


def _names_nic(names: Sequence[str], nic_name: str, bus_id: str | None) -> bool:
    """Whether a device name of another driver names this NIC: its RDMA device name
    (``mlx5_0``) or its bus ID with ':' and '.' as '-' (``pci-0000-19-00-0``)."""
    dashed = re.sub(r"[:.]", "-", bus_id or "").lower()
    return any(n == nic_name or (dashed and n.lower().endswith(dashed)) for n in names)


def _mount(mount: tuple[str, str, bool]) -> dict[str, Any]:
    container, host, read_only = mount
    return {"hostPath": host, "containerPath": container,
            "options": ["ro" if read_only else "rw", "nosuid", "nodev", "bind"]}


def _node(spec: tuple[str, str, str]) -> dict[str, str]:
    container, host, permissions = spec
    node = {"path": container, "permissions": permissions}
    if host != container:
        node["hostPath"] = host
    return node


def write_json_atomic(path: str, data: object, *, fsync: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` so that readers see the old file or the new one,
    never a partial one (temp file in the same directory, rename). ``fsync`` also makes it
    durable against a power loss before the rename."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    # the ".tmp" suffix keeps the runtime, which reads *.json, off the half-written file
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=False)
            fh.write("\n")
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
