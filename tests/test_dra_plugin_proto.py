"""Our DRA and plugin-registration protos against the kubelet's, descriptor by descriptor.

The expected tables are transcribed from kubernetes/kubernetes
staging/src/k8s.io/kubelet/pkg/apis/{pluginregistration/v1,dra/v1,dra/v1beta1,dra-health/v1alpha1,
dra-health/v1beta1}/api.proto
(the commits are named at the top of each proto/*.proto). Package, service and method names
make up the gRPC method paths; field names, numbers, types and labels make up the wire.
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from agent._proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1beta1_pb2,
    dra_v1_pb2,
    dra_v1beta1_pb2,
    pluginregistration_v1_pb2,
)

STR, BOOL, MSG = F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_MESSAGE
ONE, MANY = "optional", "repeated"

# message -> [(field, number, type, label, message type or None)]
DRA_MESSAGES = {
    "NodePrepareResourcesRequest": [("claims", 1, MSG, MANY, "Claim")],
    "NodePrepareResourcesResponse": [("claims", 1, MSG, MANY, "NodePrepareResourcesResponse.ClaimsEntry")],
    "NodePrepareResourceResponse": [("devices", 1, MSG, MANY, "Device"), ("error", 2, STR, ONE, None)],
    "Device": [
        ("request_names", 1, STR, MANY, None), ("pool_name", 2, STR, ONE, None),
        ("device_name", 3, STR, ONE, None), ("cdi_device_ids", 4, STR, MANY, None),
    ],
    "NodeUnprepareResourcesRequest": [("claims", 1, MSG, MANY, "Claim")],
    "NodeUnprepareResourcesResponse": [("claims", 1, MSG, MANY, "NodeUnprepareResourcesResponse.ClaimsEntry")],
    "NodeUnprepareResourceResponse": [("error", 1, STR, ONE, None)],
    "Claim": [("namespace", 1, STR, ONE, None), ("uid", 2, STR, ONE, None), ("name", 3, STR, ONE, None)],
}
DRA_METHODS = {
    "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
    "NodeUnprepareResources": ("NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse"),
}
# map<string, V> entries: key = 1 (string), value = 2 (V)
DRA_MAPS = {
    "NodePrepareResourcesResponse": "NodePrepareResourceResponse",
    "NodeUnprepareResourcesResponse": "NodeUnprepareResourceResponse",
}

REG_MESSAGES = {
    "PluginInfo": [
        ("type", 1, STR, ONE, None), ("name", 2, STR, ONE, None), ("endpoint", 3, STR, ONE, None),
        ("supported_versions", 4, STR, MANY, None),
    ],
    "RegistrationStatus": [("plugin_registered", 1, BOOL, ONE, None), ("error", 2, STR, ONE, None)],
    "RegistrationStatusResponse": [],
    "InfoRequest": [],
}
REG_METHODS = {
    "GetInfo": ("InfoRequest", "PluginInfo"),
    "NotifyRegistrationStatus": ("RegistrationStatus", "RegistrationStatusResponse"),
}


def _label(field) -> str:
    # protobuf 6 has is_repeated; older releases only the label
    repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == F.LABEL_REPEATED
    return "repeated" if repeated else "optional"


def fields_of(message, package: str) -> list[tuple]:
    out = []
    for f in sorted(message.fields, key=lambda f: f.number):
        msg = f.message_type.full_name.removeprefix(package + ".") if f.message_type else None
        out.append((f.name, f.number, f.type, _label(f), msg))
    return out


def check(module, package: str, service: str, messages: dict, methods: dict) -> None:
    desc = module.DESCRIPTOR
    assert desc.package == package
    assert set(desc.message_types_by_name) == set(messages)
    for name, expected in messages.items():
        assert fields_of(desc.message_types_by_name[name], package) == expected, name
    svc = desc.services_by_name[service]
    assert list(desc.services_by_name) == [service]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in svc.methods} == methods
    for m in svc.methods:
        assert not m.client_streaming and not m.server_streaming


@pytest.mark.parametrize("module, package", [
    (dra_v1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1"),
    (dra_v1beta1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1beta1"),
])
def test_dra_protos_match_the_kubelets_package_service_methods_and_fields(module, package):
    check(module, package, "DRAPlugin", DRA_MESSAGES, DRA_METHODS)
    for outer, value in DRA_MAPS.items():
        entry = module.DESCRIPTOR.message_types_by_name[outer].nested_types_by_name["ClaimsEntry"]
        assert entry.GetOptions().map_entry
        assert fields_of(entry, package) == [("key", 1, STR, ONE, None), ("value", 2, MSG, ONE, value)]


def test_dra_method_paths_are_the_ones_the_kubelet_calls():
    assert dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].methods_by_name["NodePrepareResources"].full_name \
        == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.NodePrepareResources"
    assert dra_v1beta1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name \
        == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"


def test_pluginregistration_proto_matches_the_kubelets():
    check(pluginregistration_v1_pb2, "pluginregistration", "Registration", REG_MESSAGES, REG_METHODS)


def test_a_message_encoded_by_one_version_decodes_in_the_other():
    # v1 and v1beta1 are the same wire format; the kubelet may speak either.
    msg = dra_v1_pb2.NodePrepareResourcesResponse()
    msg.claims["u"].devices.add(request_names=["r"], pool_name="p", device_name="gpu-0", cdi_device_ids=["a/b=c"])
    back = dra_v1beta1_pb2.NodePrepareResourcesResponse.FromString(msg.SerializeToString())
    assert back.claims["u"].devices[0].cdi_device_ids == ["a/b=c"]


# staging/src/k8s.io/kubelet/pkg/apis/dra-health/{v1alpha1,v1beta1}/api.proto
I64, ENUM = F.TYPE_INT64, F.TYPE_ENUM
HEALTH_MESSAGES = {
    "NodeWatchResourcesRequest": [],
    "DeviceIdentifier": [("pool_name", 1, STR, ONE, None), ("device_name", 2, STR, ONE, None)],
    "DeviceHealth": [("device", 1, MSG, ONE, "DeviceIdentifier"), ("health", 2, ENUM, ONE, None),
                     ("last_updated_time", 3, I64, ONE, None)],
    "NodeWatchResourcesResponse": [("devices", 1, MSG, MANY, "DeviceHealth")],
}
HEALTH_BETA_FIELDS = [("health_check_timeout_seconds", 4, I64, ONE, None), ("message", 5, STR, ONE, None)]


@pytest.mark.parametrize("module, package", [
    (dra_health_v1alpha1_pb2, "v1alpha1"),
    (dra_health_v1beta1_pb2, "v1beta1"),
])
def test_dra_health_protos_match_the_kubelets(module, package):
    desc = module.DESCRIPTOR
    assert desc.package == package
    assert set(desc.message_types_by_name) == set(HEALTH_MESSAGES)
    for name, expected in HEALTH_MESSAGES.items():
        if name == "DeviceHealth" and package == "v1beta1":
            expected = expected + HEALTH_BETA_FIELDS
        assert fields_of(desc.message_types_by_name[name], package) == expected, name
    (enum,) = desc.enum_types_by_name.values()
    assert (enum.name, [(v.name, v.number) for v in enum.values]) == (
        "HealthStatus", [("UNKNOWN", 0), ("HEALTHY", 1), ("UNHEALTHY", 2)])
    assert desc.message_types_by_name["DeviceHealth"].fields_by_name["health"].enum_type.full_name \
        == f"{package}.HealthStatus"
    (svc,) = desc.services_by_name.values()
    (method,) = svc.methods
    assert method.full_name == f"{package}.DRAResourceHealth.NodeWatchResources"
    assert (method.input_type.name, method.output_type.name) == ("NodeWatchResourcesRequest", "NodeWatchResourcesResponse")
    assert method.server_streaming and not method.client_streaming


def test_a_v1beta1_health_list_reads_as_v1alpha1_without_the_new_fields():
    msg = dra_health_v1beta1_pb2.NodeWatchResourcesResponse()
    d = msg.devices.add(health=dra_health_v1beta1_pb2.UNHEALTHY, last_updated_time=7, message="XID 79")
    d.device.pool_name, d.device.device_name = "node-1", "gpu-3"
    back = dra_health_v1alpha1_pb2.NodeWatchResourcesResponse.FromString(msg.SerializeToString())
    assert (back.devices[0].device.device_name, back.devices[0].health) == ("gpu-3", dra_health_v1alpha1_pb2.UNHEALTHY)
