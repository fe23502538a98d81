"""The node loop's time between tokens against the model's own decode step.

Issue 27's bar: a node whose scheduler runs next to its stages (raycolo/engine/executor/
node_pipeline.py: the loop in stage 0's process, ops to the other stages over their own
process group, no actor call per op) should put tokens out at about the model's own step
time. This runs, on this machine and in the same run:

* ``executor step``: the whole model as one in-process :class:`StageModel`, ``batch``
  requests prefilled, then the median of its decode steps (the floor);
* ``node loop, S stages``: the same requests through :func:`run_node` (S spawned stage
  processes, gloo; the node's LeMix scheduler deciding every op), the median time between
  a request's tokens (TBT) over every request, and its ratio to the floor.

No Ray. Greedy, ``ignore_eos``, every request ``--tokens`` long.

    .venv/bin/python bench/node_loop.py [--model tiny-llama-xl] [--device cpu|cuda]
        [--batches 1,16] [--stages 1,2] [--tokens 64] [--prompt 64] [--json out/bench_node_loop.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import write_json  # noqa: E402


def prompts(batch: int, length: int, vocab: int = 200) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def executor_step_ms(config: dict, batch: int, prompt: int, steps: int) -> float:
    """The whole model's own decode step (median, ms), in this process."""
    import torch

    from raycolo.online.stages.stage_process import build_stage
    from raycolo.online.config import OnlineConfig, model_hf_config, stage_build

    cfg = OnlineConfig.model_validate(dict(config, stages=1))
    layers = model_hf_config(cfg.model_loading_config.model_id).num_hidden_layers
    stage, _ = build_stage(stage_build(cfg), [0, layers], 0)
    cuda = cfg.stage.device == "cuda"
    rids = list(range(batch))
    ps = prompts(batch, prompt)
    with torch.no_grad():
        out = stage.forward(rids, ps, None)
        toks = [[int(t)] for t in out.argmax(-1).tolist()]
        times = []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = stage.forward(rids, toks, None)
            toks = [[int(t)] for t in out.argmax(-1).tolist()]
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    for r in rids:
        stage.release(r)
    return 1e3 * statistics.median(times[2:])


def node_tbt_ms(config: dict, batch: int, prompt: int, tokens: int) -> tuple[float, float]:
    """(median TBT in ms over every request, wall seconds) through the node loop."""
    from node_harness import NodeRunSpec, RequestSpec, run_node

    spec = NodeRunSpec(config, requests=[RequestSpec(p, tokens, ignore_eos=True) for p in prompts(batch, prompt)])
    t = time.perf_counter()
    res = run_node(spec)
    wall = time.perf_counter() - t
    gaps = [b - a for times in res.token_times.values() for a, b in zip(times[1:], times[2:])]
    assert all(len(v) == tokens for v in res.tokens.values()), "a request stopped short"
    return 1e3 * statistics.median(gaps), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama-xl")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for stages in [int(s) for s in args.stages.split(",")]:
            config = {"model_loading_config": {"model_id": args.model}, "nodes": 1, "stages": stages,
                      "stage": {"device": args.device, "cpu_threads": args.threads}}
            floor = executor_step_ms(config, batch, args.prompt, max(16, args.tokens // 2))
            tbt, wall = node_tbt_ms(config, batch, args.prompt, args.tokens)
            rows.append({"batch": batch, "stages": stages, "executor_step_ms": floor, "node_loop_tbt_ms": tbt,
                         "ratio": tbt / floor, "wall_s": wall})
            print(f"batch {batch:>3} stages {stages}: executor step {floor:7.3f} ms | node loop TBT "
                  f"{tbt:7.3f} ms | {tbt / floor:5.2f}x", flush=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"\n{args.model} on {device}, {args.tokens} tokens per request, prompts of {args.prompt} (medians)")
    print("| batch | stages | executor step (ms) | node loop TBT (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['stages']} | {r['executor_step_ms']:.3f} | {r['node_loop_tbt_ms']:.3f} | "
              f"{r['ratio']:.2f}x |")
    if args.json:
        write_json(args.json, {"model": args.model, "device": device, "rows": rows})


if __name__ == "__main__":
    main()
