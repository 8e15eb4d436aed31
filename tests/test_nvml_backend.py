"""NvmlBackend on the fake pynvml: the one call wrapper, discovery under faults, NVML
missing, events, probing, GPM helpers."""

from __future__ import annotations

import logging
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.errors import AgentError
from agent.hw.nvml.backend import NvmlBackend
from agent.hw.nvml.calls import NvmlError, NvmlUnavailable
from agent.hw.nvml.facts import mig_memory_gb
from agent.hw.protocols import HealthEvent
from agent.hw.sim.machines import load_spec, open_simulated
from agent.hw.sim.nvml import FakeNvml
from agent.hw.sim.spec import machine_spec_from_dict
from agent.topology.model import Topology


@pytest.fixture(scope="module")
def h100_machine():
    with open_simulated("dgx-h100") as sim:
        yield sim


@pytest.fixture
def h100(h100_machine):
    """A fresh fake NVML (faults are per test) over the module's fake sysfs tree."""
    from agent.hw.sysfs import SysfsReader

    fake = FakeNvml(h100_machine.spec)
    backend = NvmlBackend(lib=fake, sysfs=SysfsReader(h100_machine.sysfs_root))
    backend.init()
    yield fake, backend
    backend.shutdown()


# ---------------------------------------------------------------- the call wrapper
def test_not_supported_becomes_an_absent_field_and_is_not_counted_as_an_error(h100):
    fake, backend = h100
    fake.make_unsupported("nvmlDeviceGetMinorNumber")
    fake.make_unsupported("nvmlDeviceGetCudaComputeCapability", 2)
    topo = Topology.from_facts(backend.read_facts())
    assert [g.minor_number for g in topo.gpus] == [None] * 8
    assert [g.compute_capability for g in topo.gpus] == [(9, 0)] * 2 + [None] + [(9, 0)] * 5
    assert "nvmlDeviceGetMinorNumber" not in backend.error_counts


def test_a_gpu_lost_before_discovery_is_returned_marked_lost_and_the_others_complete(h100):
    fake, backend = h100
    fake.lose_gpu(3)
    topo = Topology.from_facts(backend.read_facts())
    assert topo.gpu_count == 8
    assert [g.lost for g in topo.gpus] == [i == 3 for i in range(8)]
    assert backend.lost_gpus == {3}
    healthy = [g for g in topo.gpus if not g.lost]
    assert all(g.uuid.startswith("GPU-") and g.name == "NVIDIA H100 80GB HBM3" for g in healthy)
    assert topo.gpus[3].uuid == "GPU-unknown-3"
    # the others keep their NVSwitch links; the lost GPU has none
    assert topo.link(0, 1).nvlinks == 18 and topo.link(0, 3).nvlinks == 0
    assert backend.error_counts["nvmlDeviceGetUUID"] == 1
    assert any("lost" in note for note in topo.notes)


def test_a_gpu_lost_while_being_read_keeps_what_was_read_and_is_marked_lost(h100):
    fake, backend = h100
    fake.fail("nvmlDeviceGetMemoryInfo", FakeNvml.NVML_ERROR_GPU_IS_LOST, 2)
    topo = Topology.from_facts(backend.read_facts())
    lost = topo.gpus[2]
    assert lost.lost and lost.uuid == fake.spec.gpus[2].uuid and lost.memory_mib is None
    assert lost.pci_bus_id == "00000000:52:00.0" and lost.numa_node == 0  # read before it was lost
    assert [g.index for g in topo.gpus if g.lost] == [2]
    assert topo.link(0, 1).nvlinks == 18


def test_calls_for_a_lost_gpu_return_none_without_touching_nvml(h100):
    fake, backend = h100
    h = backend.handle(5)
    fake.lose_gpu(5)
    assert backend.call("nvmlDeviceGetPowerUsage", h) is None  # GPU inferred from the handle
    assert backend.lost_gpus == {5}
    before = fake.calls["nvmlDeviceGetPowerUsage"]
    assert backend.call("nvmlDeviceGetPowerUsage", h) is None
    assert fake.calls["nvmlDeviceGetPowerUsage"] == before
    assert backend.call("nvmlDeviceGetPowerUsage", backend.handle(4)) > 0


def test_an_unknown_nvml_error_becomes_our_error_with_the_nvml_error_chained(h100):
    fake, backend = h100
    fake.fail("nvmlDeviceGetPowerUsage", FakeNvml.NVML_ERROR_UNKNOWN, 1)
    with pytest.raises(NvmlError) as info:
        backend.call("nvmlDeviceGetPowerUsage", backend.handle(1))
    err = info.value
    assert isinstance(err, AgentError) and err.exit_code == 1
    assert isinstance(err.__cause__, FakeNvml.NVMLError_Unknown)
    assert (err.function_name, err.code, err.gpu) == ("nvmlDeviceGetPowerUsage", 999, 1)
    assert "nvmlDeviceGetPowerUsage for GPU 1 failed: Unknown Error" in str(err)
    assert backend.error_counts == {"nvmlDeviceGetPowerUsage": 1}


def test_a_function_the_driver_lacks_is_absent_and_logged_once(h100, caplog):
    fake, backend = h100
    fake.make_missing("nvmlDeviceGetSerial")
    with caplog.at_level(logging.WARNING, logger="agent.hw.nvml"):
        assert backend.call("nvmlDeviceGetSerial", backend.handle(0)) is None
        assert backend.call("nvmlDeviceGetSerial", backend.handle(1)) is None
        assert backend.call("nvmlNoSuchFunctionInThisPynvml") is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("nvmlDeviceGetSerial" in m for m in messages) == 1
    assert sum("nvmlNoSuchFunctionInThisPynvml" in m for m in messages) == 1


def test_const_reads_the_library_in_use(h100):
    _, backend = h100
    assert backend.const("NVML_TEMPERATURE_GPU") == 0
    assert backend.const("c_nvmlGpmMetricsGet_t") is FakeNvml.c_nvmlGpmMetricsGet_t
    assert backend.const("NVML_NO_SUCH_THING", None) is None
    with pytest.raises(NvmlError, match="NVML_NO_SUCH_THING"):
        backend.const("NVML_NO_SUCH_THING")


def test_concurrent_calls_from_several_threads_all_succeed(h100):
    _, backend = h100
    handles = [backend.handle(i) for i in range(8)]
    results: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(50):
                for h in handles:
                    results.append(backend.call("nvmlDeviceGetTotalEnergyConsumption", h))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 4 * 50 * 8 and all(r > 0 for r in results)


def test_pynvml_returning_bytes_is_read_like_str():
    sim = open_simulated("dgx1-v100")

    class BytesPynvml:
        """An older pynvml: strings and bus ids as bytes."""

        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

        def nvmlDeviceGetUUID(self, handle):
            return self._lib.nvmlDeviceGetUUID(handle).encode()

        def nvmlDeviceGetName(self, handle):
            return self._lib.nvmlDeviceGetName(handle).encode()

        def nvmlDeviceGetPciInfo(self, handle):
            info = self._lib.nvmlDeviceGetPciInfo(handle)
            info.busId = info.busId.encode()
            return info

        def nvmlDeviceGetNvLinkRemotePciInfo(self, device, link):
            info = self._lib.nvmlDeviceGetNvLinkRemotePciInfo(device, link)
            info.busId = info.busId.lower().encode()
            return info

    with sim:
        plain = sim.backend()
        plain.init()
        expected = Topology.from_facts(plain.read_facts())
        from agent.hw.sysfs import SysfsReader

        backend = NvmlBackend(lib=BytesPynvml(sim.lib), sysfs=SysfsReader(sim.sysfs_root))
        backend.init()
        got = Topology.from_facts(backend.read_facts())
    assert got.gpus == expected.gpus and got.links == expected.links
    assert got.gpus[0].pci_bus_id == "00000000:06:00.0"


# ---------------------------------------------------------------- NVML missing
def test_nvml_missing_is_a_clear_nvml_unavailable():
    spec = load_spec("single-gpu")
    fake = FakeNvml(spec)
    fake.fail_init(FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(NvmlUnavailable) as info:
        NvmlBackend(lib=fake).init()
    message = str(info.value)
    assert message.startswith("NVML is not available: libnvidia-ml.so.1 was not found")
    assert "\n" not in message and info.value.exit_code == 1
    fake.fail_init(FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlUnavailable, match="kernel driver is not loaded"):
        NvmlBackend(lib=fake).init()


def test_a_spec_can_declare_nvml_missing():
    data = {
        "name": "broken",
        "gpus": [{"bus_id": "0000:3b:00.0"}],
        "faults": {"init_error": "library_not_found"},
    }
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.1"):
        NvmlBackend(lib=FakeNvml(machine_spec_from_dict(data))).init()


def test_the_real_pynvml_without_a_driver_gives_nvml_unavailable():
    backend = NvmlBackend()
    try:
        backend.init()
    except NvmlUnavailable as exc:
        assert str(exc).startswith("NVML is not available:")
        return
    backend.shutdown()
    pytest.skip("this machine has a working NVIDIA driver")


def test_an_injected_xid_arrives_through_wait_events(h100):
    fake, backend = h100
    assert backend.wait_events(0) == []  # registers the event set; nothing yet
    fake.inject_xid(2, 79)
    fake.inject_ecc_dbe(6)
    assert backend.wait_events(1000) == [HealthEvent(2, "xid", 79), HealthEvent(6, "ecc_dbe")]
    assert backend.wait_events(10) == []


def test_a_lost_gpu_is_reported_once_by_wait_events(h100):
    fake, backend = h100
    assert backend.wait_events(0) == []  # registers the event set
    fake.lose_gpu(4)
    assert backend.wait_events(1000) == [HealthEvent(4, "lost")]
    assert backend.wait_events(0) == []
    assert backend.lost_gpus == {4}


def test_a_gpu_that_recovers_has_its_events_again_and_a_new_loss_is_reported_again(h100):
    fake, backend = h100
    assert backend.wait_events(0) == []
    fake.lose_gpu(4)
    assert backend.wait_events(1000) == [HealthEvent(4, "lost")]
    fake.recover_gpu(4)
    assert backend.probe(4) is True and backend.lost_gpus == frozenset()
    fake.inject_xid(4, 79)
    assert backend.wait_events(1000) == [HealthEvent(4, "xid", 79)]
    fake.lose_gpu(4)
    assert backend.wait_events(1000) == [HealthEvent(4, "lost")]


def test_probe_tells_a_lost_gpu_and_its_recovery(h100):
    fake, backend = h100
    assert backend.probe(1) is True
    fake.lose_gpu(1)
    assert backend.probe(1) is False and backend.lost_gpus == {1}
    fake.recover_gpu(1)
    assert backend.probe(1) is True and backend.lost_gpus == frozenset()
    assert backend.call("nvmlDeviceGetPowerUsage", backend.handle(1)) > 0


# ---------------------------------------------------------------- discovery details
def test_without_sysfs_the_cpu_affinity_comes_from_nvml(h100):
    fake, _ = h100
    backend = NvmlBackend(lib=fake)
    backend.init()
    topo = Topology.from_facts(backend.read_facts())
    assert [g.cpu_affinity for g in topo.gpus] == ["0-55,112-167"] * 4 + ["56-111,168-223"] * 4
    assert topo.nics == () and topo.machine is None


def test_without_sysfs_a_grace_gpu_takes_nvmls_numa_node_id():
    with open_simulated("gb200-tray") as sim:
        backend = NvmlBackend(lib=sim.lib)
        backend.init()
        topo = Topology.from_facts(backend.read_facts())
    assert [g.numa_node for g in topo.gpus] == [2, 10, 18, 26]


@pytest.mark.parametrize(
    ("total_mib", "mig_mib", "gb"),
    [
        (40960, 4864, 5),
        (40960, 9856, 10),
        (40960, 19968, 20),
        (40960, 40192, 40),
        (81920, 9728, 10),
        (81920, 40192, 40),
        (81559, 9856, 10),
        (81559, 19968, 20),
    ],
)
def test_mig_profile_memory_is_named_as_nvidias_device_plugin_names_it(total_mib, mig_mib, gb):
    assert mig_memory_gb(total_mib << 20, mig_mib) == gb


# ---------------------------------------------------------------- property: wiring round-trips
_pairs = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 3)), max_size=8
).map(lambda xs: {(min(a, b), max(a, b)): c for a, b, c in xs if a != b})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=_pairs)
def test_any_direct_nvlink_wiring_is_read_back_exactly(pairs):
    gpus = [
        {
            "bus_id": f"0000:{0x20 * i + 1:02x}:00.0",
            "model": "NVIDIA H100 80GB HBM3",
            "numa_node": i // 3,
            "host_bridge": f"pci0000:{0x20 * i:02x}",
        }
        for i in range(6)
    ]
    spec = machine_spec_from_dict(
        {
            "name": "prop",
            "numa_nodes": {0: {"cpus": "0-7"}, 1: {"cpus": "8-15"}},
            "gpus": gpus,
            "nvlink": {"pairs": [[a, b, c] for (a, b), c in sorted(pairs.items())]},
        }
    )
    backend = NvmlBackend(lib=FakeNvml(spec))  # NVML alone: no sysfs tree to write
    backend.init()
    topo = Topology.from_facts(backend.read_facts())
    got = {(link.a, link.b): link.nvlinks for link in topo.links if link.nvlinks}
    assert got == pairs
    assert all(not link.nvswitch for link in topo.links)
    assert all(
        link.pcie.name == ("NODE" if link.a // 3 == link.b // 3 else "SYS") for link in topo.links
    )


def test_mig_capability_is_read_from_nvml_get_mig_mode():
    from agent.discovery import load_topology

    assert all(g.mig_capable for g in load_topology("dgx-a100").gpus)
    assert not any(g.mig_capable for g in load_topology("dgx1-v100").gpus)


def test_error_counts_and_lost_gpus_answer_while_a_slow_nvml_call_is_in_flight(h100):
    # a scrape reads error_counts and the sampler reads lost_gpus: neither may wait for NVML
    import time

    fake, _ = h100
    in_call = threading.Event()

    class SlowNvml:
        """The fake, with a power reading that takes a second (a GPU slow to answer)."""

        def __getattr__(self, name):
            return getattr(fake, name)

        def nvmlDeviceGetPowerUsage(self, handle):
            in_call.set()
            time.sleep(1.0)
            return fake.nvmlDeviceGetPowerUsage(handle)

    backend = NvmlBackend(lib=SlowNvml())
    backend.init()
    handle = backend.handle(0)
    reader = threading.Thread(target=backend.call, args=("nvmlDeviceGetPowerUsage", handle))
    reader.start()
    try:
        assert in_call.wait(2.0)
        started = time.monotonic()
        assert backend.error_counts == {} and backend.lost_gpus == frozenset()
        assert time.monotonic() - started < 0.2, "bookkeeping reads waited for an NVML call"
    finally:
        reader.join()
