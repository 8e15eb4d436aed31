"""Configuration checks: the config file and the per-node config resolve and load, the
sharing settings are valid for these GPUs (the resources the agent would build, with its
sharing's check of the node: each shared GPU's compute mode, MPS's limits; the MPS control
program), and the IMEX channels exist where required. Each rule is the agent's own, called
here: doctor and the agent cannot disagree.

The other checks run with the configuration the agent would start with: ``--config`` (or
``CONFIG_FILE``), or with per-node configs (``--config-file-srcdir``) the config a node
without the label gets, as ``run`` reads it at start; :func:`config_file` also reads the
node's label through the API server, when it can, and says which config that selects.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.config import Config
from agent.containers import IMEX_CHANNELS_DIR, check_imex_channels, host_path, imex_channel_present
from agent.doctor.context import API_TIMEOUT_S, DoctorContext, Unavailable
from agent.doctor.report import Check, Result, failed, passed, warned
from agent.errors import ConfigError
from agent.kube import ApiCallError, call
from agent.sharing import sharing_for, strategy_label
from agent.sharing.mps_daemon import control_program

__all__ = ["checks", "node_label"]


def node_label(context: DoctorContext) -> str | None:
    """The node's per-node config label (``--node-label``), "" when it has none; None when
    the API server cannot be asked."""
    from kubernetes import client

    config = context.config
    if not config.node_name:
        return None
    try:
        api = context.api()
        node = call(f"read Node {config.node_name}", client.CoreV1Api(api).read_node, config.node_name,
                    timeout_s=API_TIMEOUT_S)
    except (Unavailable, ApiCallError):
        return None
    if node is None:
        return None
    return str(((node.get("metadata") or {}).get("labels") or {}).get(config.node_label, ""))


def config_file(context: DoctorContext, load: Callable[[str], Config]) -> Result:
    """The configuration loads; with per-node configs, the node's choice loads too."""
    config = context.config
    if context.config_error is not None:
        return failed(context.config_error, "fix the file (the agent refuses to start with it)")
    summary = (f"migStrategy {config.mig_strategy}, device-list {','.join(config.device_list_strategy)},"
               f" sharing {strategy_label(config)}, mode {config.mode}")
    if not config.config_file_srcdir:
        where = config.config_file or "no config file (defaults, environment, flags)"
        return passed(f"{where}: {summary}")
    from agent.nodeconfig import NamedConfigs

    label = node_label(context)
    try:
        configs = NamedConfigs.from_config(config)
        name = configs.choose(label or "")
        load(configs.path(name))
    except ConfigError as exc:
        return failed(str(exc), "fix the named config or the node's label; the agent keeps its last good"
                      " config (or does not start)")
    said = ("label unknown: API server not reachable, the default choice" if label is None
            else f"label {config.node_label}={label or '(none)'}")
    return passed(f"per-node config {name!r} from {config.config_file_srcdir} ({said}): {summary}")


def sharing(context: DoctorContext) -> Result:
    """Sharing valid for these GPUs: the resources the agent would build, with the sharing's
    own check of the node (:meth:`agent.sharing.base.Sharing.check`: compute modes, MPS's
    limits), and the MPS control program there (MPS)."""
    config = context.config
    section = sharing_for(config).section
    if not sharing_for(config).entries(config):
        return passed("no sharing configured")
    try:
        resources = context.resources()
    except Unavailable:
        return warned("not run: NVML did not load (see nvml.library)", "fix nvml.library first")
    except ConfigError as exc:
        return failed(f"the agent refuses the sharing settings: {exc}", f"fix {section}")
    shared = sorted({d.gpu_index for r in resources for d in r.devices if d.replica is not None})
    found = f"{section}: {len(shared)} GPUs shared as " + ", ".join(
        f"{r.name} x{len(r.devices)}" for r in resources if r.shared)
    if config.mps:
        binary = config.mps_control_binary
        if control_program(binary) is None:
            return failed(f"{found}; the MPS control program {binary} is not there",
                          "install the driver's nvidia-cuda-mps-control where the agent runs, or set"
                          " --mps-control-binary; without it no MPS replica is served")
        found += f"; MPS control program {binary} present"
    return passed(found)


def imex(context: DoctorContext) -> Result:
    """The configured IMEX channels exist (``/dev/nvidia-caps-imex-channels/channel<N>``), as
    the agent finds them; a missing one FAILs where the agent refuses to start for it."""
    config = context.config
    if not config.imex_channel_ids:
        return passed("no IMEX channels configured")
    missing = [c for c in config.imex_channel_ids if not imex_channel_present(c, config)]
    if not missing:
        return passed(f"IMEX channels {list(config.imex_channel_ids)} present")
    what = f"IMEX channels {missing}: no character device in {host_path(IMEX_CHANNELS_DIR, config.nvidia_driver_root)}"
    action = "create them with the IMEX driver (nvidia-imex, nvidia-modprobe -i <N>)"
    try:
        check_imex_channels(config)
    except ConfigError:
        return failed(f"{what} (imex.required: the agent does not start)", action)
    return warned(f"{what} (left out of containers until they exist)", action)


def checks(load: Callable[[str], Config]) -> tuple[Check, ...]:
    """The configuration checks; ``load`` reads a config file as ``run`` would."""

    def config_file_check(context: DoctorContext) -> Result:
        return config_file(context, load)

    return (
        Check("config.file", config_file_check),
        Check("config.sharing", sharing, timeout_s=8.0),
        Check("config.imex", imex),
    )

