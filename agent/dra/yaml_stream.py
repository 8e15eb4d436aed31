"""The YAML the agent prints (``gpu-topology-agent slices``, the benches): a multi-document
stream that YAML 1.1 and 1.2 parsers read the same way."""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import yaml

__all__ = ["dump_yaml"]

class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no stubs here
    pass


_YAML11_SPECIAL = re.compile(
    r"^(?:y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF"
    r"|~|null|Null|NULL|[-+]?[0-9][0-9_:.eE+-]*|[-+]?\.(?:inf|Inf|INF|nan|NaN|NAN)|<<|=)$"
)


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # PyYAML resolves booleans the YAML 1.1 way, but not every 1.1 parser agrees with it on
    # y/n or sexagesimal numbers: quote every scalar that any of them could read as non-string
    style = "'" if _YAML11_SPECIAL.match(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_yaml(objects: Iterable[Mapping[str, Any]]) -> str:
    """The objects as a multi-document YAML stream that reads the same in YAML 1.1 and 1.2
    parsers (strings that look like booleans, numbers or null are quoted)."""
    return str(yaml.dump_all([dict(o) for o in objects], Dumper=_Dumper, sort_keys=False,
                             default_flow_style=False, explicit_start=True))
