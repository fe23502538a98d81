"""Live time between tokens against the executor's own step, for the same stage split, in one run.

Issue 27's yardstick for the data plane: at batch 1 and at batch 16, the live deployment's
time between tokens should be at most 1.3x what the model itself takes per decode
iteration through the same stages. This prints both, side by side:

* **executor step**: in this process, the same checkpoint (seed, dtype, LoRA) cut into the
  same ``StageModel`` slices (``layer_bounds``), B requests prefilled, then decode
  iterations through every stage in turn with the hidden states handed over in memory
  and the last stage's greedy sampling: the median seconds per iteration (no transport, no
  scheduling: the floor a node loop could reach);
* **live TBT**: a deployment of 1 node x S stages (``--config`` with training off) replays
  B inference tasks that all arrive at once (prompts of ``--prompt-len``, ``--tokens``
  tokens each, EOS ignored); the run's TBT p50 as the controller records it (the HTTP
  stream adds its hop on top). ``--repeats`` runs per batch, median. One deployment per
  ``--data-planes`` entry, one after the other: ``controller`` (every op an actor call
  through the controller) and ``node`` (the node's loop on its stage 0; TBT from the times
  the node's reports carry).

    .venv/bin/python bench/live_tbt.py [--stages 2] [--batches 1,16] [--tokens 48] [--data-planes controller,node]
                                       [--json out/bench_live_tbt.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import write_json  # noqa: E402


def executor_step(config, batch: int, prompt_len: int, steps: int) -> float:
    """Median seconds of one decode iteration through every stage slice, in process."""
    import torch

    from raycolo.engine.models import load_model
    from raycolo.engine.threads import apply_thread_policy
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora
    from raycolo.generation.sampler import sample_plain
    from raycolo.online.config import layer_bounds

    cfg = config
    apply_thread_policy(cfg.stage.cpu_threads)
    def model():      # each stage its own copy, as each stage worker loads one (a StageModel trims it)
        m, _ = load_model(cfg.model_loading_config.model_id, seed=cfg.model_loading_config.seed,
                          dtype=cfg.model_loading_config.dtype, device="cpu")
        return add_lora(m, LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                                        target_modules=tuple(cfg.lora.target_modules), lr=cfg.lora.lr))

    first = model()
    bounds = layer_bounds(first.config.num_hidden_layers, cfg.stages)
    blocks = -(-cfg.stage.kv_cache_tokens // cfg.stage.block_size)
    stages = [StageModel(first if s == 0 else model(), (bounds[s], bounds[s + 1]), blocks, cfg.stage.block_size,
                         lr=cfg.lora.lr) for s in range(cfg.stages)]
    reqs = list(range(batch))
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(4, 200, (prompt_len,), generator=gen)] for _ in reqs]

    def iteration(tokens):
        hidden = None
        for s, stage in enumerate(stages):
            ids = tokens if s == 0 else [[0] * len(t) for t in tokens]
            hidden = stage.forward(reqs, ids, hidden)
        return sample_plain(hidden).tokens

    with torch.no_grad():
        last = iteration(prompts)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            last = iteration([[t] for t in last])
            times.append(time.perf_counter() - started)
    return statistics.median(times[steps // 5:])


def live_tbt(dep, batch: int, prompt_len: int, tokens: int, repeats: int) -> tuple[float, float]:
    """(median TBT p50, median TBT p99) over ``repeats`` runs of ``batch`` simultaneous requests."""
    from raycolo.online.tasks import OnlineTask

    p50, p99 = [], []
    for r in range(repeats):
        tasks = [OnlineTask(10_000 * (r + 1) + i, "inference", 0.0, prompt_len, 1, tokens, tokens)
                 for i in range(batch)]
        summary = dep.replay(tasks, seed=r).summary()
        p50.append(summary["tbt_p50_s"])
        p99.append(summary["tbt_p99_s"])
    return statistics.median(p50), statistics.median(p99)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "online.yaml"))
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="executor iterations timed per batch")
    ap.add_argument("--data-planes", default="controller,node")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from raycolo.actors.online.launch import OnlineDeployment
    from raycolo.online.config import load_online_config

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    work = Path(tempfile.mkdtemp(prefix="raycolo-live-tbt-"))
    base = load_online_config(args.config)
    config = base.model_copy(update={"nodes": 1, "stages": args.stages, "train_rate": 0.0, "resume": False,
                                     "sample_store": str(work / "samples"),
                                     "storage_path": str(work / "checkpoints")})
    floor = {b: executor_step(config, b, args.prompt_len, args.steps) for b in batches}
    live, stats = {}, {}
    for plane in [p.strip() for p in args.data_planes.split(",") if p.strip()]:
        dep = OnlineDeployment.start(config.model_copy(
            update={"stage": config.stage.model_copy(update={"data_plane": plane})}))
        try:
            live_tbt(dep, 4, args.prompt_len, 8, 1)                     # warm-up
            live[plane] = {b: live_tbt(dep, b, args.prompt_len, args.tokens, args.repeats) for b in batches}
            stats[plane] = dep.stats()
        finally:
            dep.stop()
    model = config.model_loading_config.model_id
    print(f"Live TBT against the executor's own step: {model}, 1 node x {args.stages} stages "
          f"({config.stage.backend}, {config.stage.cpu_threads} thread(s) per stage), prompts of "
          f"{args.prompt_len}, {args.tokens} tokens, {args.repeats} runs per batch (medians)\n")
    print("| data plane | batch | executor step, all stages (ms) | live TBT p50 (ms) | live TBT p99 (ms) "
          "| live / executor |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for plane, by_batch in live.items():
        for b in batches:
            (p50, p99), step = by_batch[b], floor[b]
            rows.append({"data_plane": plane, "batch": b, "executor_step_s": step, "live_tbt_p50_s": p50,
                         "live_tbt_p99_s": p99, "ratio": p50 / step})
            print(f"| {plane} | {b} | {step * 1e3:.2f} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | {p50 / step:.2f}x |")
    print("\ntarget: live / executor <= 1.3 (issue 27). Controller calls per decode iteration "
          "(node: reports and command polls):")
    for plane, st in stats.items():
        print(f"  {plane}: {st['hops_per_decode_iteration']:.2f}")
    if args.json:
        write_json(args.json, {"rows": rows, "stages": args.stages, "model": model,
                               "hops_per_decode_iteration": {p: st["hops_per_decode_iteration"]
                                                             for p, st in stats.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
