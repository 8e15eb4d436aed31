"""The world the agent runs in for the tests and the benchmarks, where the real one cannot run
here: stand-ins for the kubelet, the API server (with its authorization), containerd's CRI and
the scheduler's DRA allocator, the publishers an earlier agent used, and builders of synthetic
nodes and messages. ``tests/`` and ``bench/`` both import it (``from tests.testbed.kubelet_stub
import KubeletStub``); nothing in ``agent/`` does. Each stand-in names in its docstring the
upstream code it follows."""
