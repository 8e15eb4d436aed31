"""The config file: NVIDIA's device plugin format (``version: v1``, YAML or JSON), read into
the :class:`agent.config.Config` fields it sets.

We accept every key NVIDIA's device plugin's file has (``flags``, ``flags.plugin``, ``flags.gfd``,
``sharing.timeSlicing``, ``sharing.mps``, ``resources``, ``imex``) so that its files load
unchanged, plus our sections ``health:``, ``metrics:``, ``mode:``, ``dra:``, ``topology:`` and
``nccl:``. Keys NVIDIA's device plugin
parses for other components (GFD, GDS) are accepted and not acted on. Every error names the file, the key
and what was expected (:class:`agent.errors.ConfigError`, one line).

Size: one job, the file's schema section by section (each a short function); the values'
parsers are :mod:`agent.config_values`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from agent.config_values import (
    ALLOCATION_POLICIES,
    DEVICE_ID_STRATEGIES,
    LABEL_SINKS,
    MIG_STRATEGIES,
    MODES,
    expect_bool,
    expect_choice,
    expect_file_name,
    expect_imex_channel_ids,
    expect_list_strategy,
    expect_number,
    expect_str,
    expect_xids,
    got,
    parse_field,
)
from agent.errors import ConfigError, InputFormatError, shorten
from agent.formats import GPU_RESOURCE, MIG_RESOURCE_PREFIX, read_document
from agent.records import REPLICA_POLICIES


@dataclass(frozen=True)
class TimeSlicingResource:
    """One entry of ``sharing.timeSlicing.resources`` or ``sharing.mps.resources`` (NVIDIA's device plugin's
    ``ReplicatedResource``: both sections share its fields)."""

    name: str = GPU_RESOURCE  # the resource being shared
    replicas: int = 1  # how many replicas each GPU is advertised as (>= 2 to share)
    rename: str | None = None  # advertise the replicas under this resource name instead
    devices: tuple[str, ...] | None = None  # None = all; else indices, GPU or MIG UUIDs


# Keys of the NVIDIA device plugin's file that we accept and do not act on (GFD settings,
# MPS/GDS knobs of other components): accepted so that NVIDIA's device plugin's files load unchanged.
_IGNORED_FLAG_KEYS = (
    "gfd", "gdsEnabled", "mofedEnabled",
    "deviceDiscoveryStrategy",
)
_IGNORED_PLUGIN_KEYS = ("nvidiaCTKPath", "containerDriverRoot", "nvidiaDevRoot")


#: NVIDIA's device plugin reads ``replicas`` into a Go ``int``: nothing larger loads there.
_GO_INT_MAX = 2**63 - 1


def _expect_mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(section: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in section:
        if key not in allowed:
            prefix = f"{where}." if where else ""
            # no key is longer than 40 characters: the list of the allowed ones gets the room
            raise ValueError(
                f"{prefix}{shorten(key, 40)}: unknown key (expected one of {', '.join(allowed)})"
            )


def _is_device_index(text: str) -> bool:
    """``"3"`` (a GPU index) or ``"3:1"`` (MIG device 1 of GPU 3)."""
    parts = text.split(":")
    return len(parts) in (1, 2) and all(p.isdigit() for p in parts)


def _parse_replicated(section: Mapping[str, Any], where: str, mps: bool) -> dict[str, object]:
    """One of ``sharing.timeSlicing`` and ``sharing.mps`` (NVIDIA's ``ReplicatedResources``)
    into Config fields: its resources under ``time_slicing`` or ``mps``, and the two
    switches. MPS follows NVIDIA's device plugin's stricter rules: at least one resource, replicas >= 2,
    full GPUs only (its plugin refuses MIG devices), ``failRequestsGreaterThanOne`` true
    unless the file says otherwise."""
    _check_keys(section, ("renameByDefault", "failRequestsGreaterThanOne", "resources"), where)
    out: dict[str, object] = {}
    if "renameByDefault" in section:
        out["rename_by_default"] = expect_bool(section["renameByDefault"], f"{where}.renameByDefault")
    if "failRequestsGreaterThanOne" in section:
        out["fail_requests_greater_than_one"] = expect_bool(
            section["failRequestsGreaterThanOne"], f"{where}.failRequestsGreaterThanOne"
        )
    elif mps:
        out["fail_requests_greater_than_one"] = True
    resources = section.get("resources") or []
    if not isinstance(resources, list):
        raise ValueError(f"{where}.resources: expected a list, got {type(resources).__name__}")
    if mps and not resources:
        raise ValueError(f"{where}.resources: expected at least one resource to share through MPS")
    out["mps" if mps else "time_slicing"] = tuple(
        _parse_replicated_entry(_expect_mapping(entry, f"{where}.resources[{i}]"), f"{where}.resources[{i}]", mps)
        for i, entry in enumerate(resources)
    )
    return out


def _parse_replicated_entry(entry: Mapping[str, Any], at: str, mps: bool) -> TimeSlicingResource:
    _check_keys(entry, ("name", "replicas", "rename", "devices"), at)
    name = expect_str(entry.get("name"), f"{at}.name")
    if mps and name.startswith(MIG_RESOURCE_PREFIX):
        raise ValueError(f"{at}.name: MPS cannot share MIG devices; expected {GPU_RESOURCE}, got {got(name)}")
    if name != GPU_RESOURCE and (mps or not name.startswith(MIG_RESOURCE_PREFIX)):
        expected = GPU_RESOURCE if mps else f"{GPU_RESOURCE} or {MIG_RESOURCE_PREFIX}<profile>"
        raise ValueError(f"{at}.name: expected {expected}, got {got(name)}")
    replicas = entry.get("replicas")
    least = 2 if mps else 1
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not least <= replicas <= _GO_INT_MAX:
        raise ValueError(f"{at}.replicas: expected an integer >= {least} and < 2**63, got {got(replicas)}")
    rename = entry.get("rename")
    if rename is not None:
        rename = expect_str(rename, f"{at}.rename")
        if "/" in rename or not rename:
            raise ValueError(f"{at}.rename: expected a resource name without a domain, got {got(rename)}")
    devices_raw = entry.get("devices", "all")
    devices: tuple[str, ...] | None
    if devices_raw is None or devices_raw == "all":
        devices = None
    elif isinstance(devices_raw, list) and devices_raw:
        devices = tuple(str(d).strip() for d in devices_raw)
        for d in devices:
            if not (_is_device_index(d) or d.startswith("GPU-") or d.startswith("MIG-")):
                raise ValueError(
                    f"{at}.devices: expected GPU indices, MIG indices (GPU:MIG), GPU or MIG UUIDs, got {got(d)}"
                )
            if mps and (":" in d or d.startswith("MIG-")):
                raise ValueError(
                    f"{at}.devices: MPS cannot share MIG devices; expected GPU indices or UUIDs, got {got(d)}"
                )
    else:
        raise ValueError(f"{at}.devices: expected \"all\" or a non-empty list, got {got(devices_raw)}")
    return TimeSlicingResource(name=name, replicas=replicas, rename=rename, devices=devices)


def _parse_sharing(sharing: Mapping[str, Any], out: dict[str, object]) -> None:
    """``sharing``: time-slicing or MPS, never both on one node."""
    _check_keys(sharing, ("timeSlicing", "mps"), "sharing")
    time_slicing = mps = None
    if "timeSlicing" in sharing:
        time_slicing = _parse_replicated(
            _expect_mapping(sharing["timeSlicing"], "sharing.timeSlicing"), "sharing.timeSlicing", mps=False
        )
    if sharing.get("mps") is not None:
        mps = _parse_replicated(_expect_mapping(sharing["mps"], "sharing.mps"), "sharing.mps", mps=True)
    if time_slicing is not None and mps is not None:
        if time_slicing["time_slicing"]:
            raise ValueError(
                "sharing: timeSlicing and mps are exclusive on a node (a GPU is shared one way);"
                " keep one of them"
            )
        time_slicing = None  # an empty timeSlicing beside mps: its switches do not apply
    out.update(mps or time_slicing or {})


def _parse_file_document(doc: object) -> dict[str, object]:
    """The Config fields a parsed config file sets; raises ValueError naming key and expectation."""
    doc = _expect_mapping(doc, "(top level)")
    _check_keys(doc, ("version", "flags", "sharing", "resources", "imex", "health", "metrics", "mode", "dra",
                      "topology", "nccl"), "")
    if doc.get("version") != "v1":
        raise ValueError(f"version: expected \"v1\", got {got(doc.get('version'))}")
    out: dict[str, object] = {}
    _parse_flags(_expect_mapping(doc.get("flags"), "flags"), out)
    _parse_sharing(_expect_mapping(doc.get("sharing"), "sharing"), out)
    _parse_health(_expect_mapping(doc.get("health"), "health"), out)
    _parse_imex(_expect_mapping(doc.get("imex"), "imex"), out)
    _parse_dra_file_keys(doc, out)
    _parse_metrics(_expect_mapping(doc.get("metrics"), "metrics"), out)
    _parse_nccl(_expect_mapping(doc.get("topology"), "topology"), _expect_mapping(doc.get("nccl"), "nccl"), out)
    return out


def _parse_nccl(topology: Mapping[str, Any], nccl: Mapping[str, Any], out: dict[str, object]) -> None:
    """Our ``topology.ncclTopologyFile`` and ``nccl`` section (issue 24)."""
    _check_keys(topology, ("ncclTopologyFile",), "topology")
    if "ncclTopologyFile" in topology:
        out["nccl_topology_file"] = parse_field("nccl_topology_file", topology["ncclTopologyFile"] or "",
                                                "topology.ncclTopologyFile")
    keys = {"topologyFile": "nccl_pod_files", "hostDir": "nccl_host_dir", "mountPath": "nccl_mount_path",
            "setIbHca": "nccl_ib_hca"}
    _check_keys(nccl, tuple(keys), "nccl")
    for key, name in keys.items():
        if key in nccl:
            out[name] = parse_field(name, nccl[key], f"nccl.{key}")


#: ``flags`` keys naming the MPS root and the programs the agent runs, and their fields.
_PROGRAM_FLAGS = {"mpsRoot": "mps_root", "mpsControlBinary": "mps_control_binary", "nvidiaSmi": "nvidia_smi"}


def _parse_flags(flags: Mapping[str, Any], out: dict[str, object]) -> None:
    """The file's ``flags`` section (with ``flags.plugin`` and ``flags.gfd``) into ``out``."""
    _refuse_misplaced_imex(flags)
    _check_keys(
        flags,
        ("migStrategy", "failOnInitError", "nvidiaDriverRoot", "plugin",
         "sharedDevicesAllocationPolicy", "allocationPolicy", "featureFile", "labelIntervalSeconds",
         "labelsSink", "useNodeFeatureAPI", "kubeconfig", *_PROGRAM_FLAGS)
        + _IGNORED_FLAG_KEYS,
        "flags",
    )
    if "migStrategy" in flags:
        out["mig_strategy"] = expect_choice(flags["migStrategy"], MIG_STRATEGIES, "flags.migStrategy")
    if "failOnInitError" in flags:
        out["fail_on_init_error"] = expect_bool(flags["failOnInitError"], "flags.failOnInitError")
    if "nvidiaDriverRoot" in flags:
        out["nvidia_driver_root"] = expect_str(flags["nvidiaDriverRoot"], "flags.nvidiaDriverRoot")
    if "sharedDevicesAllocationPolicy" in flags:
        out["shared_devices_allocation_policy"] = expect_choice(
            flags["sharedDevicesAllocationPolicy"], REPLICA_POLICIES, "flags.sharedDevicesAllocationPolicy"
        )
    if "allocationPolicy" in flags:
        out["allocation_policy"] = expect_choice(
            flags["allocationPolicy"], ALLOCATION_POLICIES, "flags.allocationPolicy"
        )
    plugin = _expect_mapping(flags.get("plugin"), "flags.plugin")
    _check_keys(
        plugin,
        ("passDeviceSpecs", "deviceListStrategy", "deviceIDStrategy", "cdiAnnotationPrefix", "socketName")
        + _IGNORED_PLUGIN_KEYS,
        "flags.plugin",
    )
    if "passDeviceSpecs" in plugin:
        out["pass_device_specs"] = expect_bool(plugin["passDeviceSpecs"], "flags.plugin.passDeviceSpecs")
    if "deviceListStrategy" in plugin:
        out["device_list_strategy"] = expect_list_strategy(
            plugin["deviceListStrategy"], "flags.plugin.deviceListStrategy"
        )
    if "deviceIDStrategy" in plugin:
        out["device_id_strategy"] = expect_choice(
            plugin["deviceIDStrategy"], DEVICE_ID_STRATEGIES, "flags.plugin.deviceIDStrategy"
        )
    if "socketName" in plugin:
        out["socket_name"] = expect_file_name(plugin["socketName"], "flags.plugin.socketName")
    if "featureFile" in flags:
        out["feature_file"] = expect_file_name(flags["featureFile"], "flags.featureFile")
    if "labelIntervalSeconds" in flags:
        out["label_interval_s"] = expect_number(flags["labelIntervalSeconds"], "flags.labelIntervalSeconds", 0.1)
    _parse_labels_sink(flags, out)
    if flags.get("kubeconfig") is not None:  # "kubeconfig:" left empty = in-cluster
        out["kubeconfig"] = expect_str(flags["kubeconfig"], "flags.kubeconfig")
    for key, name in _PROGRAM_FLAGS.items():
        if key in flags:
            out[name] = parse_field(name, flags[key], f"flags.{key}")
    gfd = _expect_mapping(flags.get("gfd"), "flags.gfd")
    if "noTimestamp" in gfd:
        out["no_timestamp"] = expect_bool(gfd["noTimestamp"], "flags.gfd.noTimestamp")
    if "cdiAnnotationPrefix" in plugin:
        out["cdi_annotation_prefix"] = expect_str(plugin["cdiAnnotationPrefix"], "flags.plugin.cdiAnnotationPrefix")


def _parse_labels_sink(flags: Mapping[str, Any], out: dict[str, object]) -> None:
    """``flags.labelsSink``, or NVIDIA's ``flags.useNodeFeatureAPI`` (true: nodefeature)."""
    sink = None
    if "labelsSink" in flags:
        sink = expect_choice(flags["labelsSink"], LABEL_SINKS, "flags.labelsSink")
    if flags.get("useNodeFeatureAPI") is not None:
        nvidia = "nodefeature" if expect_bool(flags["useNodeFeatureAPI"], "flags.useNodeFeatureAPI") else "file"
        if sink is not None and sink != nvidia:
            raise ValueError(f"flags.useNodeFeatureAPI: says {nvidia} but flags.labelsSink says {sink}: keep one")
        sink = nvidia
    if sink is not None:
        out["labels_sink"] = sink


def _parse_health(health: Mapping[str, Any], out: dict[str, object]) -> None:
    _check_keys(health, ("enabled", "ignoredXids", "criticalXids", "recoverySeconds", "factsIntervalSeconds",
                         "nodeCondition",
                         "kernelLog", "xids", "repeatedXids", "stateFile"), "health")
    if "enabled" in health:
        out["health_checks_enabled"] = expect_bool(health["enabled"], "health.enabled")
    if "ignoredXids" in health:
        out["ignored_xids"] = expect_xids(health["ignoredXids"], "health.ignoredXids")
    if "criticalXids" in health:
        out["extra_critical_xids"] = expect_xids(health["criticalXids"], "health.criticalXids")
    if "recoverySeconds" in health:
        out["health_recovery_s"] = expect_number(health["recoverySeconds"], "health.recoverySeconds")
    if "factsIntervalSeconds" in health:
        out["health_facts_interval_s"] = expect_number(
            health["factsIntervalSeconds"], "health.factsIntervalSeconds", 0.1
        )
    if "nodeCondition" in health:
        out["node_condition"] = parse_field("node_condition", health["nodeCondition"], "health.nodeCondition")
    for key, name in (("kernelLog", "kernel_log"), ("xids", "xid_overrides"), ("stateFile", "health_state_file")):
        if key in health:
            out[name] = parse_field(name, health[key], f"health.{key}")
    if "repeatedXids" in health:
        repeated = _expect_mapping(health["repeatedXids"], "health.repeatedXids")
        _check_keys(repeated, ("count", "windowSeconds"), "health.repeatedXids")
        if "count" in repeated:
            out["repeated_xid_count"] = parse_field(
                "repeated_xid_count", repeated["count"], "health.repeatedXids.count")
        if "windowSeconds" in repeated:
            out["repeated_xid_window_s"] = parse_field(
                "repeated_xid_window_s", repeated["windowSeconds"], "health.repeatedXids.windowSeconds")


def _refuse_misplaced_imex(flags: Mapping[str, Any]) -> None:
    """An IMEX setting must never be ignored: these spellings are not NVIDIA's."""
    for key in ("imexChannelIDs", "imexRequired"):
        if key in flags:
            raise ValueError(f"flags.{key}: not a key of this format; IMEX channels are set in the"
                             " top-level imex section (imex.channelIDs, imex.required)")


def _parse_imex(imex: Mapping[str, Any], out: dict[str, object]) -> None:
    """NVIDIA's ``imex`` section: ``channelIDs`` ([] or [0]) and ``required``."""
    _check_keys(imex, ("channelIDs", "required"), "imex")
    if "channelIDs" in imex:
        out["imex_channel_ids"] = expect_imex_channel_ids(imex["channelIDs"] or [], "imex.channelIDs")
    if "required" in imex:
        out["imex_required"] = expect_bool(imex["required"], "imex.required")


def _parse_metrics(metrics: Mapping[str, Any], out: dict[str, object]) -> None:
    _check_keys(
        metrics,
        ("sampleIntervalSeconds", "podResourcesRefreshSeconds", "idleThresholdPercent",
         "probeAddress", "webConfigFile"),
        "metrics",
    )
    for key, name in (("probeAddress", "probe_address"), ("webConfigFile", "web_config_file")):
        if key in metrics:  # left empty: the default
            out[name] = "" if metrics[key] is None else expect_str(metrics[key], f"metrics.{key}")
    if "sampleIntervalSeconds" in metrics:
        out["sample_interval_s"] = expect_number(
            metrics["sampleIntervalSeconds"], "metrics.sampleIntervalSeconds", 0.1
        )
    if "podResourcesRefreshSeconds" in metrics:
        out["pod_resources_refresh_s"] = expect_number(
            metrics["podResourcesRefreshSeconds"], "metrics.podResourcesRefreshSeconds", 0.1
        )
    if "idleThresholdPercent" in metrics:
        threshold = expect_number(metrics["idleThresholdPercent"], "metrics.idleThresholdPercent")
        if threshold > 100:
            raise ValueError(f"metrics.idleThresholdPercent: expected 0 to 100, got {threshold:g}")
        out["idle_utilization_threshold_pct"] = threshold


#: The config file's ``dra:`` section: key -> Config field.
DRA_FILE_KEYS: Mapping[str, str] = {
    "driverName": "driver_name",
    "pluginsRegistryDir": "plugins_registry_dir",
    "pluginsDir": "plugins_dir",
    "cdiDir": "cdi_dir",
    "kubeconfig": "kubeconfig",
    "deleteSlicesOnShutdown": "delete_slices_on_shutdown",
    "taintEffect": "taint_effect",
    "gpuSets": "gpu_sets",
    "gpuSetWithdrawalGraceSeconds": "gpu_set_withdrawal_grace_s",
    "dynamicMig": "dynamic_mig",
    "migPlacementsPerProfile": "mig_placements_per_profile",
}


def _parse_dra_file_keys(doc: Mapping[str, Any], out: dict[str, object]) -> None:
    """Top-level ``mode:`` and the ``dra:`` section of a config file."""
    if "mode" in doc:
        out["mode"] = expect_choice(doc["mode"], MODES, "mode")
    dra = _expect_mapping(doc.get("dra"), "dra")
    _check_keys(dra, tuple(DRA_FILE_KEYS), "dra")
    for key, name in DRA_FILE_KEYS.items():
        if key in dra:
            value = dra[key]
            if name == "kubeconfig" and value is None:  # "kubeconfig:" left empty = in-cluster
                value = ""
            if name == "kubeconfig" and out.get(name, value) != value:
                raise ValueError("dra.kubeconfig: differs from flags.kubeconfig (one client for"
                                 " every API-server user): keep one")
            out[name] = parse_field(name, value, f"dra.{key}")


def read_config_file(path: str) -> dict[str, object]:
    """The Config fields the file at ``path`` sets; :class:`ConfigError` (one line naming the
    file and the key) when it cannot be read or holds a bad value."""
    try:
        doc = read_document(path, "config file")
    except InputFormatError as exc:  # unreadable, not UTF-8, not YAML/JSON: one line, exit 2
        raise ConfigError(str(exc)) from None
    try:
        return _parse_file_document(doc)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


