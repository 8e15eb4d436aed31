"""The CRI client: ``runtime.v1.RuntimeService/ListContainers`` over a unix socket against a
stand-in containerd (``cri_stub``), the pod names from the kubelet's labels, failures as one
line; and our ``proto/cri_runtime_v1.proto`` is wire-identical to the cri-api's."""

from __future__ import annotations

import pytest

from agent._proto import cri_runtime_v1_pb2 as cri
from agent.kubelet.cri import CriClient, CriContainer, CriError
from tests.testbed.cri_stub import CriStub, pod_container

CID = "ab" * 32


@pytest.fixture
def containerd(tmp_path):
    stub = CriStub(str(tmp_path / "containerd.sock")).start()
    yield stub
    stub.stop()


def test_list_names_each_container_by_the_kubelets_labels(containerd):
    containerd.containers = [
        pod_container(CID, "trainer", "ml", "main", "5c1e3b2a-6f7d-4c8e-9a0b-1d2e3f4a5b6c"),
        pod_container("cd" * 32, "old", "ml", "main", "u2", state=cri.CONTAINER_EXITED),
        cri.Container(id="ef" * 32, metadata=cri.ContainerMetadata(name="buildkit")),
    ]
    client = CriClient(containerd.socket_path)
    try:
        listed = client.list_containers()
    finally:
        client.close()
    assert listed == [
        CriContainer(CID, "trainer", "ml", "main", "5c1e3b2a-6f7d-4c8e-9a0b-1d2e3f4a5b6c"),
        CriContainer("cd" * 32, "old", "ml", "main", "u2"),  # every state is listed
        CriContainer("ef" * 32, "", "", "", ""),  # not the kubelet's: no pod
    ]


def test_the_kubelets_endpoint_spelling_is_accepted(containerd):
    containerd.containers = [pod_container(CID, "p", "ns", "c", "u")]
    client = CriClient("unix://" + containerd.socket_path)
    try:
        assert [c.pod for c in client.list_containers()] == ["p"]
    finally:
        client.close()


def test_a_runtime_that_is_down_or_refuses_is_one_line_naming_the_status(containerd, tmp_path):
    containerd.fail()
    client = CriClient(containerd.socket_path)
    with pytest.raises(CriError, match=r"^UNAVAILABLE: containerd is restarting$"):
        client.list_containers()
    client.close()
    absent = CriClient(str(tmp_path / "nothing.sock"), timeout_s=0.5)
    with pytest.raises(CriError, match=r"^(UNAVAILABLE|DEADLINE_EXCEEDED): "):
        absent.list_containers()
    absent.close()


# The cri-api's k8s.io/cri-api/pkg/apis/runtime/v1/api.proto, for the messages we carry:
# message -> {field: (number, type)}; type is the scalar name, the message or the enum.
UPSTREAM = {
    "ListContainersRequest": {"filter": (1, "ContainerFilter")},
    "ContainerFilter": {"id": (1, "string"), "state": (2, "ContainerStateValue"),
                        "pod_sandbox_id": (3, "string"),
                        "label_selector": (4, "LabelSelectorEntry")},
    "ContainerStateValue": {"state": (1, "ContainerState")},
    "ListContainersResponse": {"containers": (1, "Container")},
    "Container": {"id": (1, "string"), "pod_sandbox_id": (2, "string"),
                  "metadata": (3, "ContainerMetadata"), "image": (4, "ImageSpec"),
                  "image_ref": (5, "string"), "state": (6, "ContainerState"),
                  "created_at": (7, "int64"), "labels": (8, "LabelsEntry"),
                  "annotations": (9, "AnnotationsEntry"), "image_id": (10, "string")},
    "ContainerMetadata": {"name": (1, "string"), "attempt": (2, "uint32")},
    "ImageSpec": {"image": (1, "string"), "annotations": (2, "AnnotationsEntry"),
                  "user_specified_image": (18, "string"), "runtime_handler": (19, "string"),
                  "image_ref": (20, "string")},
}
_SCALARS = {9: "string", 3: "int64", 13: "uint32"}


def _fields(message: str) -> dict[str, tuple[int, str]]:
    out = {}
    for f in cri.DESCRIPTOR.message_types_by_name[message].fields:
        kind = (f.message_type.name if f.message_type is not None
                else f.enum_type.name if f.enum_type is not None else _SCALARS[f.type])
        out[f.name] = (f.number, kind)
    return out


@pytest.mark.parametrize("message", sorted(UPSTREAM))
def test_our_cri_messages_have_the_cri_apis_names_numbers_and_types(message):
    assert _fields(message) == UPSTREAM[message]


def test_the_method_path_and_enum_are_the_cri_apis():
    assert cri.DESCRIPTOR.package == "runtime.v1"
    method = cri.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name["ListContainers"]
    assert method.full_name == "runtime.v1.RuntimeService.ListContainers"
    assert {v.name: v.number for v in cri.ContainerState.DESCRIPTOR.values} == {
        "CONTAINER_CREATED": 0, "CONTAINER_RUNNING": 1, "CONTAINER_EXITED": 2,
        "CONTAINER_UNKNOWN": 3}
