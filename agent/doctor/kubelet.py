"""Kubelet checks: the device-plugin directory, ``kubelet.sock``, another plugin already
serving the agent's resource names, the pod-resources socket, the kubelet's topology and
CPU manager policies, and in DRA mode the plugin directories and the CDI directory.

**Another plugin on our resource names.** The kubelet keeps one endpoint per resource name:
the plugin that registered last wins, and the other's pods lose their devices on its next
restart. The node shows it only as sockets in the device-plugin directory (the resource name
is said in the Register call, which leaves no trace there), so the check reads the sockets:
every socket the agent would serve on (``--socket-name`` per resource, by default NVIDIA's
own names, ``nvidia-gpu.sock``...) that a live server holds is told by its server's process: the
peer credentials of a connection to it (``SO_PEERCRED``: the listener's pid, as this
process's PID namespace sees it; the agent binds under a hidden name and renames the socket
into place, so ``<proc>/net/unix``, which keeps the bound name, cannot be matched by path),
then ``<proc>/<pid>/cmdline``: the agent itself (a ``gpu-topology-agent run`` process) PASSes,
anything else (NVIDIA's ``nvidia-device-plugin``, a second agent under another name) FAILs,
and an owner this process cannot see (no host PID namespace, no permission) WARNs. Live
sockets in the directory with other names are listed: they serve other resources.

Writable directories are judged without writing (``os.access`` and a read-only mount
check): doctor changes nothing.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Sequence

from agent.doctor.context import DoctorContext, Unavailable
from agent.doctor.report import Check, Result, failed, passed, warned
from agent.errors import AgentError, shorten
from agent.files import nearest_existing
from agent.formats import read_document
from agent.kubelet.podresources import PodResourcesClient
from agent.kubelet.registration import KUBELET_SOCKET
from agent.kubelet.unix_server import socket_in_use

__all__ = ["CHECKS", "socket_owner"]


def writable_dir(path: str, what: str, *, may_be_missing: bool) -> Result | None:
    """None when ``path`` is (or could be created as) a directory this process may write,
    else the FAIL saying why."""
    existing = nearest_existing(path)
    if existing != path and not may_be_missing:
        return failed(f"{what} {path} does not exist", "create it, or point the flag at the right place")
    if not os.path.isdir(existing):
        return failed(f"{what} {path}: {existing} is not a directory", "point the flag at a directory")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only or not os.access(existing, os.W_OK | os.X_OK):
        why = "on a read-only mount" if read_only else "not writable by this user"
        return failed(f"{what} {path}: {existing} is {why}",
                      "mount the host directory read-write into the agent's pod and run it as root")
    return None


def plugin_dir(context: DoctorContext) -> Result:
    """The device-plugin directory exists and is writable (the agent serves its sockets there)."""
    config = context.config
    if config.mode == "dra":
        return passed(f"DRA mode: no device-plugin sockets ({config.kubelet_dir} not needed)")
    bad = writable_dir(config.kubelet_dir, "device-plugin directory", may_be_missing=False)
    return bad or passed(f"{config.kubelet_dir} is a writable directory")


def kubelet_socket(context: DoctorContext) -> Result:
    """``kubelet.sock`` is there and the kubelet answers on it."""
    config = context.config
    if config.mode == "dra":
        return passed("DRA mode: the agent registers through the plugin registry (see dra.directories)")
    path = os.path.join(config.kubelet_dir, KUBELET_SOCKET)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return failed(f"{path} does not exist", "the kubelet is not running, or --kubelet-dir is not its"
                      " device-plugins directory (kubelet --root-dir/device-plugins)")
    if not stat.S_ISSOCK(mode):
        return failed(f"{path} is not a socket", "point --kubelet-dir at the kubelet's device-plugins directory")
    if not socket_in_use(path, timeout_s=1.0):
        return failed(f"{path}: nobody answers (a stale socket)", "the kubelet is down or restarting: systemctl"
                      " status kubelet; the agent registers again once it is back")
    return passed(f"{path} answers")


def socket_owner(path: str, proc_root: str) -> tuple[int, list[str]] | None:
    """(pid, argv) of the process serving the unix socket ``path`` (its ``SO_PEERCRED``,
    argv from ``proc_root``); None when it cannot be told (no answer, a pid outside this
    PID namespace, or no access to its command line)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(0.5)
        try:
            conn.connect(path)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid = struct.unpack("3i", creds)[0]
    if pid <= 0:  # the server's PID namespace is not visible from here
        return None
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    return pid, argv


def is_agent(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is this agent serving (``gpu-topology-agent run``, ``python -m agent run``)."""
    names = [os.path.basename(a) for a in argv]
    agent = "gpu-topology-agent" in names or any(a == "-m" and b == "agent" for a, b in zip(argv, argv[1:]))
    return agent and "run" in argv


def _our_sockets(context: DoctorContext) -> dict[str, str]:
    """Socket base name -> resource name, for every resource the agent would serve."""
    try:
        return {r.socket_name: r.name for r in context.resources()}
    except (Unavailable, AgentError):
        default = "nvidia.com/gpu"
        return {context.config.socket_name.replace("{resource}", "gpu"): default}


def other_plugins(context: DoctorContext) -> Result:
    """No other server holds a socket the agent serves on (module docstring)."""
    config = context.config
    if config.mode == "dra":
        return passed("DRA mode: no device-plugin sockets")
    ours = _our_sockets(context)
    try:
        names = sorted(os.listdir(config.kubelet_dir))
    except OSError as exc:
        return warned(f"{config.kubelet_dir} cannot be listed: {exc.strerror or exc}", "see kubelet.plugin_dir")
    live = [n for n in names if n != KUBELET_SOCKET and _is_socket(os.path.join(config.kubelet_dir, n))
            and socket_in_use(os.path.join(config.kubelet_dir, n), timeout_s=0.5)]
    found, foreign, unknown = [], [], []
    for name in live:
        if name not in ours:
            found.append(f"{name} (another resource)")
            continue
        owner = socket_owner(os.path.join(config.kubelet_dir, name), config.proc_root)
        if owner is None:
            unknown.append(f"{name} ({ours[name]})")
        elif is_agent(owner[1]):
            found.append(f"{name} served by the agent (pid {owner[0]})")
        else:
            argv = " ".join(" ".join(owner[1]).split())
            foreign.append(f"{name} ({ours[name]}) by pid {owner[0]}: {shorten(argv, 160)}")
    if foreign:
        return failed(f"another server holds the agent's socket: {'; '.join(foreign)}",
                      "uninstall NVIDIA's device plugin (or the other server) from this node, or give the agent"
                      " other resource names and --socket-name: two plugins of one resource name take each"
                      " other's place at the kubelet")
    if unknown:
        return warned(f"a live server holds {', '.join(unknown)}; whose cannot be told from here"
                      f" (no access to its process in {config.proc_root})",
                      "if the agent is not running on this node, another plugin serves its resource names:"
                      " look for nvidia-device-plugin pods (kubectl get pods -A -o wide | grep device-plugin)")
    return passed(f"no other server on the agent's sockets ({', '.join(sorted(ours))})"
                  + (f"; also live: {', '.join(found)}" if found else ""))


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def pod_resources(context: DoctorContext) -> Result:
    """The kubelet's pod-resources socket answers ``List`` (pod attribution of metrics)."""
    path = context.config.pod_resources_socket
    if not os.path.exists(path):
        return warned(f"{path} does not exist", "mount /var/lib/kubelet/pod-resources into the agent's pod;"
                      " without it the metrics have no pod, namespace and container labels")
    client = PodResourcesClient(path, timeout_s=2.0)
    try:
        response = client.list()
    except AgentError as exc:
        return warned(f"{path}: List failed: {exc}", "is the kubelet running? (the metrics' pod labels stay empty"
                      " meanwhile)")
    finally:
        client.close()
    return passed(f"{path} answers: {len(response.pod_resources)} pods")


#: The kubelet's defaults (KubeletConfiguration v1beta1) for the fields read here.
_KUBELET_DEFAULTS = {"cpuManagerPolicy": "none", "topologyManagerPolicy": "none", "topologyManagerScope": "container"}


def kubelet_config(context: DoctorContext) -> Result:
    """The kubelet's topology and CPU manager policies, when its configuration file is
    readable, and what ``single-numa-node`` means for GPU sets spanning NUMA nodes."""
    path = context.kubelet_config
    try:
        data = read_document(path, "kubelet configuration")
    except AgentError as exc:
        return warned(f"kubelet configuration not readable: {exc}",
                      "mount it (kubeadm: /var/lib/kubelet/config.yaml) and pass --kubelet-config to see the"
                      " topology and CPU manager policies")
    if not isinstance(data, dict) or data.get("kind") != "KubeletConfiguration":
        return warned(f"{path} is not a KubeletConfiguration", "pass --kubelet-config the kubelet's --config file")
    policy = {k: str(data.get(k) or v) for k, v in _KUBELET_DEFAULTS.items()}
    found = (f"topologyManagerPolicy {policy['topologyManagerPolicy']} (scope {policy['topologyManagerScope']}),"
             f" cpuManagerPolicy {policy['cpuManagerPolicy']}")
    if context.config.mode == "dra":
        return passed(f"{found}; DRA mode: the topology manager gives DRA devices no NUMA hints (the GPU sets"
                      " carry NUMA placement instead)")
    if policy["topologyManagerPolicy"] != "single-numa-node":
        return passed(found)
    try:
        groups = context.node().topology.numa_groups
    except Unavailable:
        return warned(f"{found}; the GPUs' NUMA nodes are unknown (NVML did not load)", "see nvml.library")
    known = {k: v for k, v in groups.items() if k is not None}
    if len(known) <= 1:
        return passed(f"{found}; the GPUs are on {len(known)} NUMA node(s): every request fits one")
    most = max(len(v) for v in known.values())
    spread = ", ".join(f"NUMA {k}: GPUs {list(v)}" for k, v in sorted(known.items()))
    return warned(f"{found}; the GPUs span {len(known)} NUMA nodes ({spread})",
                  f"a pod asking for more than {most} GPUs (the most one NUMA node holds) is refused by the"
                  " kubelet with TopologyAffinityError; use policy restricted or best-effort for larger requests")


def dra_directories(context: DoctorContext) -> Result:
    """DRA mode: the plugin registry directory, the plugins directory and the CDI directory
    are writable directories."""
    config = context.config
    if config.mode != "dra":
        return passed(f"device-plugin mode: DRA directories not used ({config.cdi_dir} included)")
    for path, what, may_be_missing in (
        (config.plugins_registry_dir, "--plugins-registry-dir", False),
        (os.path.join(config.plugins_dir, config.driver_name), "--plugins-dir", True),
        (config.cdi_dir, "--cdi-dir", True),
    ):
        bad = writable_dir(path, what, may_be_missing=may_be_missing)
        if bad is not None:
            return bad
    return passed(f"writable: {config.plugins_registry_dir}, {config.plugins_dir}, CDI specs in {config.cdi_dir}")


CHECKS = (
    Check("kubelet.plugin_dir", plugin_dir),
    Check("kubelet.socket", kubelet_socket),
    Check("kubelet.other_plugins", other_plugins, timeout_s=8.0),
    Check("kubelet.pod_resources", pod_resources),
    Check("kubelet.config", kubelet_config, timeout_s=8.0),
    Check("dra.directories", dra_directories),
)
