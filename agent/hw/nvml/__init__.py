"""NVML: the only package of ours that calls NVML (and the only one that imports ``pynvml``).

One module per job, each below the one it uses, none importing another both ways:

- :mod:`agent.hw.nvml.calls`: the call wrapper (``NotSupported`` -> None, lost GPUs, NVML
  errors chained into ours, error counts);
- :mod:`agent.hw.nvml.facts`: fact discovery (``NodeFacts`` from NVML and sysfs);
- :mod:`agent.hw.nvml.events`: health events (XID, double-bit ECC, lost GPUs);
- :mod:`agent.hw.nvml.telemetry`: telemetry (typed ``GpuSample`` per GPU and round);
- :mod:`agent.hw.nvml.mig`: MIG geometry and placements, read (discovery uses it);
- :mod:`agent.hw.nvml.mig_control`: creating and destroying MIG instances (dynamic MIG);
- :mod:`agent.hw.nvml.backend`: ``NvmlBackend``, the wrapper with these jobs on it,
  implementing the narrow protocols of :mod:`agent.hw.protocols`.
"""
