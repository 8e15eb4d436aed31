"""The demo's node: the stand-in kubelet (device-plugin registration and pod-resources) and
the real agent, started in that order and stopped in reverse whatever happens between. The
story and its sharing sections each run one."""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from agent.config import Config
from agent.errors import AgentError

if TYPE_CHECKING:
    from agent.daemon import Daemon
    from agent.demo.kubelet import KubeletStub, PluginClient, PodResourcesStub


@dataclass
class DemoNode:
    """A running demo node; :meth:`client` connects to a registered plugin's socket (closed
    with the node)."""

    kubelet: KubeletStub
    pod_resources: PodResourcesStub
    daemon: Daemon
    kubelet_dir: str
    _stack: ExitStack

    def client(self, endpoint: str) -> PluginClient:
        from agent.demo.kubelet import PluginClient

        client = PluginClient(os.path.join(self.kubelet_dir, endpoint))
        self._stack.callback(client.close)
        return client


@contextmanager
def demo_node(
    config: Config, simulate: str, progress: Callable[[str], None] = lambda _: None
) -> Iterator[DemoNode]:
    """Start the stand-ins and the agent on ``simulate`` with ``config``; stop all on exit."""
    from agent.daemon import Daemon
    from agent.demo.kubelet import KubeletStub, PodResourcesStub

    with ExitStack() as stack:
        progress(f"starting the stand-in kubelet in {os.path.dirname(config.kubelet_dir)}")
        kubelet = KubeletStub(config.kubelet_dir).start()
        stack.callback(kubelet.stop)
        pod_resources = PodResourcesStub(config.pod_resources_socket).start()
        stack.callback(pod_resources.stop)
        progress(f"starting the agent on the simulated machine {simulate!r}")
        daemon = Daemon.from_config(config, simulate=simulate)
        stack.callback(daemon.shutdown)
        if not daemon.start():
            raise AgentError("the agent stopped while starting")
        yield DemoNode(kubelet, pod_resources, daemon, config.kubelet_dir, stack)
