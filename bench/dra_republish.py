"""What a re-publication costs, and how long the pool is unusable meanwhile (issue 25).

    .venv/bin/python bench/dra_republish.py [--claims 30] [--json FILE]

Per node (dgx-h100: 8 GPUs, dgx2: 16, a synthetic 64-GPU node of 8 NVLink islands), the
agent's :class:`agent.dra.publisher.SlicePublisher` publishes through the official client to
the stand-in API server (``tests/testbed/apiserver_stub.py``, HTTP on 127.0.0.1) and follows the
claims prepared in a real :class:`agent.dra.checkpoint.Checkpoint`, as in ``run --mode dra``.
Each round prepares one claim for the first published device of a size (1, 2, 4, 8 GPUs in
turn), waits until the stand-in holds the re-rendered pool (its first device of that size is
the device plugin's next choice), then unprepares it and waits again. Reported:

- devices, consumed counters, slices and JSON bytes published on the empty node;
- ``render_ms``: :func:`agent.dra.slices.render_slices` for an occupancy (the topology's
  policy built once), median;
- ``republish_ms``: from the checkpoint change to the stand-in holding the new pool, median
  and max (the publisher's thread wakes, lists, renders and writes); ``sync_ms``: the
  publisher's own round (list, render, write), median;
- API writes (POST + PUT + DELETE) per claim (prepare and unprepare together);
- the incomplete window: every state the stand-in's slices went through (one per write,
  timestamped as the stand-in stores it) is replayed through the allocator model's
  ``gather_pools`` (``tests/testbed/dra_allocator_model.py``); reported are how many states after the
  first complete one are incomplete or invalid, and for how long in total.

One run's figures on this machine; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.discovery import load_topology  # noqa: E402
from agent.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice  # noqa: E402
from agent.dra.gpusets import SetPolicy  # noqa: E402
from agent.dra.publish_settings import PublishSettings  # noqa: E402
from agent.dra.publisher import SlicePublisher  # noqa: E402
from agent.dra.slices import Occupancy, render_slices  # noqa: E402
from agent.dra.view import DraView  # noqa: E402
from agent.topology.model import Topology  # noqa: E402
from tests.testbed import apiserver_stub  # noqa: E402
from tests.testbed.allocation_support import synthetic_islands_topology  # noqa: E402
from tests.testbed.apiserver_stub import ApiServerStub  # noqa: E402
from tests.testbed.dra_allocator_model import gather_pools  # noqa: E402

NODE = "node-1"


def devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices", [])]


def first_of_size(slices: list[dict[str, Any]], k: int) -> str | None:
    prefix = "gpu-" if k == 1 else f"gpuset-{k}-"
    return next((d["name"] for d in devices(slices) if d["name"].startswith(prefix)
                 and (k > 1 or d["name"][4:].isdigit())), None)


def complete(slices: list[dict[str, Any]]) -> bool:
    pools = gather_pools(slices, NODE)
    return bool(pools) and not pools[0].incomplete and not pools[0].invalid


def timestamped(server: ApiServerStub) -> list[float]:
    """Stamp every event the stand-in records (its write order), as stored."""
    stamps: list[float] = []
    record = server._record

    def stamped(resource: str, kind: str, obj: dict[str, Any]) -> None:
        record(resource, kind, obj)
        stamps.append(time.perf_counter()) if resource == "resourceslices" else None

    server._record = stamped  # type: ignore[method-assign]
    return stamps


def unusable(server: ApiServerStub, stamps: list[float]) -> tuple[int, float]:
    """States after the first complete pool that are incomplete or invalid: count, seconds."""
    history = server.slice_history()
    states, seconds, complete_seen = 0, 0.0, False
    for i, state in enumerate(history):
        pools = gather_pools(state, NODE)
        bad = not pools or pools[0].incomplete or bool(pools[0].invalid)
        if not bad:
            complete_seen = True
        elif complete_seen:
            states += 1
            seconds += (stamps[i + 1] if i + 1 < len(stamps) else stamps[i]) - stamps[i]
    return states, seconds


def run(name: str, topology: Topology, claims: int) -> dict[str, Any]:
    # as bench_dra.py: the stand-in sends headers and body apart; without TCP_NODELAY each
    # answer waits for a delayed ACK (~40 ms), which no real API server costs
    apiserver_stub._Handler.disable_nagle_algorithm = True
    policy = SetPolicy(topology)
    empty = render_slices(topology, node_name=NODE, policy=policy)
    held = Occupancy({f"gpu-{i}": (i,) for i in range(0, topology.gpu_count, 3)})
    render = []
    for _ in range(20):
        t0 = time.perf_counter()
        render_slices(topology, node_name=NODE, policy=policy, occupancy=held)
        render.append((time.perf_counter() - t0) * 1e3)
    row: dict[str, Any] = {
        "node": name, "gpus": topology.gpu_count, "slices": len(empty), "devices": len(devices(empty)),
        "counters_consumed": sum(len(c["counters"]) for d in devices(empty) for c in d.get("consumesCounters", [])),
        "bytes": len(json.dumps(empty)), "render_ms": round(statistics.median(render), 2),
    }
    with tempfile.TemporaryDirectory(prefix="republish") as tmp, ApiServerStub() as server:
        server.add_node(NODE)
        stamps = timestamped(server)
        checkpoint = Checkpoint(os.path.join(tmp, "claims"), fsync=False)
        syncs: list[float] = []
        pub = SlicePublisher(server.api_client, DraView(topology), PublishSettings(NODE, backoff_initial_s=0.05),
                             prepared=checkpoint)
        sync = pub._sync

        def timed_sync() -> None:
            t0 = time.perf_counter()
            sync()
            syncs.append((time.perf_counter() - t0) * 1e3)

        pub._sync = timed_sync  # type: ignore[method-assign]
        pub.start()
        try:
            assert server.wait_for(lambda s: len(s) == len(empty), 30)
            writes0 = server.count("POST") + server.count("PUT") + server.count("DELETE")
            times = []
            for i in range(claims):
                k = [1, 2, 4, 8][i % 4]
                before = server.slices()
                device = first_of_size(before, k)
                assert device is not None, (name, k)
                claim = PreparedClaim(f"uid-{i}", "default", f"c{i}", (PreparedDevice("gpus", NODE, device, ("x",)),),
                                      os.path.join(tmp, f"spec-{i}.json"))
                for change in (lambda c=claim: checkpoint.add(c), lambda c=claim: checkpoint.remove(c.uid)):
                    t0 = time.perf_counter()
                    seen = server.count("PUT") + server.count("POST")
                    change()
                    assert server.wait_for(lambda s, n=seen: server.count("PUT") + server.count("POST") > n
                                           and complete(s), 10), name
                    times.append((time.perf_counter() - t0) * 1e3)
                    quiet = -1
                    while quiet != server.count("PUT") + server.count("POST"):  # the publisher done
                        quiet = server.count("PUT") + server.count("POST")
                        time.sleep(0.1)
            writes = server.count("POST") + server.count("PUT") + server.count("DELETE") - writes0
        finally:
            pub.stop()
        states, seconds = unusable(server, stamps)
    row |= {"republish_ms_p50": round(statistics.median(times), 1), "republish_ms_max": round(max(times), 1),
            "sync_ms_p50": round(statistics.median(syncs), 1),
            "writes_per_claim": round(writes / claims, 2), "unusable_states": states,
            "unusable_ms_total": round(seconds * 1e3, 2), "claims": claims}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--claims", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    nodes = [("dgx-h100", load_topology("dgx-h100")), ("dgx2", load_topology("dgx2")),
             ("synthetic-64", synthetic_islands_topology(8, 8))]
    rows = [run(name, topology, args.claims) for name, topology in nodes]
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
