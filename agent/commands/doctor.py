"""``gpu-topology-agent doctor``: check this node for what the agent needs (NVML, host,
kubelet, configuration, cluster), one line per check. Takes ``run``'s flags, to check what
that agent would use. Exit 0 when nothing FAILs, 1 otherwise, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import logging

from agent.commands._common import add_format_flag
from agent.commands.run import FLAG_FIELDS, add_agent_flags
from agent.config import Config, default_environ, load_config
from agent.doctor import DoctorContext, diagnose
from agent.doctor.report import exit_code, render_json, render_table
from agent.errors import ConfigError

#: The kubelet's configuration file as kubeadm writes it.
DEFAULT_KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this node for what the agent needs: NVML, host, kubelet, configuration, cluster",
        description="Check, without changing anything, every fact that decides whether the agent can"
        " serve GPUs on this node; one line per check: PASS, WARN or FAIL, what was found and what to do."
        " Takes run's flags. Exit 0 when nothing FAILs, 1 otherwise.",
    )
    add_agent_flags(p)
    add_format_flag(p)
    p.add_argument("--kubelet-config", metavar="FILE", dest="kubelet_config", default=DEFAULT_KUBELET_CONFIG,
                   help=f"the kubelet's configuration file (default: {DEFAULT_KUBELET_CONFIG})")
    p.set_defaults(func=doctor)


def doctor(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name) for name in FLAG_FIELDS}
    env = default_environ()

    def load(path: str | None) -> Config:
        return load_config(path, env, flags)

    config_error = None
    try:
        config = load(args.config)
    except ConfigError as exc:  # the file is a finding; a bad flag (no file) is bad usage
        if not (args.config or env.get("CONFIG_FILE")):
            raise
        config_error, config = str(exc), load_config(None, {k: v for k, v in env.items() if k != "CONFIG_FILE"},
                                                     flags)
    if config.config_file_srcdir and not config_error:
        from agent.nodeconfig import NamedConfigs

        try:  # the config a node without the label gets, as run starts with
            configs = NamedConfigs.from_config(config)
            config = load(configs.path(configs.choose("")))
        except ConfigError as exc:
            config_error = str(exc)
    # the report says what the agent's modules would log (a lost GPU, a missing function);
    # their log lines show only when asked for (--log-level)
    logging.getLogger().setLevel(config.log_level.upper() if args.log_level else logging.CRITICAL)
    context = DoctorContext(config, simulate=args.simulate, env=env, kubelet_config=args.kubelet_config,
                            config_error=config_error)
    outcomes, duration_s = diagnose(context, load)
    print(render_json(outcomes, duration_s) if args.format == "json" else render_table(outcomes, duration_s))
    return exit_code(outcomes)
