"""One frozen settings object for the whole agent.

Sources, lowest precedence first: built-in defaults < config file (NVIDIA device plugin
format ``version: v1``, YAML or JSON) < environment variables < command-line flags.
It is built once at start (and again on SIGHUP) and passed down; no other module reads
the environment.

The loader (``load_config``) lives here too; field documentation says unit, default and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: XIDs that do not indicate a GPU fault (application errors), skipped by the health
#: watcher unless configured otherwise; the same defaults as NVIDIA's device plugin.
DEFAULT_IGNORED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)


@dataclass(frozen=True)
class TimeSlicingResource:
    """One entry of ``sharing.timeSlicing.resources``."""

    name: str = "nvidia.com/gpu"  # the resource being shared
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
    # --- timers
    sample_interval_s: float = 10.0  # metrics sampler period
    pod_resources_refresh_s: float = 10.0  # pod-resources List cache period
    idle_utilization_threshold_pct: float = 5.0
    # --- logging
    log_format: str = "text"  # text | json
    log_level: str = "INFO"
    # --- where it came from (for the start-up log line)
    config_file: str | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
