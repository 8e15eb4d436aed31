"""MIG through the real NVML code path (NvmlBackend) on the fake pynvml: the geometry of each
MIG-capable product, the placements of a machine spec's MIG devices, and (MigControl)
instances created and destroyed as on a real GPU."""

from __future__ import annotations

import pytest

from agent.errors import (
    InputFormatError,
    MigError,
    MigInsufficientResources,
    MigInUse,
    MigNotFound,
    MigResetRequired,
)
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


# ---------------------------------------------------------------- MigControl
H100 = "NVIDIA H100 80GB HBM3"


def test_create_makes_the_instance_on_exactly_that_placement_and_discovery_sees_it(open_backend):
    sim, backend = open_backend({"model": H100, "mig": []})
    made = backend.create_mig(0, "3g.40gb", 4)
    assert (made.profile, made.placement, made.ci_id) == ("3g.40gb", MigPlacement(4, 4), 0)
    assert made.uuid is not None and made.uuid.startswith("MIG-")
    assert backend.mig_instances(0) == (made,)
    devices = backend.read_facts().gpus[0].mig_devices
    assert [(d.uuid, d.profile, d.placement, d.gi_id, d.ci_id) for d in devices] == [
        (made.uuid, "3g.40gb", MigPlacement(4, 4), made.gi_id, 0)
    ]
    assert (
        sim.lib.nvmlDeviceGetGpuInstanceRemainingCapacity(sim.lib.nvmlDeviceGetHandleByIndex(0), 9)
        == 1
    )


@pytest.mark.parametrize(
    ("first", "second"), [(("3g.40gb", 4), ("2g.20gb", 4)), (("7g.80gb", 0), ("1g.10gb", 6))]
)
def test_a_placement_overlapping_a_taken_one_is_refused_as_insufficient_resources(
    open_backend, first, second
):
    _, backend = open_backend({"model": H100, "mig": []})
    backend.create_mig(0, *first)
    with pytest.raises(
        MigInsufficientResources,
        match=rf"GPU 0: creating a {second[0]} MIG instance at memory slice "
        rf"{second[1]}: NVML nvmlDeviceCreateGpuInstanceWithPlacement answered Insufficient Resources",
    ):
        backend.create_mig(0, *second)
    assert [m.profile for m in backend.mig_instances(0)] == [first[0]]


def test_a_profile_or_start_the_gpu_does_not_offer_is_refused_before_nvml_is_asked(open_backend):
    sim, backend = open_backend({"model": H100, "mig": []})
    with pytest.raises(MigError, match=r"GPU 0: .*no such MIG profile \(its profiles: 1g\.10gb,"):
        backend.create_mig(0, "3g.20gb", 0)
    with pytest.raises(MigError, match=r"not a legal placement of 3g\.40gb \(starts: 0, 4\)"):
        backend.create_mig(0, "3g.40gb", 2)
    assert sim.lib.calls["nvmlDeviceCreateGpuInstanceWithPlacement"] == 0


def test_destroy_removes_the_instance_and_an_unknown_one_is_not_found(open_backend):
    _, backend = open_backend({"model": H100, "mig": ["1g.10gb"]})
    made = backend.create_mig(0, "2g.20gb", 2)
    backend.destroy_mig(0, made.gi_id)
    assert [m.profile for m in backend.mig_instances(0)] == ["1g.10gb"]  # the spec's own is left
    assert [d.profile for d in backend.read_facts().gpus[0].mig_devices] == ["1g.10gb"]
    with pytest.raises(
        MigNotFound, match=rf"GPU 0: destroying MIG GPU instance {made.gi_id}: .*Not Found"
    ):
        backend.destroy_mig(0, made.gi_id)


def test_destroying_an_instance_whose_processes_run_is_refused_as_in_use(open_backend):
    sim, backend = open_backend({"model": H100, "mig": []})
    made = backend.create_mig(0, "1g.10gb", 3)
    sim.lib.occupy_mig(0, made.gi_id)
    with pytest.raises(MigInUse, match="In use by another client"):
        backend.destroy_mig(0, made.gi_id)
    sim.lib.occupy_mig(0, made.gi_id, busy=False)
    backend.destroy_mig(0, made.gi_id)
    assert backend.mig_instances(0) == ()


def test_a_gpu_instance_left_without_compute_instance_is_listed_and_destroyed(open_backend):
    sim, backend = open_backend({"model": H100, "mig": []})
    lib = sim.lib
    h = lib.nvmlDeviceGetHandleByIndex(0)
    where = lib.c_nvmlGpuInstancePlacement_t(6, 1)
    lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where)  # a create cut short before its CI
    (left,) = backend.mig_instances(0)
    assert (left.profile, left.placement, left.ci_id, left.uuid) == (
        "1g.10gb",
        MigPlacement(6, 1),
        None,
        None,
    )
    backend.destroy_mig(0, left.gi_id)
    assert backend.mig_instances(0) == ()


def test_enable_mig_takes_effect_on_hopper_and_needs_a_reset_on_ampere_which_is_left_alone(
    open_backend,
):
    sim, backend = open_backend(
        {"model": H100}, {"model": "NVIDIA A100-SXM4-80GB"}, {"model": "NVIDIA A30"}
    )
    lib = sim.lib
    backend.enable_mig(0)
    assert lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(0)) == [1, 1]
    assert backend.create_mig(0, "7g.80gb", 0).placement == MigPlacement(0, 8)
    for ampere in (1, 2):
        with pytest.raises(
            MigResetRequired, match=rf"GPU {ampere}: switching MIG mode on needs a GPU reset"
        ):
            backend.enable_mig(ampere)
        assert lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(ampere)) == [0, 0]
    # NVML itself, asked on Ampere: the change stays pending
    assert (
        lib.nvmlDeviceSetMigMode(lib.nvmlDeviceGetHandleByIndex(1), 1)
        == lib.NVML_ERROR_RESET_REQUIRED
    )
    assert lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(1)) == [0, 1]
    with pytest.raises(MigResetRequired):
        backend.enable_mig(1)


def test_disable_mig_switches_a_hopper_gpu_back_once_empty_and_leaves_ampere_alone(open_backend):
    sim, backend = open_backend({"model": H100}, {"model": "NVIDIA A100-SXM4-80GB", "mig": []})
    lib = sim.lib
    backend.enable_mig(0)
    made = backend.create_mig(0, "1g.10gb", 0)
    with pytest.raises(MigInUse, match="GPU 0: switching MIG mode off"):
        backend.disable_mig(0)  # an instance is left
    backend.destroy_mig(0, made.gi_id)
    backend.disable_mig(0)
    assert lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(0)) == [0, 0]
    with pytest.raises(MigResetRequired, match="GPU 1: switching MIG mode off needs a GPU reset"):
        backend.disable_mig(1)
    assert lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(1)) == [1, 1]


def test_enable_mig_on_a_hopper_gpu_running_processes_is_refused_as_in_use(open_backend):
    sim, backend = open_backend(
        {"model": H100, "processes": [{"pid": 4242, "used_memory_mib": 100}]}
    )
    with pytest.raises(MigInUse, match="GPU 0: switching MIG mode on"):
        backend.enable_mig(0)


def test_creating_on_a_gpu_with_mig_off_or_without_mig_is_a_mig_error(open_backend):
    _, backend = open_backend({"model": H100}, {"model": "NVIDIA L40S"})
    with pytest.raises(
        MigError, match="GPU 0: creating a 1g.10gb MIG instance at memory slice 0: the GPU does not"
    ):
        backend.create_mig(0, "1g.10gb", 0)
    with pytest.raises(MigError, match=r"GPU 1: .*no such MIG profile \(its profiles: none\)"):
        backend.create_mig(1, "1g.10gb", 0)
    assert backend.mig_instances(1) == ()


@pytest.mark.parametrize("model", sorted(MIG_MODELS))
def test_every_profile_of_every_product_can_be_created_at_each_placement_on_a_free_gpu(
    open_backend, model
):
    _, backend = open_backend({"model": model, "mig": []})
    geometry = geometry_for(model)
    assert geometry is not None
    for p in geometry.profiles:
        for placement in p.placements:
            made = backend.create_mig(0, p.name, placement.start)
            assert (made.profile, made.placement) == (p.name, placement)
            backend.destroy_mig(0, made.gi_id)
    assert backend.mig_instances(0) == ()


# ---------------------------------------------------------------- the simulator's state file
def test_the_mig_layout_outlives_the_simulated_machine_through_the_state_file(
    tmp_path, monkeypatch, open_backend
):
    state = tmp_path / "sim-state.json"
    monkeypatch.setenv("GPU_AGENT_SIM_STATE", str(state))
    _, first = open_backend({"model": H100, "mig": ["1g.10gb"]})
    made = first.create_mig(0, "3g.40gb", 4)
    spec_own = next(m for m in first.mig_instances(0) if m.profile == "1g.10gb")
    first.destroy_mig(0, spec_own.gi_id)
    sim, again = open_backend(
        {"model": H100, "mig": ["1g.10gb"]}
    )  # same spec, a new process's view
    assert again.mig_instances(0) == (made,)
    assert [d.uuid for d in again.read_facts().gpus[0].mig_devices] == [made.uuid]
    assert not [p for p in tmp_path.iterdir() if p.name != "sim-state.json"]  # no temp file left
    # a MIG device made after the restart never reuses a UUID
    assert again.create_mig(0, "1g.10gb", 0).uuid not in (made.uuid, spec_own.uuid)


def test_an_agent_process_started_on_the_same_state_file_sees_the_instances(
    tmp_path, monkeypatch, open_backend
):
    import json
    import subprocess
    import sys

    spec = tmp_path / "m.yaml"
    spec.write_text(
        'name: m\ngpus:\n  - {bus_id: "0000:10:00.0", model: NVIDIA H100 80GB HBM3, mig: []}\n'
    )
    state = tmp_path / "state.json"
    monkeypatch.setenv("GPU_AGENT_SIM_STATE", str(state))
    _, backend = open_backend({"model": H100, "mig": []})
    made = backend.create_mig(0, "2g.20gb", 2)
    out = subprocess.run(
        [sys.executable, "-m", "agent", "discover", "--simulate", str(spec), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (gpu,) = json.loads(out.stdout)["gpus"]
    assert [d["uuid"] for d in gpu["mig_devices"]] == [made.uuid]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not a readable MIG state file"),
        ('{"version": 1, "machine": "other", "gpus": {}}', "written for machine 'other', not 'm'"),
        ('{"version": 1, "machine": "m", "gpus": {"GPU-X": 1}}', None),
        ('{"version": 7}', "expected a mapping with version 1"),
    ],
)
def test_a_corrupt_state_file_is_one_clear_error_naming_it(tmp_path, monkeypatch, content, message):
    state = tmp_path / "state.json"
    state.write_text(content)
    monkeypatch.setenv("GPU_AGENT_SIM_STATE", str(state))
    if message is None:  # a GPU the machine does not have: nothing of it is laid over
        machine({"model": H100}).close()
        return
    with pytest.raises(InputFormatError, match=rf"{state} \(GPU_AGENT_SIM_STATE\): .*{message}"):
        machine({"model": H100})


def test_a_state_file_entry_with_a_profile_the_gpu_lacks_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_AGENT_SIM_STATE", str(tmp_path / "state.json"))
    sim = machine({"model": H100, "mig": ["1g.10gb"]})
    backend = sim.backend()
    backend.init()
    backend.create_mig(0, "1g.10gb", 3)
    sim.close()
    text = (tmp_path / "state.json").read_text().replace('"1g.10gb"', '"1g.5gb"')
    (tmp_path / "state.json").write_text(text)
    with pytest.raises(InputFormatError, match=r"no MIG profile '1g\.5gb' on this GPU"):
        machine({"model": H100, "mig": ["1g.10gb"]})
