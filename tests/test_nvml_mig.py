"""MIG through the real NVML code path (NvmlBackend) on the fake pynvml: the geometry of each
MIG-capable product, the placements of a machine spec's MIG devices, and (MigControl)
instances created and destroyed as on a real GPU."""

from __future__ import annotations

import pytest

from agent.errors import InputFormatError
from agent.hw.nvml.backend import NvmlBackend
from agent.hw.sim.catalogue import GPU_MODELS
from agent.hw.sim.machines import SimulatedMachine
from agent.hw.sim.mig_geometry import MIG_MODELS, geometry_for
from agent.hw.sim.spec import machine_spec_from_dict
from agent.records import MigPlacement


def machine(*gpus: dict, name: str = "m") -> SimulatedMachine:
    spec = {
        "name": name,
        "gpus": [{"bus_id": f"0000:{0x10 + i:02x}:00.0", **g} for i, g in enumerate(gpus)],
    }
    return SimulatedMachine(machine_spec_from_dict(spec, source="test.yaml"))


@pytest.fixture
def open_backend():
    opened: list[tuple[SimulatedMachine, NvmlBackend]] = []

    def open_(*gpus: dict) -> tuple[SimulatedMachine, NvmlBackend]:
        sim = machine(*gpus)
        backend = sim.backend()
        backend.init()
        opened.append((sim, backend))
        return sim, backend

    yield open_
    for sim, backend in opened:
        backend.shutdown()
        sim.close()


# ---------------------------------------------------------------- geometry
@pytest.mark.parametrize("model", sorted(MIG_MODELS))
def test_discovery_reads_each_mig_products_geometry_as_the_user_guide_gives_it(open_backend, model):
    _, backend = open_backend({"model": model})
    got, expected = backend.read_facts().gpus[0].mig_geometry, geometry_for(model)
    assert got is not None and expected is not None
    assert (got.memory_slices, got.compute_slices) == (
        expected.memory_slices,
        expected.compute_slices,
    )
    assert sorted(got.profiles, key=lambda p: p.nvml_profile) == sorted(
        expected.profiles, key=lambda p: p.nvml_profile
    )
    assert {p.name.split(".")[0] for p in got.profiles} >= {"1g", "2g", "4g"}


@pytest.mark.parametrize("model", sorted(MIG_MODELS))
def test_every_geometry_product_is_catalogued_and_its_largest_profile_fits_its_memory(model):
    geometry = geometry_for(model)
    assert model in GPU_MODELS and GPU_MODELS[model].mig
    assert geometry is not None
    assert max(p.memory_mib for p in geometry.profiles) <= (GPU_MODELS[model].memory_mib or 0)


def test_a_gpu_without_mig_or_without_a_published_layout_has_no_geometry(open_backend):
    _, backend = open_backend(
        {"model": "NVIDIA L40S"},
        {"model": "NVIDIA Z9000", "mig_capable": True},
        {"model": "NVIDIA A100-SXM4-80GB"},
    )
    gpus = backend.read_facts().gpus
    assert [g.mig_capable for g in gpus] == [False, True, True]
    assert [g.mig_geometry is None for g in gpus] == [True, True, False]
    assert gpus[2].mig_enabled is False  # MIG capable, MIG off: stays off


def test_possible_placements_are_every_legal_one_taken_or_not(open_backend):
    sim, backend = open_backend({"model": "NVIDIA H100 80GB HBM3", "mig": ["3g.40gb", "3g.40gb"]})
    geometry = backend.read_facts().gpus[0].mig_geometry
    assert geometry is not None and geometry.profile("3g.40gb").placements == (
        MigPlacement(0, 4),
        MigPlacement(4, 4),
    )
    assert geometry.profile("7g.80gb").placements == (MigPlacement(0, 8),)
    assert (geometry.memory_slices, geometry.compute_slices) == (8, 7)


# ---------------------------------------------------------------- the spec's MIG devices
def test_a_specs_mig_devices_sit_on_legal_placements_in_spec_order(open_backend):
    # 3g + 2g + 1g + 1g fits an A100 only with the 3g at slice 4: the first legal assignment
    _, backend = open_backend(
        {"model": "NVIDIA A100-SXM4-40GB", "mig": ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]},
        {"model": "NVIDIA A100-SXM4-40GB", "mig": ["1g.5gb"] * 7},
        {"model": "NVIDIA A100-SXM4-40GB", "mig": ["1c.3g.20gb", "4g.20gb"]},
    )
    gpus = backend.read_facts().gpus
    assert [(d.profile, d.placement) for d in gpus[0].mig_devices] == [
        ("3g.20gb", MigPlacement(4, 4)),
        ("2g.10gb", MigPlacement(0, 2)),
        ("1g.5gb", MigPlacement(2, 1)),
        ("1g.5gb", MigPlacement(3, 1)),
    ]
    assert [d.placement.start for d in gpus[1].mig_devices if d.placement] == list(range(7))
    assert [(d.profile, d.placement) for d in gpus[2].mig_devices] == [
        ("1c.3g.20gb", MigPlacement(4, 4)),
        ("4g.20gb", MigPlacement(0, 4)),
    ]
    geometry = gpus[0].mig_geometry
    assert geometry is not None
    assert [d.profile_id for d in gpus[0].mig_devices] == [
        geometry.profile(n).profile_id for n in ("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb")
    ]


def test_mig_on_with_no_instances_is_a_mig_gpu_with_no_mig_devices(open_backend):
    _, backend = open_backend({"model": "NVIDIA H100 80GB HBM3", "mig": []})
    gpu = backend.read_facts().gpus[0]
    assert (gpu.mig_enabled, gpu.mig_devices, gpu.mig_geometry is not None) == (True, (), True)


@pytest.mark.parametrize(
    ("mig", "message"),
    [
        (
            ["1g.5gb+me", "1g.5gb+me"],
            r"gpus\[0\]\.mig\[1\]: 1g\.5gb\+me does not fit on the NVIDIA A100-SXM4-40GB "
            r"beside 1g\.5gb\+me",
        ),
        (["3g.20gb", "3g.20gb", "1g.5gb"], r"gpus\[0\]\.mig\[2\]: 1g\.5gb does not fit"),
        (["2g.20gb"], r"gpus\[0\]\.mig\[0\]: NVIDIA A100-SXM4-40GB has no MIG profile '2g\.20gb'"),
    ],
)
def test_a_spec_whose_mig_devices_cannot_be_placed_is_refused_naming_gpu_and_profile(mig, message):
    spec = {
        "name": "m",
        "gpus": [{"bus_id": "0000:10:00.0", "model": "NVIDIA A100-SXM4-40GB", "mig": mig}],
    }
    with pytest.raises(InputFormatError, match=message):
        machine_spec_from_dict(spec, source="bad.yaml")
