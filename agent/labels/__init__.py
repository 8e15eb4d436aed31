"""Node labels: a pure function of the node's :class:`Topology` and the :class:`Config`.

``compute_labels(topology, config)`` returns two families, one module each: GPU Feature
Discovery's labels (:mod:`agent.labels.gfd`, ``nvidia.com/``: same keys, same value
formats, so existing ``nodeSelector``/``nodeAffinity`` terms keep working) and our topology
labels (:mod:`agent.labels.topology_labels`, ``topology.gpu-agent.io/``). Every key and value
is a valid Kubernetes label (values are checked by
:func:`agent.labels.gfd.is_valid_label_value`; the keys are constants). Where they go:
:mod:`agent.labels.publishing` and its sinks.
"""

from __future__ import annotations

import os
from typing import Mapping

from agent.config import Config
from agent.labels.gfd import TIMESTAMP_LABEL, gfd_labels, is_valid_label_value
from agent.labels.topology_labels import ACTIVE_CONFIG_LABEL, topology_labels
from agent.topology.model import Topology


def compute_labels(topology: Topology, config: Config, now: float | None = None) -> dict[str, str]:
    """All node labels for ``topology`` under ``config``; pure and deterministic.

    A node without GPUs gets no labels (as GFD). Labels whose value is unknown (no driver
    version, no compute capability, no model name) are left out, never written empty.
    ``now`` (seconds since the epoch, the caller's clock) adds GFD's ``gfd.timestamp``
    label unless ``config.no_timestamp``.
    """
    if not topology.gpus:
        return {}
    labels = gfd_labels(topology, config)
    labels.update(topology_labels(topology))
    active = os.path.basename(config.config_file or "") if config.config_file_srcdir else ""
    if is_valid_label_value(active):  # an empty value is dropped below
        labels[ACTIVE_CONFIG_LABEL] = active
    if now is not None and not config.no_timestamp:
        labels[TIMESTAMP_LABEL] = str(int(now))
    return dict(sorted((k, v) for k, v in labels.items() if v))


def format_labels(labels: Mapping[str, str]) -> str:
    """``key=value`` lines sorted by key, newline-terminated (the NFD feature-file format)."""
    return "".join(f"{k}={v}\n" for k, v in sorted(labels.items()))

