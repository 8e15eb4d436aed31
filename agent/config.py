"""One frozen settings object for the whole agent.

Sources, lowest precedence first: built-in defaults < config file (NVIDIA device plugin
format ``version: v1``, YAML or JSON: :mod:`agent.config_file`) < environment variables <
command-line flags. It is built once at start (and again on SIGHUP) and passed down; the
subcommands hand the loader the environment (:func:`default_environ`) and no other module
reads a setting from it (the engine switch ``AGENT_PUREPYTHON`` is read by
:mod:`agent.topology.kernel`).

The loader (``load_config``) lives here too; field documentation says unit, default and why.
Each value is checked by :mod:`agent.config_values`, whichever source gives it.

Size: one frozen object documented field by field (unit, default, why) is the module's job;
its fields grow with the features, and the loader that builds it belongs beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Mapping, cast

from agent.config_file import TimeSlicingResource as TimeSlicingResource
from agent.config_file import read_config_file
from agent.config_values import expect_xids, got, parse_field
from agent.errors import ConfigError, shorten
from agent.formats import parse_host_port

#: The DRA driver name by default (its device classes, CDI kind and slices are named after it).
DEFAULT_DRIVER_NAME = "gpu.gpu-agent.io"

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
    # --- sharing: time-slicing or MPS, never both (the file's sharing.timeSlicing / sharing.mps)
    time_slicing: tuple[TimeSlicingResource, ...] = ()
    mps: tuple[TimeSlicingResource, ...] = ()
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False  # true by default under sharing.mps (as in NVIDIA's device plugin)
    #: MPS: each shared resource's control daemon keeps its pipe and log directories under
    #: <mps_root>/<resource>/ and pods mount <mps_root>/shm as /dev/shm (flags.mpsRoot, env
    #: MPS_ROOT, NVIDIA's device plugin's default): the agent must see this host directory at this path
    mps_root: str = "/run/nvidia/mps"
    #: the MPS control program, a name on the PATH or a path (flags.mpsControlBinary, env
    #: MPS_CONTROL_BINARY): the agent runs one control daemon per MPS-shared resource
    mps_control_binary: str = "nvidia-cuda-mps-control"
    #: nvidia-smi, a name on the PATH or a path (flags.nvidiaSmi, env NVIDIA_SMI): DRA claims
    #: asking for a time-slice interval have it set with ``nvidia-smi compute-policy``
    nvidia_smi: str = "nvidia-smi"
    # --- health
    health_checks_enabled: bool = True
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    extra_critical_xids: tuple[int, ...] = ()  # XIDs made critical although in ignored list
    health_recovery_s: float = 300.0  # a GPU quiet this long becomes healthy again
    #: seconds between two reads of the watched facts (GPU count, row remapping, NVLinks,
    #: fabric, the driver's recovery action: agent.health.facts_check)
    health_facts_interval_s: float = 30.0
    #: the GPUHealthy Node condition and the Node's Events: auto (on where a node name and an API
    #: server are configured), on, off, dry-run (logged, not written) (env HEALTH_NODE_CONDITION,
    #: file health.nodeCondition)
    node_condition: str = "auto"
    #: the kernel log read for NVRM Xid and NVSwitch SXid lines: /dev/kmsg, or a plain file or
    #: FIFO followed like tail -f (the simulator's way to inject faults); "" = not read
    #: (flag --kernel-log, env KERNEL_LOG, file health.kernelLog)
    kernel_log: str = "/dev/kmsg"
    #: single XIDs treated otherwise than NVIDIA's catalog says: (XID, ignore | application |
    #: reset | reboot | memory | nvlink | support) (file health.xids, env HEALTH_XIDS "48=reset,...")
    xid_overrides: tuple[tuple[int, str], ...] = ()
    #: an application XID seen this many times on one GPU within the window is a fault
    #: (RepeatedApplicationXID); NVIDIA's catalog: a repeat on the same GPU may be hardware
    #: (file health.repeatedXids.count / .windowSeconds, env HEALTH_REPEATED_XID_COUNT / _WINDOW_S)
    repeated_xid_count: int = 5
    repeated_xid_window_s: float = 86400.0
    #: where standing faults and the kernel log position survive a restart; "" = beside the
    #: plugin sockets' directory: <kubelet_dir>/../gpu-topology-agent/health-state.json, in DRA
    #: mode <plugins_dir>/<driver>/health-state.json (env HEALTH_STATE_FILE)
    health_state_file: str = ""
    # --- paths and endpoints (the `run` flags)
    kubelet_dir: str = "/var/lib/kubelet/device-plugins"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    features_dir: str = "/etc/kubernetes/node-feature-discovery/features.d"
    metrics_address: str = ":9400"
    probe_address: str = ""  # /health, /ready for the kubelet; "" = see probe_address_of
    web_config_file: str = ""  # exporter-toolkit web config (TLS, basic auth); "" = plain HTTP
    node_name: str = ""
    sysfs_root: str = "/sys"
    #: where the host's /proc is: the cgroup of each GPU process (NVML's host PIDs) names
    #: its container (the host PID namespace, or the host's /proc mounted elsewhere)
    proc_root: str = "/proc"
    #: the container runtime's CRI socket (read-only ListContainers: container -> pod);
    #: containerd's default; CRI-O's is /var/run/crio/crio.sock
    cri_socket: str = "/run/containerd/containerd.sock"
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
    driver_name: str = DEFAULT_DRIVER_NAME  # DRA driver name, a DNS subdomain (env DRA_DRIVER_NAME)
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"  # kubelet's plugin watcher dir
    plugins_dir: str = "/var/lib/kubelet/plugins"  # <dir>/<driver>/dra.sock + the claim checkpoint
    cdi_dir: str = "/var/run/cdi"  # one CDI spec per prepared claim is written here
    #: API server access for every API-server user (ResourceClaims/Slices, the NodeFeature
    #: label sink): a kubeconfig file; "" = the pod's in-cluster configuration (env KUBECONFIG)
    kubeconfig: str = ""
    #: delete the node's ResourceSlices on a clean stop (default keep: a restarting agent
    #: must not make the node's GPUs vanish for the scheduler) (env DELETE_SLICES_ON_SHUTDOWN)
    delete_slices_on_shutdown: bool = False
    # --- per-node configs (issue 18), as NVIDIA's config-manager names and reads them
    #: directory of named config files (the ConfigMap, one key each); when set, the node's
    #: label ``node_label`` names the config to apply instead of ``--config``
    #: (env CONFIG_FILE_SRCDIR)
    config_file_srcdir: str = ""
    #: the config of a node without the label (env DEFAULT_CONFIG); empty: the fallbacks
    default_config: str = ""
    node_label: str = "nvidia.com/device-plugin.config"  # env NODE_LABEL
    #: without the label and a default: ``named`` (the config called ``default``), then
    #: ``single`` (the only config), NVIDIA's chart's order (env FALLBACK_STRATEGIES)
    fallback_strategies: tuple[str, ...] = ("named", "single")
    # --- IMEX channels (NVIDIA's top-level ``imex:`` section)
    imex_channel_ids: tuple[int, ...] = ()  # [] or [0] (env IMEX_CHANNEL_IDS)
    imex_required: bool = False  # a configured channel missing on the node is an error (env IMEX_REQUIRED)
    #: the effect of the device taint on an unhealthy GPU and every GPU set holding it:
    #: NoSchedule (no new claims; running pods keep it) or NoExecute (pods using it are
    #: evicted unless they tolerate it) (env DRA_TAINT_EFFECT)
    taint_effect: str = "NoSchedule"
    #: publish GPU sets (counters, set devices): auto (by the API server's version: on from
    #: Kubernetes 1.37, whose scheduler gathers a node's counters for that node only; off
    #: before, where every counter slice costs every node's Filter), on, off (env DRA_GPU_SETS)
    gpu_sets: str = "auto"
    #: a published GPU set one of whose GPUs is held through another device stays this long,
    #: tainted (no new claim gets it), before it is withdrawn; 0: at once (the rule before
    #: the grace, unsafe when the scheduler's view of the slices lags) (env DRA_GPU_SET_WITHDRAWAL_GRACE_S)
    gpu_set_withdrawal_grace_s: float = 60.0
    #: publish MIG profiles on placements as devices of MIG-capable GPUs, cut on demand at
    #: prepare (docs/dra/mig.md): off (the default until it has met a real GPU) or on
    #: (env DRA_DYNAMIC_MIG)
    dynamic_mig: str = "off"
    #: with dynamic MIG, how many placements of each profile a node publishes for its current
    #: layout (1-8): more keep the best-fit placement when the scheduler allocates several
    #: claims of a profile on a node before the agent re-publishes, and cost the scheduler
    #: more work on every Filter (docs/dra/mig.md) (env DRA_MIG_PLACEMENTS_PER_PROFILE)
    mig_placements_per_profile: int = 1
    # --- NCCL (issue 24; docs/nccl.md)
    #: the node's topology as an NCCL topology file laid over NVML's GPUs by bus ID ("" none)
    nccl_topology_file: str = ""
    nccl_pod_files: str = "auto"  # each container with GPUs gets its NCCL file (auto) or none (off)
    #: host dir of those files; "" = <kubelet_dir>/../gpu-topology-agent/nccl (not in
    #: device-plugins/, which the kubelet empties), in DRA mode <plugins_dir>/<driver>/nccl
    nccl_host_dir: str = ""
    nccl_mount_path: str = "/etc/nccl/topology.xml"  # the file in the container (NCCL_TOPO_FILE)
    nccl_ib_hca: bool = False  # also NCCL_IB_HCA naming the nearest NICs (opt-in)
    # --- where it came from (for the start-up log line)
    config_file: str | None = None


# ----------------------------------------------------------------------------- loading

#: Environment variables read by :func:`load_config` (NVIDIA's device plugin's names) -> Config field.
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
    "PROBE_ADDRESS": "probe_address",
    "WEB_CONFIG_FILE": "web_config_file",
    "LOG_FORMAT": "log_format",
    "LOG_LEVEL": "log_level",
    "HEALTH_RECOVERY_S": "health_recovery_s",
    "HEALTH_FACTS_INTERVAL_S": "health_facts_interval_s",
    "HEALTH_NODE_CONDITION": "node_condition",
    "KERNEL_LOG": "kernel_log",
    "HEALTH_XIDS": "xid_overrides",
    "HEALTH_REPEATED_XID_COUNT": "repeated_xid_count",
    "HEALTH_REPEATED_XID_WINDOW_S": "repeated_xid_window_s",
    "HEALTH_STATE_FILE": "health_state_file",
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
    "DRA_TAINT_EFFECT": "taint_effect",
    "DRA_GPU_SETS": "gpu_sets",
    "DRA_GPU_SET_WITHDRAWAL_GRACE_S": "gpu_set_withdrawal_grace_s",
    "DRA_DYNAMIC_MIG": "dynamic_mig",
    "DRA_MIG_PLACEMENTS_PER_PROFILE": "mig_placements_per_profile",
    "MPS_ROOT": "mps_root",
    "MPS_CONTROL_BINARY": "mps_control_binary",
    "NVIDIA_SMI": "nvidia_smi",
    "PROC_ROOT": "proc_root",
    "CRI_SOCKET": "cri_socket",
    "CONFIG_FILE_SRCDIR": "config_file_srcdir",
    "DEFAULT_CONFIG": "default_config",
    "NODE_LABEL": "node_label",
    "FALLBACK_STRATEGIES": "fallback_strategies",
    "IMEX_CHANNEL_IDS": "imex_channel_ids",
    "IMEX_REQUIRED": "imex_required",
    "NCCL_TOPOLOGY_FILE": "nccl_topology_file",
    "NCCL_POD_FILES": "nccl_pod_files",
    "NCCL_HOST_DIR": "nccl_host_dir",
    "NCCL_MOUNT_PATH": "nccl_mount_path",
    "NCCL_SET_IB_HCA": "nccl_ib_hca",
}

#: Fields holding paths: made absolute when the configuration is loaded (a relative
#: pod-resources socket would otherwise become ``unix://relative/path`` and never connect).
PATH_FIELDS = ("kubelet_dir", "pod_resources_socket", "features_dir", "sysfs_root", "nvidia_driver_root",
               "config_file", "web_config_file", "proc_root", "cri_socket", "mps_root", "config_file_srcdir",
               "nccl_topology_file", "nccl_host_dir", "kernel_log", "health_state_file")


def _env_overrides(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for var, name in ENV_FIELDS.items():
        if var in env and env[var] != "":
            out[name] = parse_field(name, env[var], f"environment {var}")
    # NVIDIA's device plugin's health switches: DP_DISABLE_HEALTHCHECKS=all|xids|<list of XIDs to skip>,
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
    try:
        metrics = parse_host_port(config.metrics_address, "metrics_address") if config.metrics_address else None
        probe_address = probe_address_of(config)
        probes = parse_host_port(probe_address, "probe_address") if probe_address else None
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if (probes is not None and metrics is not None and probes[1] == metrics[1] != 0
            and (probes[0] == metrics[0] or "" in (probes[0], metrics[0]))):
        raise ConfigError(
            f"{where}: probe_address {got(config.probe_address)}: expected another port than"
            f" metrics_address {got(config.metrics_address)} (the probes have their own listener)"
        )
    if config.mps and config.time_slicing:
        raise ConfigError(
            f"{where}: sharing: timeSlicing and mps are exclusive on a node (a GPU is shared one way);"
            " keep one of them"
        )
    if config.mps and config.mig_strategy == "mixed":
        raise ConfigError(
            f"{where}: sharing.mps: MPS cannot share MIG devices and NVIDIA's plugin refuses it with"
            " migStrategy mixed; use migStrategy none or single"
        )
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
    config = replace(config, **{f: os.path.abspath(v) for f in PATH_FIELDS if (v := getattr(config, f))})
    for program in ("mps_control_binary", "nvidia_smi"):
        if "/" in getattr(config, program):  # a path, not a name looked up on the PATH
            config = replace(config, **{program: os.path.abspath(getattr(config, program))})
    return config


def state_dir_of(config: Config) -> str:
    """The agent's own directory on the host, where its default files live (the health state,
    the containers' NCCL files): in DRA mode the driver's plugin directory, else
    ``gpu-topology-agent/`` beside the kubelet's device-plugin directory."""
    if config.mode == "dra":
        return os.path.join(config.plugins_dir, config.driver_name)
    return os.path.join(os.path.dirname(config.kubelet_dir.rstrip("/")), "gpu-topology-agent")


def probe_address_of(config: Config) -> str:
    """Where ``/health`` and ``/ready`` listen (their own listener, apart from ``/metrics``):
    ``config.probe_address``, or when it is empty the metrics address's host with the next
    port (``:9401`` by default; port 0, a free one, stays 0)."""
    if config.probe_address:
        return config.probe_address
    host, sep, port = config.metrics_address.rpartition(":")
    if not sep or not port.isdigit():
        return config.metrics_address  # parse_host_port names the bad metrics address
    return f"{host}:{int(port) + 1 if int(port) else 0}"


def is_critical_xid(config: Config, xid: int) -> bool:
    """True when the health watcher treats ``xid`` as a GPU fault."""
    return xid in config.extra_critical_xids or xid not in config.ignored_xids


#: Settings read once, at start: which servers serve the GPUs (the mode; in DRA mode the
#: driver, its directories, the API server and the node's pool), where metrics and probes
#: are served (the web config file's path; its content is re-read when it changes), what
#: the sampler polls and where it finds the pods, where the labels go (the sink, its file,
#: the pod owning its NodeFeature), the sysfs root. A reload (SIGHUP) keeps their running
#: values (:func:`keep_start_settings`): what the agent says it runs is what it runs.
#: Everything else follows a reload.
START_ONLY_FIELDS = (
    "mode", "driver_name", "plugins_registry_dir", "plugins_dir", "cdi_dir", "kubeconfig", "node_name",
    "delete_slices_on_shutdown", "taint_effect", "gpu_sets", "gpu_set_withdrawal_grace_s", "dynamic_mig",
    "mig_placements_per_profile", "metrics_address", "probe_address", "web_config_file",
    "pod_resources_socket", "proc_root", "cri_socket", "sample_interval_s", "pod_resources_refresh_s",
    "idle_utilization_threshold_pct", "labels_sink", "features_dir", "feature_file", "pod_namespace",
    "pod_name", "pod_uid", "sysfs_root", "nccl_host_dir", "node_condition", "kernel_log", "health_state_file",
)


def keep_start_settings(reloaded: Config, running: Config) -> tuple[Config, str]:
    """``reloaded`` with the running value of every setting in :data:`START_ONLY_FIELDS`,
    and "" or what the reload asked for and did not get, for the log (``mode 'dra' (running
    'device-plugin'), ...``, values shortened: they come from the file)."""
    changed = [f for f in START_ONLY_FIELDS if getattr(reloaded, f) != getattr(running, f)]
    said = ", ".join(
        f"{f} {shorten(repr(getattr(reloaded, f)), 120)} (running {shorten(repr(getattr(running, f)), 120)})"
        for f in changed
    )
    return replace(reloaded, **{f: getattr(running, f) for f in changed}), said


def describe_config(config: Config) -> dict[str, object]:
    """The effective configuration as plain data, for the start-up log line."""
    out: dict[str, object] = {}
    for f in fields(Config):
        value = getattr(config, f.name)
        if f.name in ("time_slicing", "mps"):
            value = [
                {"name": t.name, "replicas": t.replicas, "rename": t.rename,
                 "devices": list(t.devices) if t.devices is not None else "all"}
                for t in value
            ]
        elif f.name == "xid_overrides":
            value = {str(x): v for x, v in value}
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def default_environ() -> Mapping[str, str]:
    """The process environment, as every subcommand hands it to :func:`load_config`."""
    return os.environ
