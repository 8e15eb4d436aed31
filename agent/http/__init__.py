"""The agent's HTTP side: the metrics address (:mod:`agent.http.endpoints`, ``/metrics``
behind the web configuration's TLS and basic auth, :mod:`agent.http.webconfig`) and the
probe listener for the kubelet (:mod:`agent.http.probes`, ``/health`` and ``/ready``).

It serves what it is handed (a ``render()`` for the ``/metrics`` body and a ``ready()`` for
readiness) and knows nothing of GPUs, metrics or pods: it imports the configuration only.
"""
