"""Decode steps of the executor and of an online stage: fused projections, LoRA, mixed versions.

Three comparisons on one model (default ``tiny-llama-l``, float32, 128-token prompts),
each a median of ``--steps`` decode steps after 5 untimed ones, the two sides of each
comparison run one after the other in this process:

* ``fused``: :class:`ModelExecutor` with q/k/v and gate/up each as one product, against
  ``fuse_projections=False`` (docs/executor.md, "Fused projections");
* ``lora``: the same executor on the model with a peft LoRA (rank 8 on q/k/v/o, B random)
  against the plain model: what serving with an active adapter costs;
* ``versions``: a whole-model :class:`StageModel` whose rows are a third on the latest
  adapter, a third ``@base`` and a third pinned to a saved version: one pass with each
  row's own version (batched LoRA) against one pass per version (docs/serve.md).

    .venv/bin/python bench/stage_lora.py [--model tiny-llama-l] [--batches 1,8,64] [--steps 30]
        [--threads 2] [--json out/stage_lora.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from raycolo.batching.blocks import BlockAllocator
from raycolo.engine.executor import ModelExecutor, SeqChunk
from raycolo.engine.models import build_tiny_model
from raycolo.online.stages.peft_format import export_adapter
from raycolo.online.stages.stage_model import StageModel
from common import write_json
from realsize_models import active_lora, add_active_lora   # bench/: the LoRA the GPU bench serves with

PROMPT = 128
WARMUP = 5


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(batch)]


def executor_step(model, batch: int, steps: int, **kw) -> float:
    """Median seconds of one decode step of ``batch`` sequences through a fresh executor."""
    blocks = batch * (-(-(PROMPT + steps + WARMUP + 1) // 16)) + 1
    ex = ModelExecutor(model, blocks, 16, **kw)
    alloc = BlockAllocator(blocks)
    seqs = prompts(batch, model.config.vocab_size)
    for i in range(batch):
        alloc.allocate(i, blocks // batch)
    out = ex.execute(ex.batch([SeqChunk(p, 0, alloc.tables[i]) for i, p in enumerate(seqs)]))
    times = []
    for _ in range(steps + WARMUP):
        for s, t in zip(seqs, out.argmax(-1).tolist()):
            s.append(t)
        t0 = time.perf_counter()
        out = ex.execute(ex.batch([SeqChunk([s[-1]], len(s) - 1, alloc.tables[i]) for i, s in enumerate(seqs)]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def stage_step(model_id: str, batch: int, steps: int, batched: bool, tmp: Path) -> float:
    """Median seconds of a mixed-version decode step of a whole-model stage."""
    model, _ = build_tiny_model(model_id, 0, "float32")
    layers = model.config.num_hidden_layers
    stage = StageModel(add_active_lora(model, seed=3), (0, layers), batch * 16 + 8, 16, batched_versions=batched)
    version = export_adapter([stage.lora_state()], active_lora(), tmp / f"v-{batch}-{batched}")
    rids = list(range(batch))
    base, pinned = rids[1::3], {r: str(version) for r in rids[2::3]}
    out = stage.forward(rids, prompts(batch, model.config.vocab_size), base=base, pinned=pinned)
    times = []
    for _ in range(steps + WARMUP):
        toks = [[int(t)] for t in out.argmax(-1)]
        t0 = time.perf_counter()
        out = stage.forward(rids, toks, base=base, pinned=pinned)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama-l")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="raycolo-stage-lora-"))
    for b in batches:
        plain, _ = build_tiny_model(args.model, 0, "float32")
        fused = executor_step(plain, b, args.steps)
        unfused = executor_step(build_tiny_model(args.model, 0, "float32")[0], b, args.steps, fuse_projections=False)
        rows.append({"comparison": "fused", "batch": b, "a_ms": 1e3 * fused, "b_ms": 1e3 * unfused})
        lora = add_active_lora(build_tiny_model(args.model, 0, "float32")[0], seed=3)
        with_lora = executor_step(lora.eval(), b, args.steps)
        rows.append({"comparison": "lora", "batch": b, "a_ms": 1e3 * with_lora, "b_ms": 1e3 * fused})
        if b >= 3:
            one = stage_step(args.model, b, args.steps, True, tmp)
            per = stage_step(args.model, b, args.steps, False, tmp)
            rows.append({"comparison": "versions", "batch": b, "a_ms": 1e3 * one, "b_ms": 1e3 * per})
        for r in rows[-3:]:
            if r["batch"] == b:
                print(f"  {r['comparison']:<9} b={b:<4} {r['a_ms']:8.2f} ms vs {r['b_ms']:8.2f} ms", flush=True)
    labels = {"fused": ("fused", "unfused"), "lora": ("with LoRA", "plain"),
              "versions": ("one pass", "a pass per version")}
    print(f"\n{args.model}, float32, {args.threads} threads, median of {args.steps} decode steps, "
          f"`python bench/stage_lora.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print("| comparison | batch | a | ms | b | ms | a / b |")
    print("|---|---:|---|---:|---|---:|---:|")
    for r in rows:
        a, b = labels[r["comparison"]]
        print(f"| {r['comparison']} | {r['batch']} | {a} | {r['a_ms']:.2f} | {b} | {r['b_ms']:.2f} | "
              f"{r['a_ms'] / r['b_ms']:.2f} |")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
