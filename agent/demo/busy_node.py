"""The busy node of the demo: a seeded trace of pods arriving and leaving, played against the
agent over gRPC (GetPreferredAllocation, then Allocate) as the kubelet would, with the
go-gpuallocator's and a naive choice on the same free GPUs scored beside each answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from agent.demo.comparisons import GpuallocatorChoice, naive_choice
from agent.formats import format_cpulist
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent._proto.deviceplugin_v1beta1_pb2 import Device
    from agent.demo.kubelet import PluginClient


@dataclass(frozen=True)
class Step:
    """One event of the busy node: a pod arriving (``size`` GPUs) or leaving."""

    kind: str  # "arrive" | "leave"
    pod: str
    size: int = 0


def busy_node_trace(gpu_count: int, seed: int = 5, arrivals: int = 12) -> list[Step]:
    """A seeded sequence of pods of mixed sizes arriving and leaving. Sizes are 1, 2, 4
    and 8 GPUs (those that fit the node), small ones more often."""
    rng = random.Random(seed)
    sizes = [s for s in (1, 2, 4, 8) if s <= gpu_count] or [1]
    weights = (3, 3, 2, 1)[: len(sizes)]
    kinds = {1: "infer", 2: "finetune", 4: "train", 8: "train"}
    steps: list[Step] = []
    running: list[str] = []
    count = 0
    while count < arrivals:
        if len(running) >= 2 and rng.random() < 0.4:
            pod = running.pop(rng.randrange(len(running)))
            steps.append(Step("leave", pod))
            continue
        size = rng.choices(sizes, weights)[0]
        count += 1
        pod = f"{kinds[size]}-{count}"
        running.append(pod)
        steps.append(Step("arrive", pod, size))
    return steps


class BusyNode:
    """The node's state while the trace plays: free device IDs, running pods, one row of
    facts per event. ``say`` (None: no table) prints each event's line."""

    def __init__(
        self,
        topology: Topology,
        devices: list[Device],
        client: PluginClient,
        say: Callable[[str], None] | None,
        progress: Callable[[str], None],
    ) -> None:
        self.topology = topology
        self.client = client
        self.say = say
        self.progress = progress
        self.gpuallocator = GpuallocatorChoice(topology)
        self.index_of = {g.uuid: g.index for g in topology.gpus}
        self.id_of = {g.index: g.uuid for g in topology.gpus}
        self.free = [d.ID for d in devices if d.health == "Healthy"]
        self.running: dict[str, list[str]] = {}
        self.rows: list[dict[str, Any]] = []
        #: Pods that did not fit, in arrival order, with the most GPUs free while they waited.
        self.waiting: dict[str, tuple[Step, int]] = {}

    def play(self, step: Step) -> None:
        if step.kind == "leave" and step.pod in self.waiting:  # deleted before it got its GPUs
            waited, most_free = self.waiting.pop(step.pod)
            self.rows.append(
                {"event": "gives up", "pod": step.pod, "size": waited.size, "most_free": most_free}
            )
            self._line(
                f"- {step.pod:<18}gives up waiting: {n_gpus(waited.size)} asked, "
                f"at most {most_free} were free"
            )
        elif step.kind == "leave":
            ids = self.running.pop(step.pod)
            self.free = sorted(self.free + ids, key=lambda d: self.index_of[d])
            freed = sorted(self.index_of[d] for d in ids)
            self.rows.append({"event": "leave", "pod": step.pod, "freed": freed})
            self._line(f"- {step.pod:<18}frees GPUs {_gpus(freed)}")
            self._retry()
        elif step.size > len(self.free):
            self.waiting[step.pod] = (step, len(self.free))
            self.rows.append({"event": "wait", "pod": step.pod, "size": step.size, "free": len(self.free)})
            self._line(f"+ {step.pod:<18}waits: {n_gpus(step.size)} asked, {len(self.free)} free")
        else:
            self._arrive(step)

    def _retry(self) -> None:
        """GPUs were freed: place the waiting pods that now fit, oldest first, as the kubelet
        admits pending pods once their GPUs are there."""
        for pod, (step, most_free) in list(self.waiting.items()):
            if step.size <= len(self.free):
                del self.waiting[pod]
                self._arrive(step, waited=True)
            else:
                self.waiting[pod] = (step, max(most_free, len(self.free)))

    def still_waiting(self) -> list[dict[str, Any]]:
        """The pods still waiting when the trace ends, each with why: too few GPUs free."""
        return [
            {"pod": pod, "size": step.size, "free": len(self.free)}
            for pod, (step, _) in self.waiting.items()
        ]

    def _arrive(self, step: Step, waited: bool = False) -> None:
        self.progress(f"{step.pod} asks for {step.size} GPU(s)")
        chosen_ids = self.client.preferred(self.free, [], step.size)
        response = self.client.start_containers(chosen_ids)
        ours = sorted(self.index_of[d] for d in chosen_ids)
        free_idx = [self.index_of[d] for d in self.free]
        theirs = self.gpuallocator.choose(free_idx, step.size)
        naive = naive_choice(free_idx, step.size)
        score = self.topology.set_score
        row = {
            "event": "arrive",
            "pod": step.pod,
            "size": step.size,
            "waited": waited,
            "gpus": ours,
            "score": score(ours),
            "numa_nodes": self._numa_count(ours),
            "gpuallocator": {"gpus": theirs, "score": score(theirs), "numa_nodes": self._numa_count(theirs)},
            "naive": {"gpus": naive, "score": score(naive), "numa_nodes": self._numa_count(naive)},
            "visible_devices": response.container_responses[0].envs.get("NVIDIA_VISIBLE_DEVICES", ""),
        }
        self.rows.append(row)
        self.running[step.pod] = [self.id_of[i] for i in ours]
        taken = set(self.running[step.pod])
        self.free = [d for d in self.free if d not in taken]
        self._line(
            f"{'*' if waited else '+'} {step.pod + f' ({step.size})':<18}{_gpus(ours):<18}{row['score']:>7}"
            f"{_or_unknown(row['numa_nodes']):>5}"
            f"{_gpus(theirs):>20}{score(theirs):>7}{_gpus(naive):>16}{score(naive):>7}"
        )

    def _numa_count(self, indices: list[int]) -> int | None:
        nodes = {self.topology.gpus[i].numa_node for i in indices}
        return None if None in nodes else len(nodes)  # unknown: shown as "?"

    def _line(self, text: str) -> None:
        if self.say is not None:
            self.say(text)


def _gpus(indices: list[int]) -> str:
    return format_cpulist(indices)  # "0-3,6": the cpulist notation fits 16 GPUs


def n_gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _or_unknown(value: object) -> str:
    """A fact the input did not give is shown as ``?``, never as a made-up default."""
    return "?" if value is None else str(value)
