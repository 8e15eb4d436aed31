"""The kubelet plumbing both kubelet-facing sides use (the device plugin and DRA, siblings
above this package, and the metrics' pod attribution): the unix-socket gRPC server with
its single-owner check (:mod:`.unix_server`), registration with the kubelet, by the device
plugin's ``Register`` call or the plugin watcher's ``pluginregistration`` socket
(:mod:`.registration`), the pod-resources client (:mod:`.podresources`), and the metrics'
read-only client of the container runtime's CRI, ``ListContainers`` only (:mod:`.cri`).

Like the kubelet's own ``pluginmanager`` below its device and DRA managers, it knows no
resource, claim or GPU: it imports only the generated stubs (``agent._proto``) and the
leaves.
"""
