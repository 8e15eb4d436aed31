"""What the API server accepts as a label key, for the label tests: the rule of
``k8s.io/apimachinery/pkg/util/validation`` ``IsQualifiedName`` (an optional DNS-1123
subdomain prefix of at most 253 characters, ``/``, then a name of at most 63 characters,
alphanumeric at both ends with ``-_.`` inside). The agent checks its values itself
(``agent.labels.gfd.is_valid_label_value``); its keys are constants, checked here."""

from __future__ import annotations

import re

_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def is_valid_label_key(key: str) -> bool:
    """Kubernetes label key: optional DNS-subdomain prefix (<= 253) + ``/`` + name (<= 63)."""
    prefix, _, name = key.rpartition("/")
    if prefix:
        if len(prefix) > 253 or not all(_DNS_LABEL_RE.match(p) for p in prefix.split(".")):
            return False
    return len(name) <= 63 and bool(_NAME_RE.match(name))
