"""GPU Feature Discovery's label family (``nvidia.com/``): the same keys and value formats
as GFD, so existing ``nodeSelector``/``nodeAffinity`` terms keep working, and the label
value rules every label of the agent follows. :func:`agent.labels.compute_labels` merges
this family with ours (:mod:`agent.labels.topology_labels`).

GFD-compatible labels (``nvidia.com/``):

=====================================  ===============================================
key                                    value
=====================================  ===============================================
gpu.product                            model name, sanitised (``NVIDIA-H100-80GB-HBM3``);
                                       ``-SHARED`` when shared (time-slicing or MPS) and
                                       not renamed;
                                       ``<model>-MIG-<profile>`` under ``mig-strategy=single``
gpu.count / gpu.memory (MiB)           of that model
gpu.family, gpu.compute.major/minor    from the compute capability
gpu.machine                            DMI product name, spaces as ``-`` (``unknown``)
gpu.replicas, gpu.sharing-strategy     ``1``/``none``, or the replicas and
                                       ``time-slicing`` / ``mps``
gpu.mode                               ``compute``, ``graphics`` or ``unknown`` (see
                                       :func:`_gpu_mode`)
cuda.driver-version.*, cuda.driver.*   from the driver version ``535.104.05``
cuda.runtime-version.*, cuda.runtime.* from the CUDA driver API version ``12.2``
mig.capable, mig.strategy, mps.capable ``mps.capable``: ``true`` under ``sharing.mps`` when
                                       every GPU can run MPS (no MIG mode, compute mode
                                       not Prohibited, compute capability 3.5 or newer)
mig-<profile>.*                        per MIG profile under ``mig-strategy=mixed``
gpu.clique                             ``<cluster-uuid>.<clique-id>`` (NVLink fabric)
gfd.timestamp                          when the labels were computed, seconds since the
                                       epoch (as GFD); only when ``now`` is given and
                                       ``no_timestamp`` is not set
=====================================  ===============================================

Heterogeneous nodes: GFD describes whichever model its map iteration visits last, so its
labels flip between runs. Ours describe the model with the most GPUs (ties: the
lexicographically smallest name), always.
"""

from __future__ import annotations

import re
from collections import Counter

from agent.config import Config
from agent.formats import GPU_RESOURCE, MIG_RESOURCE_PREFIX
from agent.labels.topology_labels import NVLINK_DOMAIN_LABEL, known_model
from agent.sharing import sharing_for, strategy_label
from agent.sharing.mps import MPS
from agent.topology.model import Gpu, MigDevice, Topology

GFD_PREFIX = "nvidia.com/"

#: GFD's label holding when the labels were generated (seconds since the epoch).
TIMESTAMP_LABEL = GFD_PREFIX + "gfd.timestamp"

_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")

_PRODUCT_DROP_RE = re.compile(r"[^A-Za-z0-9\-_. ]")

_MIG_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb")

#: Model-name fragments of GPUs that support MIG: the fallback for a GPU whose record does
#: not say (``Gpu.mig_capable`` None, e.g. a simulated or sysfs-only read); NVML's answer,
#: where the topology has it, wins.
_MIG_CAPABLE_RE = re.compile(r"\b(A100|A30|H100|H200|H800|H20|GH200|B100|B200|GB200|B300|GB300)\b")

#: Model-name fragments of display-class boards (PCI class 0x0300): GFD's ``gpu.mode``
#: reads the PCI class, which the topology does not record.
_GRAPHICS_RE = re.compile(r"GeForce|Quadro|TITAN|\bRTX\b(?! PRO \d+ Blackwell Server)", re.IGNORECASE)



def gfd_labels(topology: Topology, config: Config) -> dict[str, str]:
    """GFD's labels for a node with GPUs (the timestamp aside: :func:`agent.labels.compute_labels`
    adds it); values may be empty, which the caller drops."""
    labels: dict[str, str] = {}
    labels.update(_machine_labels(topology))
    labels.update(_version_labels(topology))
    labels.update(_capability_labels(topology, config))
    labels.update(_resource_labels(topology, config))
    labels.update(_clique_labels(topology))
    return labels


def is_valid_label_value(value: str) -> bool:
    """Kubernetes label value: <= 63 characters, alphanumeric at both ends, ``-_.`` inside."""
    return len(value) <= 63 and bool(_VALUE_RE.match(value))


def sanitize_value(text: str) -> str:
    """GFD's product-name rule: drop characters outside ``[A-Za-z0-9-_. ]``, join words with
    ``-``; then cut to 63 characters and trim non-alphanumerics at both ends so the result
    is always a valid label value (possibly empty)."""
    words = _PRODUCT_DROP_RE.sub("", text).split()
    value = "-".join(words)[:63]
    return value.strip("-_.")


def arch_family(major: int, minor: int) -> str:
    """GFD's architecture family for a CUDA compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ada-lovelace" if minor >= 9 else "ampere"
    return {
        1: "tesla",
        2: "fermi",
        3: "kepler",
        5: "maxwell",
        6: "pascal",
        9: "hopper",
        10: "blackwell",
        12: "blackwell",
    }.get(major, "undefined")


def _machine_labels(topology: Topology) -> dict[str, str]:
    machine = sanitize_value(topology.machine or "") or "unknown"
    return {GFD_PREFIX + "gpu.machine": machine}


def _version_labels(topology: Topology) -> dict[str, str]:
    out: dict[str, str] = {}
    driver = (topology.driver_version or "").strip()
    parts = driver.split(".")
    if 2 <= len(parts) <= 3 and all(p.isalnum() for p in parts):
        for old, new, value in (
            ("major", "major", parts[0]),
            ("minor", "minor", parts[1]),
            ("rev", "revision", parts[2] if len(parts) > 2 else ""),
        ):
            if value:
                out[f"{GFD_PREFIX}cuda.driver.{old}"] = value  # deprecated by GFD, still read
                out[f"{GFD_PREFIX}cuda.driver-version.{new}"] = value
        out[GFD_PREFIX + "cuda.driver-version.full"] = driver
    cuda = (topology.cuda_driver_version or "").strip()
    cparts = cuda.split(".")
    if len(cparts) >= 2 and cparts[0].isdigit() and cparts[1].isdigit():
        major, minor = str(int(cparts[0])), str(int(cparts[1]))
        out[GFD_PREFIX + "cuda.runtime.major"] = major
        out[GFD_PREFIX + "cuda.runtime.minor"] = minor
        out[GFD_PREFIX + "cuda.runtime-version.major"] = major
        out[GFD_PREFIX + "cuda.runtime-version.minor"] = minor
        out[GFD_PREFIX + "cuda.runtime-version.full"] = f"{major}.{minor}"
    return out


def _capability_labels(topology: Topology, config: Config) -> dict[str, str]:
    # NVML's answer where the topology has it; the model name otherwise; left out when
    # neither says (a pasted matrix names no model)
    answers = [
        True if g.mig_enabled
        else g.mig_capable if g.mig_capable is not None
        else bool(_MIG_CAPABLE_RE.search(g.name)) if known_model(g.name)
        else None
        for g in topology.gpus
    ]
    out = {} if None in answers else {GFD_PREFIX + "mig.capable": str(any(answers)).lower()}
    out |= {
        GFD_PREFIX + "mps.capable": str(strategy_label(config) == MPS.strategy and MPS.capable(topology)).lower(),
        GFD_PREFIX + "gpu.mode": _gpu_mode(topology),
    }
    if config.mig_strategy != "none":
        out[GFD_PREFIX + "mig.strategy"] = config.mig_strategy
    return out


def _gpu_mode(topology: Topology) -> str:
    """GFD's rule on the PCI class where sysfs gave it: ``graphics`` when every GPU is a
    display controller (class 0x0300xx), ``compute`` otherwise (3D controllers, 0x0302xx).
    Without it, by model name: ``graphics`` when every GPU is a display-class board,
    ``compute`` otherwise; GFD's ``unknown`` when no GPU has a model name (a pasted
    topology matrix)."""
    classes = [g.pci_class for g in topology.gpus if g.pci_class is not None]
    if classes:
        return "graphics" if all(c >> 8 == 0x0300 for c in classes) else "compute"
    named = [g for g in topology.gpus if known_model(g.name)]
    if not named:
        return "unknown"
    modes = {"graphics" if _GRAPHICS_RE.search(g.name) else "compute" for g in named}
    return modes.pop() if len(modes) == 1 else "compute"


def _sharing(config: Config, resource: str) -> tuple[int, bool]:
    """(replicas, renamed) for ``resource`` from ``sharing.timeSlicing`` or ``sharing.mps``;
    (1, False) if not shared."""
    for r in sharing_for(config).entries(config):
        if r.name == resource and r.replicas > 1:
            return r.replicas, bool(r.rename) or config.rename_by_default
    return 1, False


def _product(parts: list[str], shared: bool, renamed: bool) -> str:
    words = [sanitize_value(p) for p in parts if p]
    if shared and not renamed:
        words.append("SHARED")
    return sanitize_value("-".join(w for w in words if w))


def _majority_model(gpus: tuple[Gpu, ...] | list[Gpu]) -> tuple[str, list[Gpu]]:
    counts = Counter(g.name for g in gpus)
    name = min(counts, key=lambda n: (-counts[n], n))
    return name, [g for g in gpus if g.name == name]


def _resource_labels(topology: Topology, config: Config) -> dict[str, str]:
    out: dict[str, str] = {}
    key = GPU_RESOURCE + "."
    name, same_model = _majority_model(topology.gpus)
    replicas, renamed = _sharing(config, GPU_RESOURCE)
    shared = replicas > 1
    product = _product([name], shared, renamed) if known_model(name) else ""
    if product:  # a pasted topology matrix names no model ("unknown")
        out[key + "product"] = product
    out[key + "count"] = str(len(same_model))
    out[key + "replicas"] = str(replicas)
    out[key + "sharing-strategy"] = strategy_label(config) if shared else "none"
    memories = [g.memory_mib for g in same_model if g.memory_mib]
    if memories:
        out[key + "memory"] = str(min(memories))
    caps = sorted({g.compute_capability for g in same_model if g.compute_capability})
    if caps and caps[0][0] > 0:
        major, minor = caps[0]
        out[key + "family"] = arch_family(major, minor)
        out[key + "compute.major"] = str(major)
        out[key + "compute.minor"] = str(minor)

    migs = [m for g in topology.gpus if g.mig_enabled for m in g.mig_devices]
    if config.mig_strategy == "single":
        out.update(_mig_single_labels(topology, config, name))
    elif config.mig_strategy == "mixed":
        by_profile: dict[str, list[MigDevice]] = {}
        for m in migs:
            by_profile.setdefault(m.profile, []).append(m)
        for profile in sorted(by_profile):
            devices = by_profile[profile]
            parent = topology.gpus[devices[0].parent_index].name
            resource = f"{MIG_RESOURCE_PREFIX}{profile}"
            out.update(_mig_resource_labels(resource, config, parent, profile, devices))
    return out


def _mig_single_labels(topology: Topology, config: Config, model: str) -> dict[str, str]:
    enabled = [g for g in topology.gpus if g.mig_enabled]
    if not enabled:
        return {}  # no MIG-enabled GPU: single behaves as none
    key = GPU_RESOURCE + "."
    migs = [m for g in enabled for m in g.mig_devices]
    profiles = {m.profile for m in migs}
    invalid = (
        any(not g.mig_devices for g in enabled)
        or len(enabled) != len(topology.gpus)
        or len(profiles) != 1
    )
    if invalid:
        return {
            key + "product": _product([enabled[0].name, "MIG", "INVALID"], False, False),
            key + "count": "0",
            key + "replicas": "0",
            key + "memory": "0",
        }
    profile = profiles.pop()
    parent = enabled[0].name
    return _mig_resource_labels(GPU_RESOURCE, config, parent, profile, migs)


def _mig_resource_labels(resource: str, config: Config, parent_model: str, profile: str,
                         devices: list[MigDevice]) -> dict[str, str]:
    replicas, renamed = _sharing(config, resource)
    key = resource + "."
    out = {
        key + "product": _product([parent_model, "MIG", profile], replicas > 1, renamed),
        key + "count": str(len(devices)),
        key + "replicas": str(replicas),
        key + "memory": str(min(m.memory_mib for m in devices)),
    }
    match = _MIG_PROFILE_RE.match(profile)
    if match:
        ci, gi = match.group(1), match.group(2)
        out[key + "slices.gi"] = gi
        out[key + "slices.ci"] = ci or gi
    return out


def _clique_labels(topology: Topology) -> dict[str, str]:
    """``gpu.clique`` only when every fabric-attached GPU agrees on cluster and clique
    (GFD omits it otherwise), and with it the NVLink domain: the clique's cluster UUID."""
    attached = [g for g in topology.gpus if g.fabric_cluster_uuid]
    ids = {(g.fabric_cluster_uuid, g.fabric_clique_id) for g in attached}
    if len(ids) != 1:
        return {}
    cluster, clique = ids.pop()
    if clique is None:
        return {}
    value = f"{cluster}.{clique}"
    if not is_valid_label_value(value):
        return {}
    return {GFD_PREFIX + "gpu.clique": value, NVLINK_DOMAIN_LABEL: str(cluster)}

