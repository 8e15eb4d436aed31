"""The one API-server client builder: every conversation the agent has with the API server
(reading ResourceClaims, publishing ResourceSlices) goes through a client built here, from
``--kubeconfig`` or, when it is unset, the pod's in-cluster service account
(``KUBERNETES_SERVICE_HOST`` and the mounted token).
"""

from __future__ import annotations

from typing import Any

from agent.config import Config
from agent.errors import ConfigError


def api_client(config: Config, *, retries: bool = True) -> Any:
    """A ``kubernetes.client.ApiClient`` from ``config.kubeconfig``, or the in-cluster
    configuration when it is empty. ``retries=False`` turns off the client's own retries
    (for a caller that retries in its own loop, with backoff and one log line per reason).
    Raises ConfigError naming what is wrong."""
    from kubernetes import client
    from kubernetes import config as kube_config

    configuration = client.Configuration()
    if config.kubeconfig:
        try:
            kube_config.load_kube_config(config_file=config.kubeconfig, client_configuration=configuration)
        except Exception as exc:  # the loader raises ConfigException, OSError, yaml errors
            raise ConfigError(f"--kubeconfig {config.kubeconfig}: cannot load: {exc}") from None
    else:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except Exception as exc:
            raise ConfigError(
                f"no --kubeconfig given and no in-cluster configuration ({exc}); "
                "run in a pod with a service account or pass --kubeconfig FILE"
            ) from None
    if not retries:
        configuration.retries = False
    return client.ApiClient(configuration)
