"""How to move one pipeline step between stage processes: the transports, measured.

A decode iteration of an S-stage node moves the batch's hidden states from stage to stage
and the sampled tokens back to whoever schedules the next iteration. This measures, on
this machine, the round trip of one such step through two stage processes (stage 0 ->
stage 1 -> back), for a hidden-state payload of ``batch x hidden`` float32:

* ``actor calls``: ``stage1.step.remote(stage0.step.remote(x))`` and ``ray.get`` from the
  driver: what a central loop pays per hop (today's live runtime: one controller call
  per op and stage, docs/online-live.md);
* ``compiled graph``: the same two actors as a Ray Compiled Graph
  (``ray.dag``, ``experimental_compile``): shared-memory channels, no task submission per
  step (what vLLM's Ray executor uses for pipeline parallelism);
* ``gloo p2p``: ``torch.distributed`` send/recv between the two processes (the stage
  workers' own process group), the round trip timed inside stage 0: a node loop living in
  stage 0 that ships the op header with the tensor pays this;
* ``in process``: the same copies in one process (the floor).

Each figure is the median over ``--steps`` steps after ``--warmup``, in microseconds,
with the ratio to the in-process floor. Loopback only (Ray pinned to 127.0.0.1).

    .venv/bin/python bench/data_plane.py [--steps 2000] [--batches 1,16] [--hidden 4096]
        [--json out/bench_data_plane.json]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from common import write_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
class Stage:
    """One stage process: adds one to the hidden states (the stand-in for its layers)."""

    def __init__(self, rank: int):
        import torch

        torch.set_num_threads(1)
        self.rank = rank

    def step(self, x):
        return x + 1

    # -- torch.distributed between the two stage actors -------------------------------------
    def init_gloo(self, port: int) -> bool:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=2)
        return True

    def gloo_pingpong(self, batch: int, hidden: int, steps: int, warmup: int) -> list[float]:
        """Stage 0 sends, stage 1 adds one and sends back; stage 0 times each round trip."""
        import torch
        import torch.distributed as dist

        x = torch.zeros(batch, hidden)
        buf = torch.empty_like(x)
        times = []
        for i in range(steps + warmup):
            if self.rank == 0:
                t = time.perf_counter()
                dist.send(x, 1)
                dist.recv(buf, 1)
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            else:
                dist.recv(buf, 0)
                dist.send(buf + 1, 0)
        return times


def median_us(times) -> float:
    return statistics.median(times) * 1e6


def measure(batch: int, hidden: int, steps: int, warmup: int, stages) -> dict:
    import torch

    from ray.dag import InputNode

    torch.set_num_threads(1)
    x = torch.zeros(batch, hidden)
    a, b = stages
    out = {}

    times = []
    for i in range(steps + warmup):
        t = time.perf_counter()
        y = (x + 1) + 1
        y.clone()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    out["in process"] = median_us(times)

    times = []
    for i in range(steps + warmup):
        t = time.perf_counter()
        ray.get(b.step.remote(a.step.remote(x)), timeout=60)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    out["actor calls"] = median_us(times)

    with InputNode() as inp:
        dag = b.step.bind(a.step.bind(inp))
    compiled = dag.experimental_compile(_buffer_size_bytes=max(1 << 20, 4 * batch * hidden * 2))
    try:
        times = []
        for i in range(steps + warmup):
            t = time.perf_counter()
            ray.get(compiled.execute(x), timeout=60)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        out["compiled graph"] = median_us(times)
    finally:
        compiled.teardown()

    got = ray.get([s.gloo_pingpong.remote(batch, hidden, steps, warmup) for s in stages], timeout=600)
    out["gloo p2p"] = median_us(got[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size (4096: a 7-8B model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from raycolo.actors.local_cluster import start_local

    start_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stages = [Stage.remote(r) for r in range(2)]
    port = free_port()
    ray.get([s.init_gloo.remote(port) for s in stages], timeout=120)
    rows = []
    print(f"## Round trip of one pipeline step through 2 stage processes (float32 batch x {args.hidden}; "
          f"median of {args.steps} steps, microseconds)\n")
    print("| batch | payload | in process | gloo p2p | compiled graph | actor calls | "
          "gloo / floor | compiled / floor | actor calls / floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in [int(b) for b in args.batches.split(",")]:
        r = measure(batch, args.hidden, args.steps, args.warmup, stages)
        floor = r["in process"]
        print(f"| {batch} | {batch * args.hidden * 4 / 1024:.0f} KiB | {floor:.0f} | {r['gloo p2p']:.0f} | "
              f"{r['compiled graph']:.0f} | {r['actor calls']:.0f} | {r['gloo p2p'] / floor:.1f} | "
              f"{r['compiled graph'] / floor:.1f} | {r['actor calls'] / floor:.1f} |")
        rows.append({"batch": batch, "hidden": args.hidden, **{k.replace(' ', '_') + "_us": v for k, v in r.items()}})
    if args.json:
        write_json(args.json, {"transport": rows})
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
