"""Per-node configuration, as NVIDIA's config-manager gives it: a directory of named configs
(one ConfigMap mounted as files) and a label on each Node naming the one it uses.

- :class:`NamedConfigs` lists the configs and chooses one for a label value by
  config-manager's rules (``cmd/config-manager/main.go``, ``updateConfigName``): the
  label's value names the config; without the label, ``--default-config``; without one, the
  fallbacks in order (``named``: the config called ``default``; ``single``: the only config).
  Entries starting with ``..`` (the ConfigMap volume's own) and directories are not configs.
- :class:`NodeLabelWatch` follows the label on the agent's own Node through the one API
  client, as config-manager's informer does: a list with ``fieldSelector
  metadata.name=<node>`` for the value and the ``resourceVersion``, then a watch from there;
  a watch that ends (the server's timeout, a restart) is resumed from the last
  ``resourceVersion`` seen (bookmarks included), a 410 (history compacted) lists again.
- :class:`NodeConfigSelector` ties both to the daemon: the config the newest label value asks
  for, what the log and the metrics say about it.

Where the agent differs from config-manager: a label naming a config that does not exist, or
one that does not load, stops nothing: the last good config stays, the log says why once per
change, and ``gpu_agent_config_refused`` says so until the label changes (config-manager
exits with an error; its init container keeps the plugin from starting). A refused label is
tried again on SIGHUP. The ``empty`` fallback is not offered.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from agent.config import Config
from agent.errors import ConfigError, shorten
from agent.kube import ApiCallError, call
from agent.retry import Backoff, Outage
from agent.worker import Worker

log = logging.getLogger(__name__)

#: Seconds one list (or the start of a watch) may take.
REQUEST_TIMEOUT_S = 10.0


class NamedConfigs:
    """The named configs in ``directory`` and the choice among them (``label`` is the node
    label's key, for messages)."""

    def __init__(self, directory: str, default: str, fallbacks: Sequence[str], label: str) -> None:
        self.directory = directory
        self.default = default
        self.fallbacks = tuple(fallbacks)
        self.label = label

    @classmethod
    def from_config(cls, config: Config) -> NamedConfigs:
        configs = cls(config.config_file_srcdir, config.default_config, config.fallback_strategies,
                      config.node_label)
        configs.names()  # an unreadable directory is an error at start
        return configs

    def names(self) -> list[str]:
        """The configs there now (a ConfigMap update adds and removes them)."""
        try:
            with os.scandir(self.directory) as entries:
                return sorted(e.name for e in entries if not e.name.startswith("..") and not e.is_dir())
        except OSError as exc:
            raise ConfigError(
                f"--config-file-srcdir {self.directory}: cannot be read: {exc.strerror or exc}"
            ) from None

    def choose(self, value: str) -> str:
        """The config's name for the label value ``value`` ("" when the node has no label);
        ConfigError saying why there is none."""
        names = self.names()
        has = f"{self.directory} has: {', '.join(names) or 'no config'}"
        if value:
            if value in names:
                return value
            raise ConfigError(f"label {self.label}={shorten(value)}: no config of that name ({has})")
        if self.default:
            if self.default in names:
                return self.default
            raise ConfigError(f"--default-config {self.default}: no config of that name ({has})")
        for strategy in self.fallbacks:
            if strategy == "named" and "default" in names:
                return "default"
            if strategy == "single" and len(names) == 1:
                return names[0]
        raise ConfigError(
            f"no label {self.label}, no --default-config, and the fallbacks"
            f" ({', '.join(self.fallbacks) or 'none'}) choose no config ({has})"
        )

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)


class NodeLabelWatch(Worker):
    """Reports the value of label ``label`` of Node ``node_name`` ("" without it) to
    ``on_value`` (on its own thread) at first and whenever it changes.

    ``client_factory()`` returns a ``kubernetes.client.ApiClient`` (production:
    :func:`agent.kube.api_client`, which does not retry: this loop does, with a capped
    exponential backoff, each failure said once per reason, the recovery once).
    ``watch_timeout_s`` is the ``timeoutSeconds`` of each watch; the server may end one
    sooner.
    """

    thread_name = "node-label-watch"

    def __init__(
        self,
        client_factory: Callable[[], Any],
        node_name: str,
        label: str,
        *,
        watch_timeout_s: float = 300.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.client_factory = client_factory
        self.node_name = node_name
        self.label = label
        self.watch_timeout_s = watch_timeout_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._outage = Outage(
            log, f"following the label {label} of node {node_name}", level=logging.ERROR, per_reason=True,
            retrying=f"retrying with backoff up to {backoff_max_s:g} s",
        )
        self._watch: Any = None  # the open watch, stopped from stop()
        self._on_value: Callable[[str], None] = lambda _value: None
        self._last: str | None = None  # the value last reported
        self._missing_said = False

    def start(self, on_value: Callable[[str], None] | None = None) -> None:
        """Start following; ``on_value`` hears each value (on the watch's thread)."""
        if on_value is not None:
            self._on_value = on_value
        super().start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # shuts the stream's socket: the blocked read returns
        super().stop(timeout_s)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api: Any = None
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                api = api or client.CoreV1Api(self.client_factory())
                if resource_version is None:
                    resource_version = self._list(api)
                    self._recovered()
                resource_version = self._watch_from(api, resource_version)
                self._recovered()
                continue
            except ApiCallError as exc:  # the list
                reason = f"HTTP {exc.status} {exc.reason}" if exc.status is not None else exc.state
            except ApiException as exc:  # the watch stream
                if exc.status == 410:  # the history is compacted: list again
                    log.info("watch of node %s expired: listing it again", self.node_name)
                    resource_version = None
                    continue
                reason = f"HTTP {exc.status} {exc.reason}"
            except Exception as exc:  # the client raises urllib3, socket and config errors
                reason = shorten(f"{type(exc).__name__}: {exc}", 200)
            if self._stop.is_set():
                return
            self._outage.failed(reason)
            self._stop.wait(self._backoff.next())

    def _recovered(self) -> None:
        self._outage.recovered()
        self._backoff.reset()

    def _selector(self) -> str:
        return f"metadata.name={self.node_name}"

    def _list(self, api: Any) -> str:
        """Report the label's value now; the list's resourceVersion, to watch from."""
        nodes = call(f"list Node {self.node_name}", api.list_node, field_selector=self._selector(),
                     missing_ok=False, timeout_s=REQUEST_TIMEOUT_S) or {}
        items = [n for n in nodes.get("items") or () if isinstance(n, dict)]
        if items:
            self._report(str(((items[0].get("metadata") or {}).get("labels") or {}).get(self.label, "")))
        elif not self._missing_said:
            self._missing_said = True
            log.warning("node %s not found in the API server: waiting for it", self.node_name)
        return str((nodes.get("metadata") or {}).get("resourceVersion"))

    def _watch_from(self, api: Any, resource_version: str) -> str:
        """Watch until the server ends the stream; the resourceVersion to resume from."""
        from kubernetes import watch

        stream = watch.Watch()
        self._watch = stream
        try:
            for event in stream.stream(
                api.list_node, field_selector=self._selector(), resource_version=resource_version,
                timeout_seconds=int(self.watch_timeout_s), allow_watch_bookmarks=True,
                _request_timeout=(REQUEST_TIMEOUT_S, self.watch_timeout_s + REQUEST_TIMEOUT_S),
            ):
                if self._stop.is_set():
                    break
                self._recovered()
                labels = ((event.get("raw_object") or {}).get("metadata") or {}).get("labels") or {}
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self._report(str(labels.get(self.label, "")))
                elif event.get("type") == "DELETED":  # as config-manager: no node, no label
                    self._report("")
        finally:
            self._watch = None
        log.debug("watch of node %s ended: resuming", self.node_name)
        return str(stream.resource_version or resource_version)

    def _report(self, value: str) -> None:
        if value != self._last:
            self._last = value
            self._on_value(value)


class ConfigMetrics(Protocol):
    """What the selector reports (:class:`agent.metrics.self_metrics.AgentMetrics`)."""

    def config_applied(self, name: str) -> None: ...

    def config_refused(self, label: str, reason: str) -> None: ...


class NodeConfigSelector:
    """Which per-node config the node's label asks for, and which one is applied.

    ``load(path)`` reads a config file as ``--config`` would (ConfigError when it does not
    load); ``active`` names the config applied at start. Values from ``watch`` arrive on its
    thread; :meth:`take` and :meth:`applied` are called from the daemon's main thread.
    """

    def __init__(self, configs: NamedConfigs, watch: NodeLabelWatch, load: Callable[[str], Config],
                 metrics: ConfigMetrics, *, active: str) -> None:
        self.configs = configs
        self.watch = watch
        self.load = load
        self.metrics = metrics
        self.active = active
        self.label_value = ""  # the label's value last taken
        self._lock = threading.Lock()  # a leaf: guards _pending only
        self._pending: str | None = None
        self._seen = threading.Event()
        self._wake: Callable[[], None] = lambda: None
        self._refused: tuple[str, str] | None = None  # (label value, reason) said last

    def start(self, wake: Callable[[], None], wait_s: float, stopped: Callable[[], bool]) -> Config | None:
        """Follow the label (``wake`` is called on each new value); the config it names when
        it is read within ``wait_s`` (or before ``stopped()``) and differs from the active one,
        else None."""
        self.metrics.config_applied(self.active)
        self._wake = wake
        self.watch.start(self._on_value)
        deadline = time.monotonic() + wait_s
        while not self._seen.wait(0.1) and time.monotonic() < deadline and not stopped():
            pass
        if not self._seen.is_set():
            log.warning("label %s of node %s not read within %.0f s: starting with config %s until it is",
                        self.configs.label, self.watch.node_name, wait_s, self.active)
            return None
        choice = self.take()
        if choice is None:
            if self._refused is None:
                self.applied(self.active, True)  # says which config and why
            return None
        name, load = choice
        try:
            config = load()
        except ConfigError as exc:
            log.error("%s", exc)
            self.applied(name, False)
            return None
        self.applied(name, True)
        return config

    def _on_value(self, value: str) -> None:
        with self._lock:
            self._pending = value
        self._seen.set()
        self._wake()

    def reconsider(self) -> None:
        """Take the label's value again (SIGHUP: a refused config may exist now)."""
        with self._lock:
            if self._pending is None and self._refused is not None:
                self._pending = self.label_value

    def take(self) -> tuple[str, Callable[[], Config]] | None:
        """(name, loader) of the config the newest label value asks for when it is not the
        one applied; None when there is nothing to apply (no new value, the same config, or
        a refused one: logged once per change and in ``gpu_agent_config_refused``)."""
        with self._lock:
            value, self._pending = self._pending, None
        if value is None:
            return None
        self.label_value = value
        try:
            name = self.configs.choose(value)
        except ConfigError as exc:
            self._refuse("unknown", str(exc))
            return None
        if name == self.active:
            if self._refused is not None:
                log.info("label %s=%s: config %s, applied already", self.configs.label, shorten(value), name)
                self._refused = None
                self.metrics.config_applied(name)
            return None
        return name, lambda: self.load(self.configs.path(name))

    def applied(self, name: str, ok: bool) -> None:
        """The daemon applied config ``name`` (``ok``), or kept the running one."""
        if not ok:
            self._refuse("invalid", f"config {name} does not load (the error is logged above)")
            return
        self.active = name
        self._refused = None
        self.metrics.config_applied(name)
        log.info("per-node config %s applied (label %s=%s)", name, self.configs.label,
                 shorten(self.label_value) or "<none>")

    def load_active(self) -> Config:
        """The applied config read again (SIGHUP)."""
        return self.load(self.configs.path(self.active))

    def stop(self) -> None:
        self.watch.stop()

    def _refuse(self, reason: str, why: str) -> None:
        value = self.label_value
        if self._refused != (value, reason):
            self._refused = (value, reason)
            log.error("%s; keeping config %s", why, self.active)
        self.metrics.config_refused(value, reason)
