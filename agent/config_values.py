"""Checks of single setting values, the same whichever source gives them (config file,
environment variable, command-line flag).

Each ``expect_*`` takes the raw value and ``where`` (the key, variable or flag) and returns
the parsed value, or raises ``ValueError`` naming ``where``, what was expected and what was
given; the value given is cut with :func:`agent.errors.shorten` (a config value can be a
megabyte). :data:`FIELD_PARSERS` maps a :class:`agent.config.Config` field to its check.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from agent.errors import shorten
from agent.records import REPLICA_POLICIES

MIG_STRATEGIES = ("none", "single", "mixed")
ALLOCATION_POLICIES = ("best-effort",)  # the topology policy of issue 3; no other is built
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES = ("uuid", "index")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MODES = ("device-plugin", "dra")
#: Device-taint effects for unhealthy GPUs in DRA mode (agent.dra.taints).
TAINT_EFFECTS = ("NoSchedule", "NoExecute")
#: dra.gpuSets: by the API server's version, always, never
GPU_SETS_MODES = ("auto", "on", "off")
#: dra.migPlacementsPerProfile: at most this many (8 placements hold every 1g of an H100 and more)
MAX_MIG_PLACEMENTS_PER_PROFILE = 8
#: dra.dynamicMig: MIG devices cut on demand, or not
DYNAMIC_MIG_MODES = ("off", "on")
LABEL_SINKS = ("file", "nodefeature")
#: health.nodeCondition: the GPUHealthy condition written where an API server is configured,
#: always, never, or logged only
NODE_CONDITION_MODES = ("auto", "on", "off", "dry-run")
#: ``health.xids`` values: what a single XID is treated as (agent.health.xid_catalog)
XID_OVERRIDE_CHOICES = ("ignore", "application", "reset", "reboot", "memory", "nvlink", "support")


def got(value: object) -> str:
    """``value`` as a message shows what was given: its repr, shortened."""
    return shorten(repr(value))


def expect_bool(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off", ""):
        return False
    raise ValueError(f"{where}: expected true or false, got {got(value)}")


def expect_choice(value: object, choices: tuple[str, ...], where: str) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ValueError(f"{where}: expected one of {', '.join(choices)}, got {got(value)}")


def _dynamic_mig(value: object, where: str) -> str:
    """One of :data:`DYNAMIC_MIG_MODES`; YAML's unquoted ``on``/``off`` (booleans) too."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return expect_choice(value, DYNAMIC_MIG_MODES, where)


def _taint_effect(value: object, where: str) -> str:
    """One of :data:`TAINT_EFFECTS`, in any letter case, spelled as Kubernetes does."""
    for effect in TAINT_EFFECTS:
        if isinstance(value, str) and value.strip().lower() == effect.lower():
            return effect
    raise ValueError(f"{where}: expected one of {', '.join(TAINT_EFFECTS)}, got {got(value)}")


def expect_number(value: object, where: str, minimum: float = 0.0) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{where}: expected a number, got {got(value)}") from None
    if number < minimum or number != number:
        raise ValueError(f"{where}: expected a number >= {minimum:g}, got {got(value)}")
    return number


def expect_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {got(value)}")
    return value


def expect_file_name(value: object, where: str) -> str:
    name = expect_str(value, where)
    if not name or "/" in name or name.startswith(".") or name == "kubelet.sock":
        raise ValueError(
            f"{where}: expected a file name (no '/', not a dot-file, not kubelet.sock), got {got(name)}"
        )
    return name


def expect_items(value: object, where: str, expected: str) -> list[object]:
    """A YAML list, or a comma-separated string (environment variables, flags)."""
    if isinstance(value, str):
        return [v for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{where}: expected {expected}, got {got(value)}")


def expect_list_strategy(value: object, where: str) -> tuple[str, ...]:
    items = expect_items(value, where, "a strategy name or a list of them")
    if not items:
        raise ValueError(f"{where}: expected at least one of {', '.join(DEVICE_LIST_STRATEGIES)}")
    out: list[str] = []
    for item in items:
        choice = expect_choice(item, DEVICE_LIST_STRATEGIES, where)
        if choice not in out:
            out.append(choice)
    return tuple(out)


def expect_xids(value: object, where: str) -> tuple[int, ...]:
    items = expect_items(value, where, "a list of XID numbers")
    out: list[int] = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise TypeError
            xid = int(str(item).strip())
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected XID numbers, got {got(item)}") from None
        if xid < 0:
            raise ValueError(f"{where}: expected XID numbers >= 0, got {got(item)}")
        out.append(xid)
    return tuple(sorted(set(out)))


def expect_xid_overrides(value: object, where: str) -> tuple[tuple[int, str], ...]:
    """XID -> what it is treated as: a mapping (``{"48": "reset"}``) or its text form
    (``48=reset,13=application``) or that mapping as JSON, each value one of
    :data:`XID_OVERRIDE_CHOICES`."""
    if isinstance(value, str) and value.strip().startswith(("{", "[")):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where}: expected a JSON mapping of XID to class, got {got(value)}") from None
    if isinstance(value, str):
        pairs: list[tuple[object, object]] = []
        for item in (i.strip() for i in value.split(",")):
            if item:
                text, sep, named = item.partition("=")
                if not sep:
                    raise ValueError(f"{where}: expected XID=CLASS pairs (48=reset,13=application), got {got(item)}")
                pairs.append((text.strip(), named.strip()))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]  # the parsed form, given again (a reload)
    else:
        choices = ", ".join(XID_OVERRIDE_CHOICES)
        raise ValueError(f"{where}: expected a mapping of XID to one of {choices}, got {got(value)}")
    out: dict[int, str] = {}
    for key, choice in pairs:
        (number,) = expect_xids([key], f"{where}: key")
        out[number] = expect_choice(str(choice).strip().lower(), XID_OVERRIDE_CHOICES, f"{where}.{number}")
    return tuple(sorted(out.items()))


def expect_count(value: object, where: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number >= ``minimum`` (and <= ``maximum`` when given)."""
    expected = f"a whole number >= {minimum}" if maximum is None else f"a whole number from {minimum} to {maximum}"
    try:
        if isinstance(value, bool):
            raise TypeError
        number = int(str(value).strip())
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {expected}, got {got(value)}") from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"{where}: expected {expected}, got {got(value)}")
    return number


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


def expect_driver_name(value: object, where: str) -> str:
    """A DRA driver name: a lowercase DNS subdomain (the API server rejects anything else)."""
    name = expect_str(value, where).strip()
    if len(name) > 63 or not re.fullmatch(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*", name):
        raise ValueError(
            f"{where}: expected a DRA driver name (a lowercase DNS subdomain of at most 63"
            f" characters, e.g. gpu.gpu-agent.io), got {got(value)}"
        )
    return name


def expect_path(value: object, where: str) -> str:
    """A non-empty path (made absolute by the loader)."""
    path = expect_str(value, where).strip()
    if not path or "\0" in path:
        raise ValueError(f"{where}: expected a path, got {got(value)}")
    return path


def expect_program(value: object, where: str) -> str:
    """A program: a name looked up on the ``PATH`` or a path to it."""
    program = expect_str(value, where).strip()
    if not program or "\0" in program or program.endswith("/"):
        raise ValueError(f"{where}: expected a program name on the PATH or a path to it, got {got(value)}")
    return program


# --- per-node configs and IMEX (issue 18)
FALLBACK_STRATEGIES = ("named", "single")
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"


def expect_config_name(value: object, where: str) -> str:
    """A config's name: a ConfigMap key (``[-._a-zA-Z0-9]+``, not ``.``/``..``); empty: none."""
    name = expect_str(value, where).strip()
    if name and (not re.fullmatch(r"[-._a-zA-Z0-9]+", name) or name.startswith("..") or name == "."):
        raise ValueError(f"{where}: expected a config name (a ConfigMap key: letters, digits, '-', '_', '.'),"
                         f" got {got(value)}")
    return name


def expect_label_key(value: object, where: str) -> str:
    """A node label key: ``[prefix/]name``, the prefix a DNS subdomain."""
    key = expect_str(value, where).strip()
    prefix, _, name = key.rpartition("/")
    if not re.fullmatch(_LABEL_NAME, name) or (prefix and not re.fullmatch(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*", prefix)):
        raise ValueError(f"{where}: expected a label key such as nvidia.com/device-plugin.config, got {got(value)}")
    return key


def expect_fallbacks(value: object, where: str) -> tuple[str, ...]:
    items = expect_items(value, where, "a list of fallback strategies")
    return tuple(dict.fromkeys(expect_choice(item, FALLBACK_STRATEGIES, where) for item in items))


def expect_imex_channel_ids(value: object, where: str) -> tuple[int, ...]:
    """NVIDIA's check: ``[]`` or ``[0]`` (the one channel its plugin injects)."""
    if isinstance(value, str):  # "0", "", or spelled as the file's list: "[0]", "[]"
        value = value.strip().removeprefix("[").removesuffix("]")
    items = expect_items(value, where, "[] or [0]")
    if not items:
        return ()
    if len(items) == 1 and not isinstance(items[0], bool) and str(items[0]).strip() == "0":
        return (0,)
    raise ValueError(f"{where}: expected [] or [0] (channel 0 is the only one injected), got {got(value)}")


def _log_level(value: object, where: str) -> str:
    return expect_choice(str(value).upper(), tuple(x.lower() for x in LOG_LEVELS), where).upper()


NCCL_POD_FILES = ("auto", "off")


def _node_condition(value: object, where: str) -> str:
    """One of :data:`NODE_CONDITION_MODES`; YAML's unquoted ``on``/``off`` (booleans) too."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return expect_choice(value, NODE_CONDITION_MODES, where)


def _container_path(value: object, where: str) -> str:
    """An absolute path inside a container (not made absolute on the host)."""
    path = expect_path(value, where)
    if not path.startswith("/") or path.endswith("/"):
        raise ValueError(f"{where}: expected an absolute file path in the container, got {got(value)}")
    return path


#: Config field -> its check (fields not named here are strings).
FIELD_PARSERS: Mapping[str, Callable[[Any, str], object]] = {
    "mig_strategy": lambda v, w: expect_choice(v, MIG_STRATEGIES, w),
    "fail_on_init_error": expect_bool,
    "pass_device_specs": expect_bool,
    "device_list_strategy": expect_list_strategy,
    "device_id_strategy": lambda v, w: expect_choice(v, DEVICE_ID_STRATEGIES, w),
    "shared_devices_allocation_policy": lambda v, w: expect_choice(v, REPLICA_POLICIES, w),
    "rename_by_default": expect_bool,
    "fail_requests_greater_than_one": expect_bool,
    "health_checks_enabled": expect_bool,
    "ignored_xids": expect_xids,
    "extra_critical_xids": expect_xids,
    "health_recovery_s": expect_number,
    "health_facts_interval_s": lambda v, w: expect_number(v, w, 0.1),
    "node_condition": _node_condition,
    "kernel_log": lambda v, w: "" if v is None or v == "" else expect_path(v, w),  # "": not read
    "xid_overrides": expect_xid_overrides,
    "repeated_xid_count": expect_count,
    "repeated_xid_window_s": lambda v, w: expect_number(v, w, 1.0),
    "health_state_file": lambda v, w: "" if v is None or v == "" else expect_path(v, w),  # "": the default
    "sample_interval_s": lambda v, w: expect_number(v, w, 0.1),
    "pod_resources_refresh_s": lambda v, w: expect_number(v, w, 0.1),
    "label_interval_s": lambda v, w: expect_number(v, w, 0.1),
    "idle_utilization_threshold_pct": expect_number,
    "socket_name": expect_file_name,
    "feature_file": expect_file_name,
    "no_timestamp": expect_bool,
    "log_format": lambda v, w: expect_choice(v, LOG_FORMATS, w),
    "log_level": _log_level,
    "mode": lambda v, w: expect_choice(v, MODES, w),
    "driver_name": expect_driver_name,
    "delete_slices_on_shutdown": expect_bool,
    "taint_effect": _taint_effect,
    "gpu_sets": lambda v, w: expect_choice(v, GPU_SETS_MODES, w),
    "gpu_set_withdrawal_grace_s": expect_number,
    "dynamic_mig": _dynamic_mig,
    "mig_placements_per_profile": lambda v, w: expect_count(v, w, 1, MAX_MIG_PLACEMENTS_PER_PROFILE),
    "mps_root": expect_path,
    "mps_control_binary": expect_program,
    "nvidia_smi": expect_program,
    # the kubelet's --container-runtime-endpoint spelling (unix://PATH) is accepted too
    "cri_socket": lambda v, w: expect_str(v, w).removeprefix("unix://"),
    "labels_sink": lambda v, w: expect_choice(v, LABEL_SINKS, w),
    "default_config": expect_config_name,
    "node_label": expect_label_key,
    "fallback_strategies": expect_fallbacks,
    "imex_channel_ids": expect_imex_channel_ids,
    "imex_required": expect_bool,
    "nccl_topology_file": lambda v, w: expect_str(v, w).strip(),
    "nccl_pod_files": lambda v, w: expect_choice(v, NCCL_POD_FILES, w),
    "nccl_host_dir": lambda v, w: "" if v is None or v == "" else expect_path(v, w),  # "": the default
    "nccl_mount_path": _container_path,
    "nccl_ib_hca": expect_bool,
}


def parse_field(name: str, value: object, where: str) -> object:
    """``value`` checked as the Config field ``name`` (``where`` names its source)."""
    parser = FIELD_PARSERS.get(name)
    if parser is not None:
        return parser(value, where)
    return expect_str(value, where)
