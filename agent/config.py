"""One frozen settings object for the whole agent.

Sources, lowest precedence first: built-in defaults < config file (NVIDIA device plugin
format ``version: v1``, YAML or JSON) < environment variables < command-line flags.
It is built once at start (and again on SIGHUP) and passed down; the subcommands hand the
loader the environment (:func:`default_environ`) and no other module reads a setting from it
(the engine switch ``AGENT_PUREPYTHON`` is read by :mod:`agent.topology.engine`).

The loader (``load_config``) lives here too; field documentation says unit, default and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, cast

from agent.errors import ConfigError, InputFormatError
from agent.formats import GPU_RESOURCE, MIG_RESOURCE_PREFIX, parse_host_port, read_document
from agent.records import REPLICA_POLICIES

log = logging.getLogger(__name__)

#: XIDs that do not indicate a GPU fault (application errors), skipped by the health
#: watcher unless configured otherwise; the same defaults as NVIDIA's device plugin.
DEFAULT_IGNORED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)


@dataclass(frozen=True)
class TimeSlicingResource:
    """One entry of ``sharing.timeSlicing.resources``."""

    name: str = GPU_RESOURCE  # the resource being shared
    replicas: int = 1  # how many replicas each GPU is advertised as (>= 2 to share)
    rename: str | None = None  # advertise the replicas under this resource name instead
    devices: tuple[str, ...] | None = None  # None = all; else indices, GPU or MIG UUIDs


@dataclass(frozen=True)
class Config:
    """Effective configuration. Defaults are the real node's."""

    # --- flags (device plugin `flags:` section)
    mig_strategy: str = "none"  # none | single | mixed
    fail_on_init_error: bool = True  # NVML missing: exit 1 (True) or wait and retry (False)
    nvidia_driver_root: str = "/"
    pass_device_specs: bool = False
    device_list_strategy: tuple[str, ...] = ("envvar",)  # envvar volume-mounts cdi-annotations cdi-cri
    device_id_strategy: str = "uuid"  # uuid | index
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    shared_devices_allocation_policy: str = "distributed"  # distributed | packed
    allocation_policy: str = "best-effort"
    # --- sharing
    time_slicing: tuple[TimeSlicingResource, ...] = ()
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    # --- health
    health_checks_enabled: bool = True
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    extra_critical_xids: tuple[int, ...] = ()  # XIDs made critical although in ignored list
    health_recovery_s: float = 300.0  # a GPU quiet this long becomes healthy again
    # --- paths and endpoints (the `run` flags)
    kubelet_dir: str = "/var/lib/kubelet/device-plugins"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    features_dir: str = "/etc/kubernetes/node-feature-discovery/features.d"
    metrics_address: str = ":9400"
    node_name: str = ""
    sysfs_root: str = "/sys"
    #: plugin socket file name in kubelet_dir; {resource} is the resource name after the
    #: domain (NVIDIA's plugin uses the same default: change it to run both on one node)
    socket_name: str = "nvidia-{resource}.sock"
    feature_file: str = "gpu-topology-agent"  # label file name in features_dir
    #: how often the label file is re-asserted (s): one deleted or edited behind the agent's
    #: back, or a removed features_dir, is back within this (GFD relabels every 60 s too)
    label_interval_s: float = 60.0
    #: leave out GFD's ``nvidia.com/gfd.timestamp`` label (GFD's --no-timestamp)
    no_timestamp: bool = False
    #: where labels go: ``file`` (NFD's feature file in features_dir) or ``nodefeature`` (one
    #: nfd.k8s-sigs.io/v1alpha1 NodeFeature object through the API server) (env LABELS_SINK)
    labels_sink: str = "file"
    #: the agent's own pod, from the downward API (env POD_NAMESPACE, POD_NAME, POD_UID): the
    #: NodeFeature lives in pod_namespace ("" = the service account's namespace file) and is
    #: owned by the pod (pod_name and pod_uid; either empty = no owner reference)
    pod_namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    # --- timers
    sample_interval_s: float = 10.0  # metrics sampler period
    pod_resources_refresh_s: float = 10.0  # pod-resources List cache period
    idle_utilization_threshold_pct: float = 5.0
    # --- logging
    log_format: str = "text"  # text | json
    log_level: str = "INFO"
    # --- DRA mode (issue 12): serve the GPUs as a DRA driver instead of device plugins
    mode: str = "device-plugin"  # device-plugin | dra (env AGENT_MODE)
    driver_name: str = "gpu.gpu-agent.io"  # DRA driver name, a DNS subdomain (env DRA_DRIVER_NAME)
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"  # kubelet's plugin watcher dir
    plugins_dir: str = "/var/lib/kubelet/plugins"  # <dir>/<driver>/dra.sock + the claim checkpoint
    cdi_dir: str = "/var/run/cdi"  # one CDI spec per prepared claim is written here
    #: API server access for every API-server user (ResourceClaims/Slices, the NodeFeature
    #: label sink): a kubeconfig file; "" = the pod's in-cluster configuration (env KUBECONFIG)
    kubeconfig: str = ""
    #: delete the node's ResourceSlices on a clean stop (default keep: a restarting agent
    #: must not make the node's GPUs vanish for the scheduler) (env DELETE_SLICES_ON_SHUTDOWN)
    delete_slices_on_shutdown: bool = False
    # --- where it came from (for the start-up log line)
    config_file: str | None = None


# ----------------------------------------------------------------------------- loading

MIG_STRATEGIES = ("none", "single", "mixed")
ALLOCATION_POLICIES = ("best-effort",)  # the topology policy of issue 3; no other is built
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES = ("uuid", "index")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MODES = ("device-plugin", "dra")
LABEL_SINKS = ("file", "nodefeature")

#: Environment variables read by :func:`load_config` (the anchor's names) -> Config field.
ENV_FIELDS: Mapping[str, str] = {
    "MIG_STRATEGY": "mig_strategy",
    "FAIL_ON_INIT_ERROR": "fail_on_init_error",
    "NVIDIA_DRIVER_ROOT": "nvidia_driver_root",
    "PASS_DEVICE_SPECS": "pass_device_specs",
    "DEVICE_LIST_STRATEGY": "device_list_strategy",
    "DEVICE_ID_STRATEGY": "device_id_strategy",
    "CDI_ANNOTATION_PREFIX": "cdi_annotation_prefix",
    "NODE_NAME": "node_name",
    "KUBELET_DIR": "kubelet_dir",
    "METRICS_ADDRESS": "metrics_address",
    "LOG_FORMAT": "log_format",
    "LOG_LEVEL": "log_level",
    "HEALTH_RECOVERY_S": "health_recovery_s",
    "SAMPLE_INTERVAL_S": "sample_interval_s",
    "POD_RESOURCES_REFRESH_S": "pod_resources_refresh_s",
    "SOCKET_NAME": "socket_name",
    "FEATURE_FILE": "feature_file",
    "LABEL_INTERVAL_S": "label_interval_s",
    "GFD_NO_TIMESTAMP": "no_timestamp",
    "LABELS_SINK": "labels_sink",
    "POD_NAMESPACE": "pod_namespace",
    "POD_NAME": "pod_name",
    "POD_UID": "pod_uid",
    "AGENT_MODE": "mode",
    "DRA_DRIVER_NAME": "driver_name",
    "PLUGINS_REGISTRY_DIR": "plugins_registry_dir",
    "PLUGINS_DIR": "plugins_dir",
    "CDI_DIR": "cdi_dir",
    "KUBECONFIG": "kubeconfig",
    "DELETE_SLICES_ON_SHUTDOWN": "delete_slices_on_shutdown",
}

#: Fields holding paths: made absolute when the configuration is loaded (a relative
#: pod-resources socket would otherwise become ``unix://relative/path`` and never connect).
PATH_FIELDS = ("kubelet_dir", "pod_resources_socket", "features_dir", "sysfs_root", "nvidia_driver_root", "config_file")

# Keys of the NVIDIA device plugin's file that we accept and do not act on (GFD settings,
# MPS/GDS knobs of other components): accepted so that the anchor's files load unchanged.
_IGNORED_FLAG_KEYS = (
    "gfd", "mpsRoot", "gdsEnabled", "mofedEnabled",
    "deviceDiscoveryStrategy", "imexChannelIDs", "imexRequired",
)
_IGNORED_PLUGIN_KEYS = ("nvidiaCTKPath", "containerDriverRoot", "nvidiaDevRoot")


def _expect_bool(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off", ""):
        return False
    raise ValueError(f"{where}: expected true or false, got {value!r}")


def _expect_choice(value: object, choices: tuple[str, ...], where: str) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ValueError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")


def _expect_number(value: object, where: str, minimum: float = 0.0) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if number < minimum or number != number:
        raise ValueError(f"{where}: expected a number >= {minimum:g}, got {value!r}")
    return number


def _expect_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {value!r}")
    return value


def _expect_file_name(value: object, where: str) -> str:
    name = _expect_str(value, where)
    if not name or "/" in name or name.startswith(".") or name == "kubelet.sock":
        raise ValueError(f"{where}: expected a file name (no '/', not a dot-file, not kubelet.sock), got {name!r}")
    return name


def _expect_items(value: object, where: str, expected: str) -> list[object]:
    """A YAML list, or a comma-separated string (environment variables, flags)."""
    if isinstance(value, str):
        return [v for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{where}: expected {expected}, got {value!r}")


def _expect_list_strategy(value: object, where: str) -> tuple[str, ...]:
    items = _expect_items(value, where, "a strategy name or a list of them")
    if not items:
        raise ValueError(f"{where}: expected at least one of {', '.join(DEVICE_LIST_STRATEGIES)}")
    out: list[str] = []
    for item in items:
        choice = _expect_choice(item, DEVICE_LIST_STRATEGIES, where)
        if choice not in out:
            out.append(choice)
    return tuple(out)


def _expect_xids(value: object, where: str) -> tuple[int, ...]:
    items = _expect_items(value, where, "a list of XID numbers")
    out: list[int] = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise TypeError
            xid = int(str(item).strip())
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected XID numbers, got {item!r}") from None
        if xid < 0:
            raise ValueError(f"{where}: expected XID numbers >= 0, got {item!r}")
        out.append(xid)
    return tuple(sorted(set(out)))


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
            raise ValueError(
                f"{prefix}{key}: unknown key (expected one of {', '.join(allowed)})"
            )


def _is_device_index(text: str) -> bool:
    """``"3"`` (a GPU index) or ``"3:1"`` (MIG device 1 of GPU 3)."""
    parts = text.split(":")
    return len(parts) in (1, 2) and all(p.isdigit() for p in parts)


def _parse_time_slicing(section: Mapping[str, Any], out: dict[str, object]) -> None:
    where = "sharing.timeSlicing"
    _check_keys(section, ("renameByDefault", "failRequestsGreaterThanOne", "resources"), where)
    if "renameByDefault" in section:
        out["rename_by_default"] = _expect_bool(section["renameByDefault"], f"{where}.renameByDefault")
    if "failRequestsGreaterThanOne" in section:
        out["fail_requests_greater_than_one"] = _expect_bool(
            section["failRequestsGreaterThanOne"], f"{where}.failRequestsGreaterThanOne"
        )
    resources = section.get("resources") or []
    if not isinstance(resources, list):
        raise ValueError(f"{where}.resources: expected a list, got {type(resources).__name__}")
    parsed: list[TimeSlicingResource] = []
    for i, entry in enumerate(resources):
        at = f"{where}.resources[{i}]"
        entry = _expect_mapping(entry, at)
        _check_keys(entry, ("name", "replicas", "rename", "devices"), at)
        name = _expect_str(entry.get("name"), f"{at}.name")
        if name != GPU_RESOURCE and not name.startswith(MIG_RESOURCE_PREFIX):
            raise ValueError(f"{at}.name: expected nvidia.com/gpu or nvidia.com/mig-<profile>, got {name!r}")
        replicas = entry.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"{at}.replicas: expected an integer >= 1, got {replicas!r}")
        rename = entry.get("rename")
        if rename is not None:
            rename = _expect_str(rename, f"{at}.rename")
            if "/" in rename or not rename:
                raise ValueError(f"{at}.rename: expected a resource name without a domain, got {rename!r}")
        devices_raw = entry.get("devices", "all")
        devices: tuple[str, ...] | None
        if devices_raw is None or devices_raw == "all":
            devices = None
        elif isinstance(devices_raw, list) and devices_raw:
            devices = tuple(str(d).strip() for d in devices_raw)
            for d in devices:
                if not (_is_device_index(d) or d.startswith("GPU-") or d.startswith("MIG-")):
                    raise ValueError(
                        f"{at}.devices: expected GPU indices, MIG indices (GPU:MIG), GPU or MIG UUIDs, got {d!r}"
                    )
        else:
            raise ValueError(f"{at}.devices: expected \"all\" or a non-empty list, got {devices_raw!r}")
        parsed.append(TimeSlicingResource(name=name, replicas=replicas, rename=rename, devices=devices))
    out["time_slicing"] = tuple(parsed)


def _parse_file_document(doc: object) -> dict[str, object]:
    """The Config fields a parsed config file sets; raises ValueError naming key and expectation."""
    doc = _expect_mapping(doc, "(top level)")
    _check_keys(doc, ("version", "flags", "sharing", "resources", "health", "metrics", "mode", "dra"), "")
    if doc.get("version") != "v1":
        raise ValueError(f"version: expected \"v1\", got {doc.get('version')!r}")
    out: dict[str, object] = {}
    _parse_flags(_expect_mapping(doc.get("flags"), "flags"), out)
    sharing = _expect_mapping(doc.get("sharing"), "sharing")
    _check_keys(sharing, ("timeSlicing", "mps"), "sharing")
    if sharing.get("mps"):
        raise ValueError("sharing.mps: MPS sharing is not supported by gpu-topology-agent (use timeSlicing)")
    if "timeSlicing" in sharing:
        _parse_time_slicing(_expect_mapping(sharing["timeSlicing"], "sharing.timeSlicing"), out)
    _parse_health(_expect_mapping(doc.get("health"), "health"), out)
    _parse_dra_file_keys(doc, out)
    _parse_metrics(_expect_mapping(doc.get("metrics"), "metrics"), out)
    return out


def _parse_flags(flags: Mapping[str, Any], out: dict[str, object]) -> None:
    """The file's ``flags`` section (with ``flags.plugin`` and ``flags.gfd``) into ``out``."""
    _check_keys(
        flags,
        ("migStrategy", "failOnInitError", "nvidiaDriverRoot", "plugin",
         "sharedDevicesAllocationPolicy", "allocationPolicy", "featureFile", "labelIntervalSeconds",
         "labelsSink", "useNodeFeatureAPI", "kubeconfig")
        + _IGNORED_FLAG_KEYS,
        "flags",
    )
    if "migStrategy" in flags:
        out["mig_strategy"] = _expect_choice(flags["migStrategy"], MIG_STRATEGIES, "flags.migStrategy")
    if "failOnInitError" in flags:
        out["fail_on_init_error"] = _expect_bool(flags["failOnInitError"], "flags.failOnInitError")
    if "nvidiaDriverRoot" in flags:
        out["nvidia_driver_root"] = _expect_str(flags["nvidiaDriverRoot"], "flags.nvidiaDriverRoot")
    if "sharedDevicesAllocationPolicy" in flags:
        out["shared_devices_allocation_policy"] = _expect_choice(
            flags["sharedDevicesAllocationPolicy"], REPLICA_POLICIES, "flags.sharedDevicesAllocationPolicy"
        )
    if "allocationPolicy" in flags:
        out["allocation_policy"] = _expect_choice(
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
        out["pass_device_specs"] = _expect_bool(plugin["passDeviceSpecs"], "flags.plugin.passDeviceSpecs")
    if "deviceListStrategy" in plugin:
        out["device_list_strategy"] = _expect_list_strategy(
            plugin["deviceListStrategy"], "flags.plugin.deviceListStrategy"
        )
    if "deviceIDStrategy" in plugin:
        out["device_id_strategy"] = _expect_choice(
            plugin["deviceIDStrategy"], DEVICE_ID_STRATEGIES, "flags.plugin.deviceIDStrategy"
        )
    if "socketName" in plugin:
        out["socket_name"] = _expect_file_name(plugin["socketName"], "flags.plugin.socketName")
    if "featureFile" in flags:
        out["feature_file"] = _expect_file_name(flags["featureFile"], "flags.featureFile")
    if "labelIntervalSeconds" in flags:
        out["label_interval_s"] = _expect_number(flags["labelIntervalSeconds"], "flags.labelIntervalSeconds", 0.1)
    _parse_labels_sink(flags, out)
    if flags.get("kubeconfig") is not None:  # "kubeconfig:" left empty = in-cluster
        out["kubeconfig"] = _expect_str(flags["kubeconfig"], "flags.kubeconfig")
    gfd = _expect_mapping(flags.get("gfd"), "flags.gfd")
    if "noTimestamp" in gfd:
        out["no_timestamp"] = _expect_bool(gfd["noTimestamp"], "flags.gfd.noTimestamp")
    if "cdiAnnotationPrefix" in plugin:
        out["cdi_annotation_prefix"] = _expect_str(plugin["cdiAnnotationPrefix"], "flags.plugin.cdiAnnotationPrefix")


def _parse_labels_sink(flags: Mapping[str, Any], out: dict[str, object]) -> None:
    """``flags.labelsSink``, or NVIDIA's ``flags.useNodeFeatureAPI`` (true: nodefeature)."""
    sink = None
    if "labelsSink" in flags:
        sink = _expect_choice(flags["labelsSink"], LABEL_SINKS, "flags.labelsSink")
    if flags.get("useNodeFeatureAPI") is not None:
        nvidia = "nodefeature" if _expect_bool(flags["useNodeFeatureAPI"], "flags.useNodeFeatureAPI") else "file"
        if sink is not None and sink != nvidia:
            raise ValueError(f"flags.useNodeFeatureAPI: says {nvidia} but flags.labelsSink says {sink}: keep one")
        sink = nvidia
    if sink is not None:
        out["labels_sink"] = sink


def _parse_health(health: Mapping[str, Any], out: dict[str, object]) -> None:
    _check_keys(health, ("enabled", "ignoredXids", "criticalXids", "recoverySeconds"), "health")
    if "enabled" in health:
        out["health_checks_enabled"] = _expect_bool(health["enabled"], "health.enabled")
    if "ignoredXids" in health:
        out["ignored_xids"] = _expect_xids(health["ignoredXids"], "health.ignoredXids")
    if "criticalXids" in health:
        out["extra_critical_xids"] = _expect_xids(health["criticalXids"], "health.criticalXids")
    if "recoverySeconds" in health:
        out["health_recovery_s"] = _expect_number(health["recoverySeconds"], "health.recoverySeconds")


def _parse_metrics(metrics: Mapping[str, Any], out: dict[str, object]) -> None:
    _check_keys(
        metrics,
        ("sampleIntervalSeconds", "podResourcesRefreshSeconds", "idleThresholdPercent"),
        "metrics",
    )
    if "sampleIntervalSeconds" in metrics:
        out["sample_interval_s"] = _expect_number(
            metrics["sampleIntervalSeconds"], "metrics.sampleIntervalSeconds", 0.1
        )
    if "podResourcesRefreshSeconds" in metrics:
        out["pod_resources_refresh_s"] = _expect_number(
            metrics["podResourcesRefreshSeconds"], "metrics.podResourcesRefreshSeconds", 0.1
        )
    if "idleThresholdPercent" in metrics:
        threshold = _expect_number(metrics["idleThresholdPercent"], "metrics.idleThresholdPercent")
        if threshold > 100:
            raise ValueError(f"metrics.idleThresholdPercent: expected 0 to 100, got {threshold:g}")
        out["idle_utilization_threshold_pct"] = threshold


def _read_config_file(path: str) -> dict[str, object]:
    try:
        doc = read_document(path, "config file")
    except InputFormatError as exc:  # unreadable, not UTF-8, not YAML/JSON: one line, exit 2
        raise ConfigError(str(exc)) from None
    try:
        return _parse_file_document(doc)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _expect_driver_name(value: object, where: str) -> str:
    """A DRA driver name: a lowercase DNS subdomain (the API server rejects anything else)."""
    import re

    name = _expect_str(value, where).strip()
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    if len(name) > 63 or not re.fullmatch(rf"{label}(\.{label})*", name):
        raise ValueError(
            f"{where}: expected a DRA driver name (a lowercase DNS subdomain of at most 63"
            f" characters, e.g. gpu.gpu-agent.io), got {value!r}"
        )
    return name


_FIELD_PARSERS: Mapping[str, Any] = {
    "mig_strategy": lambda v, w: _expect_choice(v, MIG_STRATEGIES, w),
    "fail_on_init_error": _expect_bool,
    "pass_device_specs": _expect_bool,
    "device_list_strategy": _expect_list_strategy,
    "device_id_strategy": lambda v, w: _expect_choice(v, DEVICE_ID_STRATEGIES, w),
    "shared_devices_allocation_policy": lambda v, w: _expect_choice(v, REPLICA_POLICIES, w),
    "rename_by_default": _expect_bool,
    "fail_requests_greater_than_one": _expect_bool,
    "health_checks_enabled": _expect_bool,
    "ignored_xids": _expect_xids,
    "extra_critical_xids": _expect_xids,
    "health_recovery_s": _expect_number,
    "sample_interval_s": lambda v, w: _expect_number(v, w, 0.1),
    "pod_resources_refresh_s": lambda v, w: _expect_number(v, w, 0.1),
    "label_interval_s": lambda v, w: _expect_number(v, w, 0.1),
    "idle_utilization_threshold_pct": _expect_number,
    "socket_name": _expect_file_name,
    "feature_file": _expect_file_name,
    "no_timestamp": _expect_bool,
    "log_format": lambda v, w: _expect_choice(v, LOG_FORMATS, w),
    "log_level": lambda v, w: _expect_choice(str(v).upper(), tuple(x.lower() for x in LOG_LEVELS), w).upper(),
    "mode": lambda v, w: _expect_choice(v, MODES, w),
    "driver_name": _expect_driver_name,
    "delete_slices_on_shutdown": _expect_bool,
    "labels_sink": lambda v, w: _expect_choice(v, LABEL_SINKS, w),
}


#: The config file's ``dra:`` section: key -> Config field.
DRA_FILE_KEYS: Mapping[str, str] = {
    "driverName": "driver_name",
    "pluginsRegistryDir": "plugins_registry_dir",
    "pluginsDir": "plugins_dir",
    "cdiDir": "cdi_dir",
    "kubeconfig": "kubeconfig",
    "deleteSlicesOnShutdown": "delete_slices_on_shutdown",
}


def _parse_dra_file_keys(doc: Mapping[str, Any], out: dict[str, object]) -> None:
    """Top-level ``mode:`` and the ``dra:`` section of a config file."""
    if "mode" in doc:
        out["mode"] = _expect_choice(doc["mode"], MODES, "mode")
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
            out[name] = _parse_field(name, value, f"dra.{key}")

def _parse_field(name: str, value: object, where: str) -> object:
    parser = _FIELD_PARSERS.get(name)
    if parser is not None:
        return parser(value, where)
    return _expect_str(value, where) if not isinstance(value, str) else value


def _env_overrides(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for var, name in ENV_FIELDS.items():
        if var in env and env[var] != "":
            out[name] = _parse_field(name, env[var], f"environment {var}")
    # The anchor's health switches: DP_DISABLE_HEALTHCHECKS=all|xids|<list of XIDs to skip>,
    # DP_ENABLE_HEALTHCHECKS=all|<list of XIDs to treat as critical although ignored>.
    disable = env.get("DP_DISABLE_HEALTHCHECKS", "").strip().lower()
    if disable:
        words = {w.strip() for w in disable.split(",") if w.strip()}
        if "all" in words or "xids" in words:
            out["health_checks_enabled"] = False
        else:
            out["_disable_xids"] = _expect_xids(disable, "environment DP_DISABLE_HEALTHCHECKS")
    enable = env.get("DP_ENABLE_HEALTHCHECKS", "").strip().lower()
    if enable:
        if {w.strip() for w in enable.split(",")} & {"all", "xids"}:
            out["ignored_xids"] = ()
        else:
            out["_enable_xids"] = _expect_xids(enable, "environment DP_ENABLE_HEALTHCHECKS")
    return out


def _check_consistency(config: Config) -> None:
    where = config.config_file or "configuration"
    if config.metrics_address:
        try:
            parse_host_port(config.metrics_address, "metrics_address")
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if config.mig_strategy == "single" or config.mig_strategy == "none":
        for ts in config.time_slicing:
            if ts.name.startswith(MIG_RESOURCE_PREFIX):
                raise ConfigError(
                    f"{where}: sharing.timeSlicing.resources: {ts.name} needs migStrategy mixed,"
                    f" got {config.mig_strategy}"
                )


def load_config(
    config_file: str | None,
    env: Mapping[str, str],
    flags: Mapping[str, object],
) -> Config:
    """Build the effective :class:`Config`.

    Precedence: ``flags`` > ``env`` > the config file > defaults. ``config_file`` (or, when
    None, ``env["CONFIG_FILE"]``) is an NVIDIA device plugin config (``version: v1``, YAML or
    JSON) plus our optional ``health:`` section. ``flags`` maps Config field names to values;
    None values mean "not given". Raises :class:`ConfigError` naming the file (or variable),
    the key and what was expected.
    """
    path = config_file or env.get("CONFIG_FILE") or None
    values: dict[str, object] = {}
    if path:
        values.update(_read_config_file(path))
        values["config_file"] = path
    try:
        values.update(_env_overrides(env))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    known = {f.name for f in fields(Config)}
    for name, value in flags.items():
        if value is None:
            continue
        if name not in known:
            raise ConfigError(f"unknown setting {name!r}")
        try:
            values[name] = _parse_field(name, value, f"--{name.replace('_', '-')}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # both come from _env_overrides, parsed by _expect_xids
    disable_xids = cast("tuple[int, ...]", values.pop("_disable_xids", ()))
    enable_xids = cast("tuple[int, ...]", values.pop("_enable_xids", ()))
    config = Config(**values)  # type: ignore[arg-type]
    if disable_xids or enable_xids:
        config = replace(
            config,
            ignored_xids=tuple(sorted(set(config.ignored_xids) | set(disable_xids))),
            extra_critical_xids=tuple(sorted(set(config.extra_critical_xids) | set(enable_xids))),
        )
    _check_consistency(config)
    return replace(config, **{f: os.path.abspath(v) for f in PATH_FIELDS if (v := getattr(config, f))})


def is_critical_xid(config: Config, xid: int) -> bool:
    """True when the health watcher treats ``xid`` as a GPU fault."""
    return xid in config.extra_critical_xids or xid not in config.ignored_xids


def describe_config(config: Config) -> dict[str, object]:
    """The effective configuration as plain data, for the start-up log line."""
    out: dict[str, object] = {}
    for f in fields(Config):
        value = getattr(config, f.name)
        if f.name == "time_slicing":
            value = [
                {"name": t.name, "replicas": t.replicas, "rename": t.rename,
                 "devices": list(t.devices) if t.devices is not None else "all"}
                for t in value
            ]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def default_environ() -> Mapping[str, str]:
    """The process environment, as every subcommand hands it to :func:`load_config`."""
    return os.environ
