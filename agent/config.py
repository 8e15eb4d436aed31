"""One frozen settings object for the whole agent.

Sources, lowest precedence first: built-in defaults < config file (NVIDIA device plugin
format ``version: v1``, YAML or JSON: :mod:`agent.config_file`) < environment variables <
command-line flags. It is built once at start (and again on SIGHUP) and passed down; the
subcommands hand the loader the environment (:func:`default_environ`) and no other module
reads a setting from it (the engine switch ``AGENT_PUREPYTHON`` is read by
:mod:`agent.topology.engine`).

The loader (``load_config``) lives here too; field documentation says unit, default and why.
Each value is checked by :mod:`agent.config_values`, whichever source gives it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Mapping, cast

from agent.config_file import TimeSlicingResource as TimeSlicingResource
from agent.config_file import read_config_file
from agent.config_values import expect_xids, parse_field
from agent.errors import ConfigError, shorten
from agent.formats import parse_host_port

#: XIDs that do not indicate a GPU fault (application errors), skipped by the health
#: watcher unless configured otherwise; the same defaults as NVIDIA's device plugin.
DEFAULT_IGNORED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)


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
    kubeconfig: str = ""  # API server access for ResourceClaims/Slices; "" = in-cluster config
    #: delete the node's ResourceSlices on a clean stop (default keep: a restarting agent
    #: must not make the node's GPUs vanish for the scheduler) (env DELETE_SLICES_ON_SHUTDOWN)
    delete_slices_on_shutdown: bool = False
    #: the effect of the device taint on an unhealthy GPU and every GPU set holding it:
    #: NoSchedule (no new claims; running pods keep it) or NoExecute (pods using it are
    #: evicted unless they tolerate it) (env DRA_TAINT_EFFECT)
    taint_effect: str = "NoSchedule"
    # --- where it came from (for the start-up log line)
    config_file: str | None = None


# ----------------------------------------------------------------------------- loading

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
    "AGENT_MODE": "mode",
    "DRA_DRIVER_NAME": "driver_name",
    "PLUGINS_REGISTRY_DIR": "plugins_registry_dir",
    "PLUGINS_DIR": "plugins_dir",
    "CDI_DIR": "cdi_dir",
    "KUBECONFIG": "kubeconfig",
    "DELETE_SLICES_ON_SHUTDOWN": "delete_slices_on_shutdown",
    "DRA_TAINT_EFFECT": "taint_effect",
}

#: Fields holding paths: made absolute when the configuration is loaded (a relative
#: pod-resources socket would otherwise become ``unix://relative/path`` and never connect).
PATH_FIELDS = ("kubelet_dir", "pod_resources_socket", "features_dir", "sysfs_root", "nvidia_driver_root", "config_file")


def _env_overrides(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for var, name in ENV_FIELDS.items():
        if var in env and env[var] != "":
            out[name] = parse_field(name, env[var], f"environment {var}")
    # The anchor's health switches: DP_DISABLE_HEALTHCHECKS=all|xids|<list of XIDs to skip>,
    # DP_ENABLE_HEALTHCHECKS=all|<list of XIDs to treat as critical although ignored>.
    disable = env.get("DP_DISABLE_HEALTHCHECKS", "").strip().lower()
    if disable:
        words = {w.strip() for w in disable.split(",") if w.strip()}
        if "all" in words or "xids" in words:
            out["health_checks_enabled"] = False
        else:
            out["_disable_xids"] = expect_xids(disable, "environment DP_DISABLE_HEALTHCHECKS")
    enable = env.get("DP_ENABLE_HEALTHCHECKS", "").strip().lower()
    if enable:
        if {w.strip() for w in enable.split(",")} & {"all", "xids"}:
            out["ignored_xids"] = ()
        else:
            out["_enable_xids"] = expect_xids(enable, "environment DP_ENABLE_HEALTHCHECKS")
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
            if ts.name.startswith("nvidia.com/mig-"):
                raise ConfigError(
                    f"{where}: sharing.timeSlicing.resources: {shorten(ts.name)} needs migStrategy mixed,"
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
        values.update(read_config_file(path))
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
            raise ConfigError(f"unknown setting {shorten(repr(name))}")
        try:
            values[name] = parse_field(name, value, f"--{name.replace('_', '-')}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # both come from _env_overrides, parsed by expect_xids
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
