"""Records what a container is handed, to check that a refactoring changed none of it.

Two outputs, byte for byte, over every built-in simulated machine:

- the device plugin's ``Allocate`` answer (the serialized ``AllocateResponse`` the servicer
  returns) for each resource configuration (plain, MIG mixed and single, time-slicing, MPS)
  x device-list strategy x ``passDeviceSpecs`` x ``deviceIDStrategy`` x IMEX setting x
  request (one device, two, the engine's preferred two, every device up to 8, two replicas
  of one GPU);
- the DRA CDI spec file written for a claim (one GPU, two, a GPU set, a MIG device with a
  GPU) x ``deviceIDStrategy`` x IMEX setting.

Device nodes are looked for under a fixed driver root (``ROOT``) holding two of the control
nodes and a MIG device's capability files, so ``passDeviceSpecs`` and the MIG capability
nodes have something to find, and IMEX channel 0 (a link to ``/dev/null``: a character
device) but not channel 1. The CDI annotation key's random part is made deterministic.

    python tests/edits_identity.py record FILE    # at the commit before the change
    python tests/edits_identity.py compare FILE   # after it: exit 1 and the differing cases

A case a configuration refuses (a ConfigError: MPS on a GPU that cannot run it, MIG single on
a mixed layout) records its error message instead, so a refusal that changes is caught too.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
import tempfile
import uuid
from dataclasses import replace
from typing import Any, Iterator

ROOT = "/tmp/gpu-agent-edits-identity-root"

STRATEGIES = (
    ("envvar",), ("volume-mounts",), ("cdi-annotations",), ("cdi-cri",),
    ("envvar", "cdi-cri"), ("volume-mounts", "cdi-annotations"),
)
IMEX = {"none": {}, "required": {"imex_channel_ids": (0,), "imex_required": True},
        "optional-present": {"imex_channel_ids": (0,), "imex_required": False},
        "optional-missing": {"imex_channel_ids": (1,), "imex_required": False}}


def _driver_root(topology: Any) -> None:
    channels = os.path.join(ROOT, "dev/nvidia-caps-imex-channels")
    os.makedirs(channels, exist_ok=True)
    if not os.path.lexists(os.path.join(channels, "channel0")):
        os.symlink("/dev/null", os.path.join(channels, "channel0"))  # a character device
    for node in ("dev/nvidiactl", "dev/nvidia-uvm"):
        os.makedirs(os.path.join(ROOT, os.path.dirname(node)), exist_ok=True)
        open(os.path.join(ROOT, node), "w").close()
    cap = 100
    for gpu in topology.gpus:
        minor = gpu.minor_number if gpu.minor_number is not None else gpu.index
        for mig in gpu.mig_devices:
            if mig.gi_id is None:
                continue
            base = os.path.join(ROOT, f"proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{mig.gi_id}")
            files = [os.path.join(base, "access")]
            if mig.ci_id is not None:
                files.append(os.path.join(base, f"ci{mig.ci_id}", "access"))
            for f in files:
                os.makedirs(os.path.dirname(f), exist_ok=True)
                with open(f, "w") as fh:
                    fh.write(f"DeviceFileMinor: {cap}\nDeviceFileMode: 292\n")
                cap += 1


def _resource_configs() -> dict[str, dict[str, Any]]:
    from agent.config import TimeSlicingResource as R

    return {
        "plain": {},
        "mig-mixed": {"mig_strategy": "mixed"},
        "mig-single": {"mig_strategy": "single"},
        "ts3": {"time_slicing": (R(replicas=3),)},
        "ts2-renamed-gpu0": {"time_slicing": (R(replicas=2, rename="gpu.shared", devices=("0",)),)},
        "ts2-one-at-most": {"time_slicing": (R(replicas=2),), "fail_requests_greater_than_one": True},
        "mps2": {"mps": (R(replicas=2),)},
        "mps4-gpus01": {"mps": (R(replicas=4, devices=("0", "1")),), "mps_root": "/run/x/mps"},
    }


class _Events:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class _Context:
    def abort(self, code: Any, message: str) -> None:
        raise RuntimeError(f"{code}: {message}")


def _requests(resource: Any, handler: Any) -> Iterator[tuple[str, list[str]]]:
    ids = [d.id for d in resource.devices]
    yield "one", ids[:1]
    if len(ids) > 1:
        yield "two", ids[:2]
        try:
            yield "preferred-two", handler.preferred(ids, [], 2)
        except Exception as exc:  # noqa: BLE001 - recorded as the case's outcome
            yield f"preferred-two-refused {exc}", []
    if len(ids) > 2:
        yield "up-to-8", ids[:8]
    replicas = [d.id for d in resource.devices if d.replica is not None and d.gpu_index == resource.devices[0].gpu_index]
    if len(replicas) > 1:
        yield "two-replicas-one-gpu", replicas[:2]


def allocate_cases(machine: str, topology: Any) -> Iterator[tuple[str, bytes]]:
    from agent._proto import deviceplugin_v1beta1_pb2 as pb
    from agent.config import Config
    from agent.deviceplugin.allocation import RequestHandler
    from agent.deviceplugin.resources import build_resources
    from agent.deviceplugin.server import DevicePluginServicer
    from agent.errors import ConfigError
    from agent.health import HealthState

    health = HealthState(topology.gpu_count)
    for (rname, rconf), strategy, specs, ids, (iname, imex) in itertools.product(
        _resource_configs().items(), STRATEGIES, (False, True), ("uuid", "index"), IMEX.items()
    ):
        config = replace(Config(), nvidia_driver_root=ROOT, device_list_strategy=strategy, pass_device_specs=specs,
                         device_id_strategy=ids, **rconf, **imex)
        key = f"allocate {machine} {rname} {'+'.join(strategy)} specs={specs} ids={ids} imex={iname}"
        try:
            resources = build_resources(topology, config)
        except ConfigError as exc:
            yield key, f"refused: {exc}".encode()
            continue
        for resource in resources:
            handler = RequestHandler(resource, topology, config)
            servicer = DevicePluginServicer(handler, health, _Events())
            for what, devices in _requests(resource, handler):
                request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=devices)])
                try:
                    out = servicer.Allocate(request, _Context()).SerializeToString(deterministic=True)
                except RuntimeError as exc:
                    out = str(exc).encode()
                yield f"{key} {resource.name} {what} {','.join(devices)}", out


def cdi_cases(machine: str, topology: Any, directory: str) -> Iterator[tuple[str, bytes]]:
    from agent.config import Config
    from agent.dra.cdi import CdiSpecWriter
    from agent.dra.devices import DeviceRefs, set_name
    from agent.dra.gpusets import SetPolicy

    devices = DeviceRefs(topology)
    singles = list(devices.values())
    whole = SetPolicy(topology).free_gpus(())
    sets = [devices[set_name(SetPolicy(topology).choose(whole, 2))]] if len(whole) >= 2 else []
    migs = [r for r in singles if r.parts[0].mig is not None]
    plain = [r for r in singles if r.parts[0].mig is None]
    claims = {"one": singles[:1], "two": singles[:2], "a-set": sets[:1], "mig-and-gpu": (migs[:1] + plain[:1])}
    for ids, (iname, imex) in itertools.product(("uuid", "index"), IMEX.items()):
        config = replace(Config(), mode="dra", nvidia_driver_root=ROOT, cdi_dir=directory, device_id_strategy=ids,
                         **imex)
        writer = CdiSpecWriter(topology, config)
        for what, devices in claims.items():
            if not devices:
                continue
            uid = f"0000{len(what):04d}-{machine}-{what}"
            path = writer.write(uid, devices)
            with open(path, "rb") as fh:
                yield f"cdi {machine} ids={ids} imex={iname} {what}", fh.read()


def cases() -> Iterator[tuple[str, bytes]]:
    from agent.discovery import open_backend, read_topology
    from agent.hw.sim.machines import BUILTIN_MACHINES

    counter = itertools.count()
    uuid.uuid4 = lambda: uuid.UUID(int=next(counter))  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as directory:
        for machine in BUILTIN_MACHINES:
            backend, sim = open_backend(machine)
            backend.init()
            try:
                topology = read_topology(backend, sim)
            finally:
                backend.shutdown()
                if sim is not None:
                    sim.close()
            _driver_root(topology)
            yield from allocate_cases(machine, topology)
            yield from cdi_cases(machine, topology, directory)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print("usage: edits_identity.py record|compare FILE", file=sys.stderr)
        return 2
    logging.disable(logging.CRITICAL)  # refusals and warnings are part of the cases, not news
    digests = {key: hashlib.sha256(out).hexdigest() for key, out in cases()}
    if argv[0] == "record":
        with open(argv[1], "w", encoding="utf-8") as fh:
            json.dump(digests, fh, indent=0, sort_keys=True)
        print(f"recorded {len(digests)} cases in {argv[1]}")
        return 0
    with open(argv[1], encoding="utf-8") as fh:
        recorded = json.load(fh)
    differ = sorted(k for k in recorded.keys() | digests.keys() if recorded.get(k) != digests.get(k))
    for key in differ[:40]:
        print("differs:", key)
    print(f"{len(digests)} cases, {len(recorded)} recorded, {len(differ)} differ")
    return 1 if differ or not digests else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
