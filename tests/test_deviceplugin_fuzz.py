"""Fuzzing the kubelet-facing request handling: whatever IDs and sizes arrive, the answer is
either a valid one or an AllocationError (INVALID_ARGUMENT on the wire) — never another
exception, never a short, padded or duplicated answer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import Config, TimeSlicingResource
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.resources import build_resources
from agent.errors import AllocationError
from tests.testbed.kubelet_stub import hgx8_topology

TOPOLOGY = hgx8_topology(mig=True)
CONFIGS = {
    "gpus": Config(),
    "replicas": Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=3),)),
    "mig-mixed": Config(mig_strategy="mixed"),
}
HANDLERS = [
    RequestHandler(resource, TOPOLOGY, config)
    for config in CONFIGS.values()
    for resource in build_resources(TOPOLOGY, config)
]
GARBAGE = st.sampled_from(["", "GPU-", "GPU-nope", "::1", "MIG-x", "0", "-1", "GPU-0::99", "\x00", "é" * 70])


@st.composite
def requests(draw):
    handler = draw(st.sampled_from(HANDLERS))
    ids = [d.id for d in handler.resource.devices]
    pick = st.one_of(st.sampled_from(ids), GARBAGE) if draw(st.booleans()) else st.sampled_from(ids)
    available = draw(st.lists(pick, max_size=len(ids) + 2))
    must = draw(st.lists(pick, max_size=3))
    size = draw(st.integers(min_value=-2, max_value=len(ids) + 2))
    return handler, available, must, size


@settings(max_examples=300, deadline=None)
@given(requests())
def test_preferred_allocation_is_valid_or_a_clear_allocation_error(request):
    handler, available, must, size = request
    try:
        got = handler.preferred(available, must, size)
    except AllocationError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert len(got) == size == len(set(got))
    assert set(must) <= set(got) <= set(available)


@settings(max_examples=300, deadline=None)
@given(requests())
def test_allocate_is_valid_or_a_clear_allocation_error(request):
    handler, available, _, _ = request
    try:
        response = handler.allocate(available)
    except AllocationError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert available and len(set(available)) == len(available)
    assert response is not None
