"""``gpu-topology-agent run``: the node agent (device plugin + labels + metrics).

Settings come from the NVIDIA device plugin config file (``--config`` or ``CONFIG_FILE``),
its environment variables and these flags; flags win (see ``agent.config.load_config``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable, Mapping

from agent.commands._common import add_simulate_flag
from agent.config import Config, default_environ, load_config
from agent.config_values import (
    DYNAMIC_MIG_MODES,
    GPU_SETS_MODES,
    MAX_MIG_PLACEMENTS_PER_PROFILE,
    TAINT_EFFECTS,
)
from agent.containers import check_imex_channels
from agent.errors import AgentError, UsageError
from agent.files import nearest_existing
from agent.nodeconfig import NamedConfigs

_DEFAULTS = Config()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run the node agent: kubelet device plugin, labels and metrics",
        description="Run the node agent until SIGTERM/SIGINT. SIGHUP reloads the configuration "
        "and re-registers with the kubelet. Precedence: flags > environment > config file > defaults.",
    )
    add_agent_flags(p)
    p.set_defaults(func=run)


def add_agent_flags(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--simulate`` and every setting flag of ``run`` (:data:`FLAG_FIELDS`):
    ``doctor`` takes the same, to check what that agent would use."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help="NVIDIA device plugin config file (version: v1), YAML or JSON "
                        "(default: $CONFIG_FILE, else none)")
    add_simulate_flag(p)
    _add_location_flags(p)
    _add_api_server_flags(p)
    _add_serving_flags(p)
    _add_dra_flags(p)
    _add_node_config_flags(p)
    _add_nccl_flags(p)
    p.add_argument("--no-timestamp", action="store_true", dest="no_timestamp", default=None,
                   help="leave out GFD's nvidia.com/gfd.timestamp label (default: include it;"
                        " env GFD_NO_TIMESTAMP, file flags.gfd.noTimestamp)")


def _add_location_flags(p: argparse.ArgumentParser) -> None:
    """Where the agent talks to the kubelet, writes labels, serves metrics and logs."""
    p.add_argument("--kubelet-dir", metavar="DIR", dest="kubelet_dir", default=None,
                   help=f"kubelet device-plugin directory holding kubelet.sock (default: {_DEFAULTS.kubelet_dir})")
    p.add_argument("--pod-resources-socket", metavar="PATH", dest="pod_resources_socket", default=None,
                   help="kubelet pod-resources socket, for pod attribution"
                        f" (default: {_DEFAULTS.pod_resources_socket})")
    p.add_argument("--features-dir", metavar="DIR", dest="features_dir", default=None,
                   help=f"NFD features.d directory for the labels file (default: {_DEFAULTS.features_dir})")
    p.add_argument("--metrics-address", metavar="HOST:PORT", dest="metrics_address", default=None,
                   help="where /metrics listens (and /health, /ready behind its TLS and auth);"
                        f" port 0 picks one (default: {_DEFAULTS.metrics_address})")
    p.add_argument("--probe-address", metavar="HOST:PORT", dest="probe_address", default=None,
                   help="where /health and /ready listen for the kubelet's probes, plain HTTP"
                        " (default: the metrics host, next port: :9401; env PROBE_ADDRESS)")
    p.add_argument("--web-config-file", metavar="PATH", dest="web_config_file", default=None,
                   help="exporter-toolkit web configuration for the metrics address: TLS and"
                        " basic auth (default: none, plain HTTP; env WEB_CONFIG_FILE)")
    p.add_argument("--node-name", metavar="NAME", dest="node_name", default=None,
                   help="node name for the Hostname metric label (default: $NODE_NAME, else the host name)")
    p.add_argument("--log-format", choices=("text", "json"), dest="log_format", default=None,
                   help="log line format (default: text)")
    p.add_argument("--log-level", metavar="LEVEL", dest="log_level", default=None,
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: INFO)")


def _add_api_server_flags(p: argparse.ArgumentParser) -> None:
    """How the agent reaches the API server (DRA, the NodeFeature sink) and who it is there."""
    p.add_argument("--kubeconfig", metavar="FILE", dest="kubeconfig", default=None,
                   help="API server access for every API-server user (default: the in-cluster"
                        " configuration; env KUBECONFIG, file flags.kubeconfig)")
    p.add_argument("--labels-sink", choices=("file", "nodefeature"), dest="labels_sink", default=None,
                   help="where labels go: NFD's feature file or an NFD NodeFeature object"
                        " (default: file; env LABELS_SINK, file flags.labelsSink)")
    p.add_argument("--pod-namespace", metavar="NAMESPACE", dest="pod_namespace", default=None,
                   help="the agent's namespace, where its NodeFeature lives (default: $POD_NAMESPACE,"
                        " else the service account's namespace)")
    p.add_argument("--pod-name", metavar="NAME", dest="pod_name", default=None,
                   help="the agent's pod, owner of its NodeFeature (default: $POD_NAME)")
    p.add_argument("--pod-uid", metavar="UID", dest="pod_uid", default=None,
                   help="the agent's pod UID, owner of its NodeFeature (default: $POD_UID)")


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
    """How the device plugins advertise and hand out GPUs, and how labels are kept."""
    p.add_argument("--mig-strategy", choices=("none", "single", "mixed"), dest="mig_strategy", default=None,
                   help="how MIG devices are advertised (default: none; env MIG_STRATEGY)")
    p.add_argument("--device-list-strategy", metavar="LIST", dest="device_list_strategy", default=None,
                   help="comma-separated: envvar, volume-mounts, cdi-annotations, cdi-cri (default: envvar)")
    p.add_argument("--device-id-strategy", choices=("uuid", "index"), dest="device_id_strategy", default=None,
                   help="IDs in NVIDIA_VISIBLE_DEVICES (default: uuid)")
    p.add_argument("--pass-device-specs", action="store_true", dest="pass_device_specs", default=None,
                   help="add /dev/nvidia* device nodes to Allocate responses (default: off)")
    p.add_argument("--health-recovery-s", metavar="SECONDS", type=float, dest="health_recovery_s", default=None,
                   help="a GPU quiet and answering NVML this long becomes healthy again (default: 300)")
    p.add_argument("--health-facts-interval-s", metavar="SECONDS", type=float, dest="health_facts_interval_s",
                   default=None, help="seconds between reads of the GPUs' health facts: GPU count, row remapping,"
                                      " NVLinks, fabric, recovery action (default: 30; env HEALTH_FACTS_INTERVAL_S)")
    p.add_argument("--node-condition", choices=("auto", "on", "off", "dry-run"), dest="node_condition",
                   default=None,
                   help="the GPUHealthy Node condition and the Node's Events: auto (where a node name and an"
                        " API server are configured), on, off, dry-run (logged, not written)"
                        " (default: auto; env HEALTH_NODE_CONDITION, file health.nodeCondition)")
    p.add_argument("--kernel-log", metavar="PATH", dest="kernel_log", default=None,
                   help="the kernel log read for NVRM Xid and NVSwitch SXid lines: /dev/kmsg, or a file or"
                        " FIFO followed like tail -f; '' = not read"
                        f" (default: {_DEFAULTS.kernel_log}; env KERNEL_LOG, file health.kernelLog)")
    p.add_argument("--health-state-file", metavar="PATH", dest="health_state_file", default=None,
                   help="where standing faults survive a restart (default: beside the plugin sockets'"
                        " directory; env HEALTH_STATE_FILE, file health.stateFile)")
    p.add_argument("--sysfs-root", metavar="DIR", dest="sysfs_root", default=None,
                   help="where sysfs is mounted (default: /sys)")
    p.add_argument("--proc-root", metavar="DIR", dest="proc_root", default=None,
                   help="the host's /proc, for the cgroups of GPU processes"
                        f" (default: {_DEFAULTS.proc_root}; env PROC_ROOT)")
    p.add_argument("--cri-socket", metavar="PATH", dest="cri_socket", default=None,
                   help="the container runtime's CRI socket, for the pods of GPU processes"
                        f" (default: {_DEFAULTS.cri_socket}; env CRI_SOCKET)")
    p.add_argument("--socket-name", metavar="NAME", dest="socket_name", default=None,
                   help="plugin socket file name in the kubelet directory; {resource} is the resource"
                        f" name after the domain (default: {_DEFAULTS.socket_name}; env SOCKET_NAME)")
    p.add_argument("--feature-file", metavar="NAME", dest="feature_file", default=None,
                   help=f"label file name in the features directory (default: {_DEFAULTS.feature_file};"
                        " env FEATURE_FILE)")
    p.add_argument("--label-interval-s", metavar="SECONDS", type=float, dest="label_interval_s", default=None,
                   help="re-assert the label file this often, restoring a deleted one"
                        f" (default: {_DEFAULTS.label_interval_s:g}; env LABEL_INTERVAL_S)")
    p.add_argument("--mps-root", metavar="DIR", dest="mps_root", default=None,
                   help="host directory of the MPS control daemons' pipe and log directories"
                        f" (sharing.mps) and the pods' shm (default: {_DEFAULTS.mps_root}; env MPS_ROOT,"
                        " file flags.mpsRoot)")
    p.add_argument("--mps-control-binary", metavar="PATH", dest="mps_control_binary", default=None,
                   help=f"the MPS control program (default: {_DEFAULTS.mps_control_binary} on the PATH;"
                        " env MPS_CONTROL_BINARY, file flags.mpsControlBinary)")
    p.add_argument("--nvidia-smi", metavar="PATH", dest="nvidia_smi", default=None,
                   help=f"nvidia-smi, which sets the time-slice interval DRA claims ask for (default:"
                        f" {_DEFAULTS.nvidia_smi} on the PATH; env NVIDIA_SMI, file flags.nvidiaSmi)")


def _add_dra_flags(p: argparse.ArgumentParser) -> None:
    dra = p.add_argument_group("DRA mode")
    dra.add_argument("--mode", choices=("device-plugin", "dra"), dest="mode", default=None,
                     help="serve the GPUs as device plugins or as a DRA driver"
                          " (default: device-plugin; env AGENT_MODE)")
    dra.add_argument("--driver-name", metavar="NAME", dest="driver_name", default=None,
                     help=f"DRA driver name (default: {_DEFAULTS.driver_name}; env DRA_DRIVER_NAME)")
    dra.add_argument("--plugins-registry-dir", metavar="DIR", dest="plugins_registry_dir", default=None,
                     help=f"the kubelet's plugin registration directory (default: {_DEFAULTS.plugins_registry_dir})")
    dra.add_argument("--plugins-dir", metavar="DIR", dest="plugins_dir", default=None,
                     help=f"where the DRA socket and checkpoint go, under <driver> (default: {_DEFAULTS.plugins_dir})")
    dra.add_argument("--cdi-dir", metavar="DIR", dest="cdi_dir", default=None,
                     help=f"where CDI specs of prepared claims are written (default: {_DEFAULTS.cdi_dir})")
    dra.add_argument("--delete-slices-on-shutdown", action="store_true", dest="delete_slices_on_shutdown",
                     default=None, help="delete the node's ResourceSlices on a clean stop"
                                        " (default: keep them; env DELETE_SLICES_ON_SHUTDOWN)")
    dra.add_argument("--taint-effect", choices=TAINT_EFFECTS, dest="taint_effect", default=None,
                     help="the device-taint effect on an unhealthy GPU and every GPU set holding it:"
                          " NoSchedule keeps running pods, NoExecute evicts them"
                          f" (default: {_DEFAULTS.taint_effect}; env DRA_TAINT_EFFECT)")
    dra.add_argument("--gpu-sets", choices=GPU_SETS_MODES, dest="gpu_sets", default=None,
                     help="publish GPU sets: auto (on where the API server is Kubernetes 1.37 or newer,"
                          " whose scheduler reads a node's counters for that node only), on, off"
                          f" (default: {_DEFAULTS.gpu_sets}; env DRA_GPU_SETS)")
    dra.add_argument("--gpu-set-withdrawal-grace-s", metavar="SECONDS", type=float,
                     dest="gpu_set_withdrawal_grace_s", default=None,
                     help="a published GPU set one of whose GPUs is held through another device (and the"
                          " single device of a GPU held through a set) stays this long, tainted, before it is"
                          " withdrawn; 0: sets at once, unsafe while the scheduler's view of the slices lags,"
                          f" singles kept (default: {_DEFAULTS.gpu_set_withdrawal_grace_s:g};"
                          " env DRA_GPU_SET_WITHDRAWAL_GRACE_S)")
    dra.add_argument("--dynamic-mig", choices=DYNAMIC_MIG_MODES, nargs="?", const="on", dest="dynamic_mig",
                     default=None, help="publish MIG profiles on placements of MIG-capable GPUs as devices, cut"
                                        " at prepare (docs/dra/mig.md); --dynamic-mig alone is on"
                                        f" (default: {_DEFAULTS.dynamic_mig}; env DRA_DYNAMIC_MIG)")
    dra.add_argument("--mig-placements-per-profile", metavar="N", dest="mig_placements_per_profile", default=None,
                     help="with dynamic MIG, the placements of each profile published for the current layout"
                          f" (1-{MAX_MIG_PLACEMENTS_PER_PROFILE}): more keep the best fit when the scheduler"
                          " allocates several claims on a node before the agent re-publishes, and cost the"
                          " scheduler more work per pod (docs/dra/mig.md)"
                          f" (default: {_DEFAULTS.mig_placements_per_profile}; env DRA_MIG_PLACEMENTS_PER_PROFILE)")


def _add_nccl_flags(p: argparse.ArgumentParser) -> None:
    """NCCL topology files: the node's (in) and each container's (out)."""
    g = p.add_argument_group("NCCL topology files")
    g.add_argument("--nccl-topology-file", metavar="FILE", dest="nccl_topology_file", default=None,
                   help="the node's topology as an NCCL topology file (VMs that hide the PCIe tree), laid"
                        " over NVML's GPUs by bus ID (default: none; env NCCL_TOPOLOGY_FILE, file"
                        " topology.ncclTopologyFile)")
    g.add_argument("--nccl-pod-files", choices=("auto", "off"), dest="nccl_pod_files", default=None,
                   help="give each container with GPUs its own NCCL topology file (default: auto;"
                        " env NCCL_POD_FILES, file nccl.topologyFile)")
    g.add_argument("--nccl-host-dir", metavar="DIR", dest="nccl_host_dir", default=None,
                   help="host directory of those files (default: <kubelet-dir>/../gpu-topology-agent/nccl,"
                        " in DRA mode <plugins-dir>/<driver>/nccl; env NCCL_HOST_DIR)")
    g.add_argument("--nccl-mount-path", metavar="PATH", dest="nccl_mount_path", default=None,
                   help=f"the file's path in the container (default: {_DEFAULTS.nccl_mount_path};"
                        " env NCCL_MOUNT_PATH)")
    g.add_argument("--nccl-ib-hca", action="store_true", dest="nccl_ib_hca", default=None,
                   help="also set NCCL_IB_HCA to the nearest NICs (default: off; env NCCL_SET_IB_HCA)")


def _add_node_config_flags(p: argparse.ArgumentParser) -> None:
    """Per-node configs (NVIDIA's config-manager's flags) and IMEX channels."""
    g = p.add_argument_group("per-node configs and IMEX")
    g.add_argument("--config-file-srcdir", metavar="DIR", dest="config_file_srcdir", default=None,
                   help="directory of named configs (a ConfigMap): the node's label names its config,"
                        " instead of --config (default: none; env CONFIG_FILE_SRCDIR)")
    g.add_argument("--default-config", metavar="NAME", dest="default_config", default=None,
                   help="the config of a node without the label (default: the fallbacks; env DEFAULT_CONFIG)")
    g.add_argument("--node-label", metavar="KEY", dest="node_label", default=None,
                   help=f"the node label naming the config (default: {_DEFAULTS.node_label}; env NODE_LABEL)")
    g.add_argument("--fallback-strategies", metavar="LIST", dest="fallback_strategies", default=None,
                   help="without label and default: named (the config called default), single (the only"
                        " one), in order (default: named,single; env FALLBACK_STRATEGIES)")
    g.add_argument("--imex-channel-ids", metavar="LIST", dest="imex_channel_ids", default=None,
                   help="IMEX channels given to every container with GPUs: empty or 0"
                        " (default: none; env IMEX_CHANNEL_IDS, file imex.channelIDs)")
    g.add_argument("--imex-required", action="store_true", dest="imex_required", default=None,
                   help="a configured IMEX channel missing on the node is an error"
                        " (default: left out; env IMEX_REQUIRED, file imex.required)")


FLAG_FIELDS = (
    "kubelet_dir", "pod_resources_socket", "features_dir", "metrics_address", "probe_address",
    "web_config_file", "node_name",
    "log_format", "log_level", "mig_strategy", "device_list_strategy", "device_id_strategy",
    "pass_device_specs", "health_recovery_s", "health_facts_interval_s", "node_condition", "kernel_log",
    "health_state_file",
    "sysfs_root", "socket_name", "feature_file",
    "label_interval_s", "proc_root", "cri_socket", "mps_root", "mps_control_binary", "nvidia_smi",
    "mode", "driver_name", "plugins_registry_dir", "plugins_dir", "cdi_dir", "kubeconfig",
    "delete_slices_on_shutdown", "taint_effect", "gpu_sets", "gpu_set_withdrawal_grace_s", "dynamic_mig",
    "mig_placements_per_profile",
    "no_timestamp", "labels_sink", "pod_namespace", "pod_name", "pod_uid",
    "config_file_srcdir", "default_config", "node_label", "fallback_strategies", "imex_channel_ids",
    "imex_required", "nccl_topology_file", "nccl_pod_files", "nccl_host_dir", "nccl_mount_path", "nccl_ib_hca",
)


def _probe_write(path: str, what: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".gta-probe-", dir=path)
    except OSError as exc:
        raise AgentError(f"{what} {path}: cannot be written: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def check_directories(config: Config, args: argparse.Namespace) -> None:
    """Fail at start, with one line naming the flag and the path, when the kubelet directory
    or (with the file label sink) the features directory can never work: not a directory (exit 2) or not writable
    (exit 1). A kubelet directory that does not exist yet is fine: the kubelet creates it.
    The features directory is created when missing, as the label sink would."""
    kubelet_what = "--kubelet-dir" if args.kubelet_dir else "kubelet directory"
    existing = nearest_existing(config.kubelet_dir)
    if not os.path.isdir(existing):
        raise UsageError(
            f"{kubelet_what} {config.kubelet_dir}: {existing} is not a directory "
            "(expected the kubelet's device-plugins directory)"
        )
    if existing == config.kubelet_dir:
        _probe_write(config.kubelet_dir, kubelet_what)
    if config.labels_sink != "file":  # labels go through the API server: no directory needed
        return
    features_what = "--features-dir" if args.features_dir else "features directory"
    existing = nearest_existing(config.features_dir)
    if not os.path.isdir(existing):
        raise UsageError(
            f"{features_what} {config.features_dir}: {existing} is not a directory "
            "(expected NFD's features.d directory)"
        )
    try:
        os.makedirs(config.features_dir, exist_ok=True)
    except OSError as exc:
        raise AgentError(
            f"{features_what} {config.features_dir}: cannot be created: {exc.strerror or exc}"
        ) from None
    _probe_write(config.features_dir, features_what)


def _first_named_config(config: Config, env: Mapping[str, str], load_file: Callable[[str], Config]) -> Config:
    """Per-node configs: the config of a node without the label, read and checked at start
    (the label's own is applied once the daemon reads it)."""
    if config.config_file:
        raise UsageError("--config-file-srcdir and --config (or CONFIG_FILE): set only one")
    if not config.node_name:
        raise UsageError("--config-file-srcdir needs the node's name to read its label: --node-name or NODE_NAME")
    configs = NamedConfigs.from_config(config)
    return load_file(configs.path(configs.choose("")))


def run(args: argparse.Namespace) -> int:
    from agent.daemon import Daemon
    from agent.http.webconfig import load_web_config
    from agent.logs import setup_logging

    flags = {name: getattr(args, name) for name in FLAG_FIELDS}
    env = dict(default_environ())

    def load_file(path: str | None) -> Config:
        config = load_config(path, env, flags)
        check_imex_channels(config)
        return config

    def loader() -> Config:
        return load_file(args.config)

    config = load_config(args.config, env, flags)
    check_directories(config, args)
    if config.web_config_file:  # a bad one is exit 2 here, before anything is served
        load_web_config(config.web_config_file)
    setup_logging(config)
    config = _first_named_config(config, env, load_file) if config.config_file_srcdir else load_file(args.config)
    return Daemon.from_config(config, simulate=args.simulate, config_loader=loader, load_file=load_file).run()
