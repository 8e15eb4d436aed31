"""Registering a plugin with the kubelet, both ways the kubelet offers.

- A device plugin calls the kubelet: ``/v1beta1.Registration/Register`` on
  ``<kubelet_dir>/kubelet.sock`` (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1), naming its
  resource, its socket's base name in the same directory, and its options.
- A plugin found by the kubelet's plugin watcher (DRA drivers, CSI drivers) serves
  ``/pluginregistration.Registration/*`` on a socket in the plugins registry directory:
  the watcher calls ``GetInfo`` (the plugin type, name, endpoint and the service versions
  served) and reports the outcome with ``NotifyRegistrationStatus``
  (k8s.io/kubelet/pkg/apis/pluginregistration/v1).
"""

from __future__ import annotations

from typing import Callable, Sequence

import grpc

from agent._proto import deviceplugin_v1beta1_pb2 as dp_pb
from agent._proto import deviceplugin_v1beta1_pb2_grpc as dp_pb_grpc
from agent._proto import pluginregistration_v1_pb2 as reg_pb
from agent._proto import pluginregistration_v1_pb2_grpc as reg_pb_grpc

#: The kubelet's device-plugin registration socket, in its device-plugin directory.
KUBELET_SOCKET = "kubelet.sock"
#: The device-plugin API version we speak (``pluginapi.Version``).
DEVICE_PLUGIN_API_VERSION = "v1beta1"


def register_device_plugin(
    kubelet_socket: str,
    *,
    resource_name: str,
    endpoint: str,
    options: dp_pb.DevicePluginOptions,
    timeout_s: float = 5.0,
) -> None:
    """Call ``/v1beta1.Registration/Register`` on the kubelet for the plugin serving
    ``resource_name`` on ``endpoint`` (a socket base name in the kubelet's directory).
    Raises grpc.RpcError when the kubelet is absent or refuses (its reason is in
    ``.details()``)."""
    request = dp_pb.RegisterRequest(
        version=DEVICE_PLUGIN_API_VERSION, endpoint=endpoint, resource_name=resource_name, options=options,
    )
    with grpc.insecure_channel(f"unix:{kubelet_socket}") as channel:
        dp_pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout_s)


class WatcherRegistrationServicer(reg_pb_grpc.RegistrationServicer):
    """``/pluginregistration.Registration/*`` for the kubelet's plugin watcher: tells it
    ``plugin_type``, ``name``, ``endpoint`` and ``supported_versions``, and hands each
    ``NotifyRegistrationStatus`` to ``on_status(registered, error)``."""

    def __init__(
        self,
        plugin_type: str,
        name: str,
        endpoint: str,
        supported_versions: Sequence[str],
        on_status: Callable[[bool, str], None],
    ) -> None:
        self.plugin_type = plugin_type
        self.name = name
        self.endpoint = endpoint
        self.supported_versions = tuple(supported_versions)
        self._on_status = on_status

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=self.plugin_type, name=self.name, endpoint=self.endpoint,
            supported_versions=list(self.supported_versions),
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        self._on_status(request.plugin_registered, request.error)
        return reg_pb.RegistrationStatusResponse()


def add_watcher_registration(servicer: WatcherRegistrationServicer, server: grpc.Server) -> None:
    """Install ``servicer`` on ``server`` (the registration socket's server)."""
    reg_pb_grpc.add_RegistrationServicer_to_server(servicer, server)
