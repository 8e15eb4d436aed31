"""The demo's MPS section: one GPU shared by two pods through CUDA MPS, beside time-slicing.

The real agent runs once more, with ``sharing.mps`` replicas 2 (NVIDIA's config ``v1``), on
a one-GPU simulated machine, its MPS root in the demo's directory and, as its control
program (``--mps-control-binary``), the demo's stand-in for ``nvidia-cuda-mps-control``
(:mod:`agent.demo.mps_control`). The agent starts the control daemon, gives it NVIDIA's
defaults, and registers the replicas with the stand-in kubelet only once the daemon
answers; the section shows what the daemon was told by then (its ``control.log``), the
replicas the kubelet was sent, and what Allocate returns to each of two pods for its replica:
the pipe directory, the ``/dev/shm`` mount and the client limits.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import agent
from agent.config import Config
from agent.config_file import TimeSlicingResource
from agent.demo import mps_control
from agent.demo.node import demo_node
from agent.demo.shared_gpu import DEFAULT_MODEL, PODS, Teller
from agent.errors import AgentError
from agent.formats import GPU_RESOURCE
from agent.hw.sim.catalogue import GPU_MODELS

if TYPE_CHECKING:
    from agent._proto.deviceplugin_v1beta1_pb2 import ContainerAllocateResponse
    from agent.demo.kubelet import KubeletStub

__all__ = ["show_mps"]

REPLICAS = 2
MPS_MACHINE = "mps-gpu"
PROGRAM = "nvidia-cuda-mps-control"


def mps_machine(model: str | None) -> dict[str, Any]:
    """The machine spec: one GPU of ``model`` (when the simulator knows it)."""
    return {
        "name": MPS_MACHINE,
        "description": "one GPU shared between two pods through MPS",
        "driver_version": "550.54.15",
        "gpus": [{"model": model if model in GPU_MODELS else DEFAULT_MODEL,
                  "bus_id": "0000:00:1e.0"}],
    }


def control_program(directory: str) -> str:
    """Write the script ``--mps-control-binary`` names: it runs :mod:`agent.demo.mps_control`
    with this interpreter and this agent's import path (the agent gives a control program no
    other environment)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(agent.__file__)))
    path = os.path.join(directory, PROGRAM)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"#!/bin/sh\nPYTHONPATH={shlex.quote(root)} exec {shlex.quote(sys.executable)}"
                 f" -m {mps_control.__name__} \"$@\"\n")
    os.chmod(path, stat.S_IRWXU)
    return path


def show_mps(
    teller: Teller, base: Config, workdir: str, model: str | None, table: bool
) -> dict[str, Any]:
    """Run the section in ``workdir`` with the demo's settings ``base``; returns its facts."""
    spec = mps_machine(model)
    spec_path = os.path.join(workdir, f"{MPS_MACHINE}.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    config = replace(
        base,
        mps=(TimeSlicingResource(replicas=REPLICAS),),
        fail_requests_greater_than_one=True,  # what a file's sharing.mps gives
        mps_root=os.path.join(workdir, "mps"),
        mps_control_binary=control_program(workdir),
    )
    teller.progress(f"starting the agent again, sharing one GPU {REPLICAS} ways through MPS")
    facts = _serve(config, spec_path)
    facts.update(machine=MPS_MACHINE, model=spec["gpus"][0]["model"], resource=GPU_RESOURCE,
                 replicas=REPLICAS, mps_root=config.mps_root)
    if table:
        _show(teller, facts)
    return facts


def _serve(config: Config, spec_path: str) -> dict[str, Any]:
    """Run the agent with the stand-ins until each pod has its Allocate answer."""
    with demo_node(config, spec_path) as node:  # the pod-resources stand-in lists no pods here
        told = _registered(node.kubelet, os.path.join(config.mps_root, GPU_RESOURCE, "log"))
        latest = node.kubelet.latest(GPU_RESOURCE)
        assert latest is not None  # _registered saw it
        client = node.client(node.kubelet.registered(GPU_RESOURCE)[0].request.endpoint)
        free = [d.ID for d in latest.devices]
        pods = []
        for p in PODS:
            chosen = client.preferred(free, [], 1)
            response = client.start_containers(chosen).container_responses[0]
            free.remove(chosen[0])
            pods.append({"namespace": p.namespace, "pod": p.pod, "container": p.container,
                         "device": chosen[0], **_allocation(response)})
        return {
            "daemon_told": told,
            "devices": len(latest.devices),
            "healthy": sum(d.health == "Healthy" for d in latest.devices),
            "pods": pods,
        }


def _registered(kubelet: KubeletStub, log_dir: str) -> list[dict[str, str]]:
    """Wait for the replicas in ListAndWatch; returns the commands the control daemon had
    answered when the agent registered, read from its ``control.log``."""
    if not kubelet.wait_for(lambda: bool(kubelet.registered(GPU_RESOURCE)), 10.0):
        raise AgentError("the agent did not register the MPS replicas in 10 s")
    told = _control_log(os.path.join(log_dir, mps_control.LOG))

    def advertised() -> bool:
        latest = kubelet.latest(GPU_RESOURCE)
        return latest is not None and len(latest.devices) == REPLICAS

    if not kubelet.wait_for(advertised, 5.0):
        raise AgentError(f"the agent advertised no {REPLICAS} MPS replicas in 5 s")
    return told


def _control_log(path: str) -> list[dict[str, str]]:
    """``control.log``'s commands with their answers, in order."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [line.split("] ", 1)[-1].rstrip("\n") for line in fh]
    except OSError:
        return []
    return [
        {"command": line[len("Cmd:"):], "answer": lines[i + 1] if i + 1 < len(lines) else ""}
        for i, line in enumerate(lines) if line.startswith("Cmd:")
    ]


def _allocation(response: ContainerAllocateResponse) -> dict[str, Any]:
    return {
        "envs": dict(sorted(response.envs.items())),
        "mounts": [{"container_path": m.container_path, "host_path": m.host_path,
                    "read_only": m.read_only} for m in response.mounts],
    }


def _show(teller: Teller, facts: dict[str, Any]) -> None:
    teller.heading("One GPU, two pods: MPS")
    teller.explain(
        f"The agent runs again, with sharing.mps replicas {REPLICAS} (NVIDIA's config v1), on a "
        f"one-GPU machine ({facts['model']}). It starts the MPS control daemon (here the demo's "
        "stand-in for nvidia-cuda-mps-control, which speaks its command protocol), gives it "
        "NVIDIA's defaults (each replica 1/replicas of the threads and of the memory), and "
        "registers the replicas with the kubelet only once the daemon answers."
    )
    teller.say()
    teller.say("the control daemon had answered, when the agent registered:")
    for c in facts["daemon_told"]:
        teller.say(f"  {c['command']}" + (f" -> {c['answer']}" if c["answer"] else ""))
    teller.say(f"ListAndWatch: {facts['devices']} {facts['resource']} devices, "
               f"{facts['healthy']} healthy")
    teller.say()
    root = facts["mps_root"]
    for p in facts["pods"]:
        teller.say(f"  {p['namespace']}/{p['pod']:<10} container {p['container']:<8} "
                   f"got {p['device']}")
    first = facts["pods"][0]
    teller.say()
    teller.say(f"Allocate for {first['pod']}'s replica returns, besides NVIDIA_VISIBLE_DEVICES and "
               "GPU_TOPOLOGY_*:")
    for key, value in first["envs"].items():
        if key.startswith("CUDA_MPS_"):
            teller.say(f"  {key}={value}")
    for m in first["mounts"]:
        host = m["host_path"].replace(root, "<mpsRoot>", 1)
        teller.say(f"  mount {m['container_path']} from {host}")
    teller.say()
    teller.explain(
        "CUDA in the pod finds the daemon through the pipe directory, shares memory with the "
        "MPS server through /dev/shm, and keeps to its share of the threads and memory; with "
        "time-slicing (above) a pod gets the whole GPU in turns and no limits."
    )
