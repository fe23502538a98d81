"""Does ``torch.compile`` pay for the executor's decode steps on this machine?

Steady decode steps of a fixed batch (static shapes: the batch never changes, so one
compiled graph serves every step) through :class:`raycolo.engine.executor.ModelExecutor`, eager
against the same model with its norms and MLPs compiled by inductor (``dynamic=False``;
attention stays eager since its key length grows every step). Prints compile time and
the median step time of each. CUDA graphs are measured only where a GPU is present.

    .venv/bin/python bench/compile_probe.py [--model tiny-llama-l] [--batch 64] [--steps 60] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from raycolo.engine.models import build_tiny_model  # noqa: E402
from raycolo.engine.executor import SeqChunk, create_executor  # noqa: E402
from raycolo.batching.blocks import BlockAllocator  # noqa: E402


def step_times(ex, batch: int, prompt: int, steps: int, block_size: int = 16) -> tuple[list[float], float]:
    alloc = BlockAllocator(ex.cache.num_blocks)
    tables = [alloc.allocate(i, -(-(prompt + steps + 1) // block_size)) for i in range(batch)]
    tokens = [[1] + [3 + (7 * i + j) % 256 for j in range(prompt - 1)] for i in range(batch)]
    started = time.perf_counter()
    ex.execute(ex.batch([SeqChunk(t, 0, tab) for t, tab in zip(tokens, tables)]))
    first = time.perf_counter() - started  # the prefill (and, compiled, the first compile)
    times = []
    for s in range(steps):
        chunks = [SeqChunk([5 + (i + s) % 200], prompt + s, tab) for i, tab in enumerate(tables)]
        started = time.perf_counter()
        ex.execute(ex.batch(chunks))
        times.append(time.perf_counter() - started)
    return times, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama-l")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = build_tiny_model(args.model, 0, "float32")
    blocks = args.batch * (-(-(args.prompt + args.steps + 1) // 16)) + 1
    eager, _ = step_times(create_executor(model, blocks, 16), args.batch, args.prompt, args.steps)
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            getattr(layer, name).compile(dynamic=False)
    started = time.perf_counter()
    compiled, _ = step_times(create_executor(model, blocks, 16), args.batch, args.prompt, 2)
    compile_s = time.perf_counter() - started
    compiled, _ = step_times(create_executor(model, blocks, 16), args.batch, args.prompt, args.steps)
    e, c = statistics.median(eager[5:]), statistics.median(compiled[5:])
    print(f"{args.model}, batch {args.batch}, {args.threads} threads, torch {torch.__version__}")
    print("| variant | median decode step ms | tok/s | compile s |")
    print("|---|---:|---:|---:|")
    print(f"| eager | {1e3 * e:.2f} | {args.batch / e:.0f} | - |")
    print(f"| norms + MLP compiled (inductor) | {1e3 * c:.2f} | {args.batch / c:.0f} | {compile_s:.1f} |")
    print(f"compiled / eager step time: {c / e:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
