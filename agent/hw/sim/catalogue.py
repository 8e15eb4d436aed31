"""The GPU catalogue: what NVML reports for real products (memory as nvidia-smi shows it).

A machine spec names a model; a name not in :data:`GPU_MODELS` is simulated with only what
the spec states about it (everything else unknown: NVML answers ``NotSupported``).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.hw.sim.nvml_types import CONSTANTS as _C


@dataclass(frozen=True)
class GpuModel:
    """What NVML reports for one product; a spec may override any of it per GPU."""

    name: str | None  # None: unknown (nvmlDeviceGetName answers NotSupported)
    memory_mib: int | None  # None: unknown
    compute_capability: tuple[int, int] | None  # None: unknown
    architecture: str = "unknown"  # volta | turing | ampere | ada | hopper | blackwell
    nvlinks: int = 0  # NVLink ports the chip has (0: none)
    mig: bool | None = False  # MIG capable (None: unknown)
    brand: str | None = "NVIDIA"  # NVML_BRAND_<brand> (None: unknown, NotSupported)
    hbm: bool = True  # has a memory temperature sensor and row remapping (HBM)
    pci_device_id: int = 0x000010DE  # (device << 16) | vendor, as NVML packs it
    tdp_w: int = 300
    max_sm_clock_mhz: int = 1410
    mem_clock_mhz: int = 1215
    sm_count: int = 108

    @property
    def arch_constant(self) -> int:
        return _C.get(
            f"NVML_DEVICE_ARCH_{self.architecture.upper()}", _C["NVML_DEVICE_ARCH_UNKNOWN"]
        )

    @property
    def nvlink_version(self) -> int:
        return {
            "volta": _C["NVML_NVLINK_VERSION_2_0"],
            "ampere": _C["NVML_NVLINK_VERSION_3_0"],
            "hopper": _C["NVML_NVLINK_VERSION_4_0"],
            "blackwell": _C["NVML_NVLINK_VERSION_5_0"],
        }.get(self.architecture, _C["NVML_NVLINK_VERSION_INVALID"])

    @property
    def supported_event_types(self) -> int:
        """``nvmlDeviceGetSupportedEventTypes``: every type on Hopper and newer (seen: an
        H200, driver 580.159.04, 0xff9f); the five classic ones before (not seen on a real
        GPU here)."""
        if self.architecture in ("hopper", "blackwell"):
            return int(_C["nvmlEventTypeAll"])
        return int(
            _C["nvmlEventTypeSingleBitEccError"] | _C["nvmlEventTypeDoubleBitEccError"]
            | _C["nvmlEventTypePState"] | _C["nvmlEventTypeXidCriticalError"] | _C["nvmlEventTypeClock"]
        )


#: Real product names and what NVML reports for them (memory as nvidia-smi shows it).
GPU_MODELS: dict[str, GpuModel] = {
    str(m.name): m
    for m in (
        GpuModel(
            "Tesla V100-SXM2-16GB",
            16160,
            (7, 0),
            "volta",
            6,
            pci_device_id=0x1DB110DE,
            brand="TESLA",
            max_sm_clock_mhz=1530,
            mem_clock_mhz=877,
            sm_count=80,
        ),
        GpuModel(
            "Tesla V100-SXM3-32GB",
            32510,
            (7, 0),
            "volta",
            6,
            pci_device_id=0x1DB810DE,
            brand="TESLA",
            tdp_w=350,
            max_sm_clock_mhz=1597,
            mem_clock_mhz=958,
            sm_count=80,
        ),
        GpuModel(
            "NVIDIA A100-SXM4-40GB",
            40960,
            (8, 0),
            "ampere",
            12,
            mig=True,
            pci_device_id=0x20B010DE,
            tdp_w=400,
        ),
        GpuModel(
            "NVIDIA A100-SXM4-80GB",
            81920,
            (8, 0),
            "ampere",
            12,
            mig=True,
            pci_device_id=0x20B210DE,
            tdp_w=400,
            mem_clock_mhz=1593,
        ),
        GpuModel(
            "NVIDIA A100 80GB PCIe",
            81920,
            (8, 0),
            "ampere",
            12,
            mig=True,
            pci_device_id=0x20B510DE,
            mem_clock_mhz=1512,
        ),
        GpuModel(
            "NVIDIA A30",
            24576,
            (8, 0),
            "ampere",
            4,
            mig=True,
            pci_device_id=0x20B710DE,
            tdp_w=165,
            max_sm_clock_mhz=1440,
            mem_clock_mhz=1215,
            sm_count=56,
        ),
        GpuModel(
            "NVIDIA H100 80GB HBM3",
            81559,
            (9, 0),
            "hopper",
            18,
            mig=True,
            pci_device_id=0x233010DE,
            tdp_w=700,
            max_sm_clock_mhz=1980,
            mem_clock_mhz=2619,
            sm_count=132,
        ),
        GpuModel(
            "NVIDIA H100 NVL",
            95830,
            (9, 0),
            "hopper",
            18,
            mig=True,
            pci_device_id=0x232110DE,
            tdp_w=400,
            max_sm_clock_mhz=1785,
            mem_clock_mhz=2619,
            sm_count=132,
        ),
        GpuModel(
            "NVIDIA H200",
            143771,
            (9, 0),
            "hopper",
            18,
            mig=True,
            pci_device_id=0x233510DE,
            tdp_w=700,
            max_sm_clock_mhz=1980,
            mem_clock_mhz=3201,
            sm_count=132,
        ),
        GpuModel(
            "NVIDIA B200",
            183359,
            (10, 0),
            "blackwell",
            18,
            mig=True,
            pci_device_id=0x290110DE,
            tdp_w=1000,
            max_sm_clock_mhz=1965,
            mem_clock_mhz=3996,
            sm_count=148,
        ),
        GpuModel(
            "NVIDIA GB200",
            189471,
            (10, 0),
            "blackwell",
            18,
            mig=True,
            pci_device_id=0x294110DE,
            tdp_w=1200,
            max_sm_clock_mhz=2062,
            mem_clock_mhz=3996,
            sm_count=152,
        ),
        GpuModel(
            "NVIDIA L40S",
            46068,
            (8, 9),
            "ada",
            0,
            hbm=False,
            pci_device_id=0x26B910DE,
            tdp_w=350,
            max_sm_clock_mhz=2520,
            mem_clock_mhz=9001,
            sm_count=142,
        ),
        GpuModel(
            "NVIDIA A10",
            23028,
            (8, 6),
            "ampere",
            0,
            hbm=False,
            pci_device_id=0x223610DE,
            tdp_w=150,
            max_sm_clock_mhz=1695,
            mem_clock_mhz=6251,
            sm_count=72,
        ),
    )
}


def unknown_model(name: str | None = None, nvlinks: int = 0) -> GpuModel:
    """A product the catalogue does not know: only its name (if given) and NVLink ports;
    memory, compute capability, architecture and MIG capability unknown."""
    return GpuModel(name, None, None, "unknown", nvlinks, mig=None, hbm=False, brand=None)
