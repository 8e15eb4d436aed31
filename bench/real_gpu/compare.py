"""What the real-GPU kit compares, as pure functions: NVIDIA's own tools' output parsed, and
each comparison returning the differences it finds (an empty list: they agree).

A difference is ``{"step", "what", "agent", "nvidia_smi"}``. Tolerances (telemetry is read
by two programs a moment apart, so the figures may move in between):

=====================  ===========================================================
field                  tolerance
=====================  ===========================================================
utilisation (%)        15 points (the driver averages over 1/6 s to 1 s)
memory used (MiB)      256 MiB (allocations between the two reads; nvidia-smi
                       rounds to MiB)
temperature (C)        3 degrees
power (W)              10 % or 15 W, whichever is larger
per-process memory     64 MiB
per-process SM %       20 points (NVML's per-process samples are per driver period)
=====================  ===========================================================
"""

from __future__ import annotations

import re
from typing import Any

from agent.hw.topo_matrix import parse_topo_matrix

TOLERANCES = {"util_pct": 15.0, "memory_mib": 256.0, "temp_c": 3.0, "power_frac": 0.10, "power_w": 15.0,
              "process_memory_mib": 64.0, "process_sm_pct": 20.0}


def difference(step: str, what: str, agent: Any, nvidia_smi: Any) -> dict[str, Any]:
    return {"step": step, "what": what, "agent": agent, "nvidia_smi": nvidia_smi}


# ---------------------------------------------------------------- topology
def compare_topology(discovered: dict[str, Any], topo_text: str) -> list[dict[str, Any]]:
    """``discover --format json`` (NVML) against ``nvidia-smi topo -m`` read by the agent's own
    matrix reader: GPU count, NVLinks and PCIe level per pair (the level only where the
    matrix shows one: an NVLinked pair shows NV#), NUMA node per GPU, NIC names and levels."""
    facts = parse_topo_matrix(topo_text, "nvidia-smi topo -m")
    out: list[dict[str, Any]] = []
    gpus = discovered["gpus"]
    if len(gpus) != len(facts.gpus):
        return [difference("topology", "GPU count", len(gpus), len(facts.gpus))]
    links = {(x["a"], x["b"]): x for x in discovered["links"]}
    for link in facts.links:
        mine = links.get((link.a, link.b), {"nvlinks": 0, "pcie": None})
        if mine["nvlinks"] != link.nvlinks:
            out.append(difference("topology", f"NVLinks GPU{link.a}-GPU{link.b}", mine["nvlinks"], link.nvlinks))
        if link.pcie is not None and mine["pcie"] != link.pcie.name:
            out.append(difference("topology", f"PCIe level GPU{link.a}-GPU{link.b}", mine["pcie"], link.pcie.name))
    for mine, theirs in zip(gpus, facts.gpus):
        if theirs.numa_node is not None and mine["numa_node"] != theirs.numa_node:
            out.append(difference("topology", f"NUMA node of GPU{mine['index']}", mine["numa_node"], theirs.numa_node))
    nics = {n["name"]: n for n in discovered["nics"]}
    for nic in facts.nics:
        mine_nic = nics.get(nic.name)
        if mine_nic is None:
            out.append(difference("topology", f"NIC {nic.name}", None, "listed"))
            continue
        theirs_levels = [lv.name if lv is not None else None for lv in nic.levels]
        if mine_nic["levels"] != theirs_levels:
            out.append(difference("topology", f"NIC {nic.name} levels to GPU0..", mine_nic["levels"], theirs_levels))
    for name in sorted(set(nics) - {n.name for n in facts.nics}):
        out.append(difference("topology", f"NIC {name}", "listed", None))
    return out


# ---------------------------------------------------------------- labels
def parse_smi_query(text: str) -> dict[str, Any]:
    """``nvidia-smi -q``: the top keys and, per ``GPU <bus id>`` section, its keys by path
    (``"MIG Mode/Current"``, ``"FB Memory Usage/Total"``)."""
    top: dict[str, str] = {}
    gpus: list[dict[str, str]] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("="):
            continue
        if line.startswith("GPU "):
            gpus.append({"bus_id": line[4:].strip()})
            stack = []
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [key])
        if not sep or not value.strip():
            stack.append((indent, key))
            continue
        (gpus[-1] if gpus and indent > 0 else top)[path if gpus and indent > 0 else key] = value.strip()
    return {"top": top, "gpus": gpus}


def parse_labels(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def compare_labels(labels: dict[str, str], query: dict[str, Any], compute_caps: list[str]) -> list[dict[str, Any]]:
    """``labels`` (GFD's names) against ``nvidia-smi -q`` and ``--query-gpu=compute_cap``:
    product, memory, driver version, compute capability, MIG capability, GPU count (GFD
    labels the first GPU's model)."""
    out: list[dict[str, Any]] = []
    gpus = query["gpus"]
    if not gpus:
        return [difference("labels", "GPUs in nvidia-smi -q", labels.get("nvidia.com/gpu.count"), 0)]
    first = gpus[0]
    checks = [
        ("nvidia.com/gpu.count", str(len(gpus))),
        ("nvidia.com/gpu.product", first.get("Product Name", "").replace(" ", "-")),
        ("nvidia.com/gpu.memory", first.get("FB Memory Usage/Total", "").removesuffix(" MiB")),
        ("nvidia.com/cuda.driver-version.full", query["top"].get("Driver Version")),
        ("nvidia.com/mig.capable", "false" if first.get("MIG Mode/Current") in (None, "N/A") else "true"),
    ]
    if compute_caps and compute_caps[0] not in ("[N/A]", ""):
        major, _, minor = compute_caps[0].partition(".")
        checks += [("nvidia.com/gpu.compute.major", major), ("nvidia.com/gpu.compute.minor", minor)]
    for key, theirs in checks:
        if labels.get(key) != theirs:
            out.append(difference("labels", key, labels.get(key), theirs))
    return out


# ---------------------------------------------------------------- metrics
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> metric name -> GPU index -> value (series with a ``gpu`` label)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        if "gpu" in labels:
            out.setdefault(m[1], {})[labels["gpu"]] = float(m[3])
    return out


def compare_metrics(metrics: dict[str, dict[str, float]], rows: list[list[str]]) -> list[dict[str, Any]]:
    """One scrape against ``--query-gpu=index,utilization.gpu,memory.used,temperature.gpu,
    power.draw`` (``csv,noheader,nounits``), within :data:`TOLERANCES`."""
    out: list[dict[str, Any]] = []
    t = TOLERANCES
    for row in rows:
        index, util, used, temp, power = (c.strip() for c in row)
        pairs = [("DCGM_FI_DEV_GPU_UTIL", util, lambda a, b: abs(a - b) <= t["util_pct"]),
                 ("DCGM_FI_DEV_FB_USED", used, lambda a, b: abs(a - b) <= t["memory_mib"]),
                 ("DCGM_FI_DEV_GPU_TEMP", temp, lambda a, b: abs(a - b) <= t["temp_c"]),
                 ("DCGM_FI_DEV_POWER_USAGE", power,
                  lambda a, b: abs(a - b) <= max(t["power_w"], t["power_frac"] * b))]
        for name, theirs, close in pairs:
            mine = metrics.get(name, {}).get(index)
            if theirs in ("[N/A]", "N/A"):
                if mine is not None:
                    out.append(difference("metrics", f"{name} GPU{index}", mine, "N/A"))
                continue
            if mine is None or not close(mine, float(theirs)):
                out.append(difference("metrics", f"{name} GPU{index}", mine, float(theirs)))
    return out


# ---------------------------------------------------------------- processes
def parse_pmon(text: str) -> dict[int, tuple[float | None, float | None]]:
    """``nvidia-smi pmon -c 1 -s u`` -> pid -> (sm %, mem %), by the header's column names."""
    header: list[str] = []
    out: dict[int, tuple[float | None, float | None]] = {}
    for line in text.splitlines():
        if line.startswith("# gpu"):
            header = line[1:].split()
            continue
        if line.startswith("#") or not header:
            continue
        cells = dict(zip(header, line.split()))
        pid = cells.get("pid", "-")
        if pid.isdigit():
            out[int(pid)] = (_number(cells.get("sm", "-")), _number(cells.get("mem", "-")))
    return out


def _number(value: str) -> float | None:
    return float(value) if value.replace(".", "", 1).isdigit() else None


def compare_processes(mine: dict[int, tuple[int | None, int | None]], apps: dict[int, float],
                      pmon: dict[int, tuple[float | None, float | None]]) -> list[dict[str, Any]]:
    """The agent's per-process reads (pid -> (used MiB, SM %)) against ``--query-compute-apps``
    (pid -> used MiB) and ``pmon`` (pid -> (sm %, mem %))."""
    out: list[dict[str, Any]] = []
    for pid in sorted(set(mine) | set(apps)):
        if pid not in mine or pid not in apps:
            out.append(difference("processes", f"pid {pid} listed", pid in mine, pid in apps))
            continue
        used, sm = mine[pid]
        if used is None or abs(used - apps[pid]) > TOLERANCES["process_memory_mib"]:
            out.append(difference("processes", f"pid {pid} used memory MiB", used, apps[pid]))
        theirs_sm = pmon.get(pid, (None, None))[0]
        if theirs_sm is not None and (sm is None or abs(sm - theirs_sm) > TOLERANCES["process_sm_pct"]):
            out.append(difference("processes", f"pid {pid} SM %", sm, theirs_sm))
    return out
