"""Removes the NCCL topology files of device-plugin allocations whose container the kubelet
no longer lists (pod-resources ``List``), every ``pod_resources_refresh_s``.

The kubelet records a container's devices when it calls Allocate, before the container
starts, and lists them until the pod is gone; a file is named by the same resource and
device IDs (:func:`agent.nccl.host_dir.allocation_key`). The files are the owner's
:class:`NcclFiles` (the one the request handlers write through), so a file whose deferred
write is still pending is never swept. A file younger than
:data:`MIN_AGE_S` is left alone (its Allocate may be a moment ahead of the listing), and
nothing is removed while the kubelet cannot be asked. After an agent restart the first
sweep removes the files of containers that went while it was down; the others stay.
"""

from __future__ import annotations

import logging
from typing import Callable

from agent.config import Config
from agent.kubelet.podresources import PodResourcesClient, PodResourcesError
from agent.nccl.host_dir import NcclFiles, live_allocation_keys
from agent.retry import Outage
from agent.worker import Worker

log = logging.getLogger(__name__)

#: How old a file must be before a sweep may remove it (s).
MIN_AGE_S = 60.0


#: What the sweeper asks its owner each round: the running config, the owner's files (None:
#: off) and the names of the resources served (they change with a reload).
Settings = Callable[[], tuple[Config, "NcclFiles | None", list[str]]]


class NcclSweeper(Worker):
    """Sweeps on its own thread the files ``settings()`` names (:data:`Settings`)."""

    thread_name = "nccl-sweep"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._client: PodResourcesClient | None = None
        self._outage = Outage(log, "NCCL topology files: pod-resources List")  # named by socket once asked
        # an unexpected error is said once per kind with its traceback, not every round
        self._sweep_outage = Outage(log, "NCCL topology file sweep", level=logging.ERROR, per_reason=True,
                                    retrying="retrying every pod-resources refresh")
        super().__init__()

    def sweep_once(self) -> list[str] | None:
        """One sweep: the removed keys, None when the kubelet could not be asked."""
        config, files, resources = self.settings()
        if files is None or not files.keys():
            return []
        if self._client is None or self._client.socket_path != config.pod_resources_socket:
            if self._client is not None:
                self._client.close()
            self._client = PodResourcesClient(config.pod_resources_socket)
            self._outage = Outage(log, f"NCCL topology files: pod-resources List on {config.pod_resources_socket}",
                                  retrying="none removed until it answers")
        try:
            response = self._client.list()
        except PodResourcesError as exc:
            self._outage.failed(str(exc))
            return None
        self._outage.recovered()
        return files.sweep(live_allocation_keys(response.pod_resources, resources), MIN_AGE_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep_once()
            except Exception as exc:  # keep sweeping after any unexpected answer
                self._sweep_outage.failed(f"{type(exc).__name__}: {exc}", key=type(exc).__name__, exc_info=True)
            else:
                self._sweep_outage.recovered()
            self._stop.wait(self.settings()[0].pod_resources_refresh_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        super().stop(timeout_s)
        if self._client is not None:
            self._client.close()
            self._client = None
