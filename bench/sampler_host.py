"""The sampler's host work per decode step with penalties, against the GPU step it must
hide behind.

Every step, the sampler (raycolo/generation/sampler.py) builds its plan on the host: which
rows need which mask, and their ids and parameters, packed into one int64 and one float32
upload. A repetition penalty needs each row's whole prompt and output: built afresh, that
is every id of every row; with the engine's kept history (raycolo/generation/penalty_history.py)
only the ids new since the step before. This times that host work, both ways (building the rows as the torch engine does, then the plan) at
several batches, with Llama-3's vocabulary and long prompts, and prints it beside the
decode step of a Llama-3-8B-shaped model on an H200 from docs/benchmarks.md (a GPU
figure: this CPU has none to measure it on), so the ratio says whether the host work
would be hidden. Medians of ``--repeats``.

    .venv/bin/python bench/sampler_host.py
    .venv/bin/python bench/sampler_host.py --batches 1,64,256 --prompt 2048 --output 256 --json out/sampler_host.json

A measured benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np
import torch

from common import int_list
from raycolo.engine.base import SamplingParams
from raycolo.generation.penalty_history import PenaltyHistory
from raycolo.generation.rows import SamplingRow
from raycolo.generation.sampler import _Plan

VOCAB = 128256          # Llama 3's
# decode steps of the torch engine with CUDA graphs, Llama-3-8B shape, bf16, one H200
# (docs/benchmarks.md, "GPU: real-size models against the roofline", before the kernel work)
H200_STEP_MS = {1: 8.8, 16: 13.3, 64: 27.6, 256: 87.9}
PARAMS = {
    "greedy": SamplingParams(max_tokens=512, temperature=0.0),
    "top-p": SamplingParams(max_tokens=512, temperature=0.8, top_p=0.9),
    "repetition + presence": SamplingParams(max_tokens=512, temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                                            presence_penalty=0.2),
}


def host_ms(params, batch: int, prompt: int, output: int, repeats: int, seed: int) -> tuple[float, float]:
    """Median ms of the host work of a step: with the history built afresh (a request's
    first step, or the sampler without a kept history), and with the engine's kept
    :class:`PenaltyHistory` (one new id per row since the step before)."""
    rng = random.Random(seed)
    # as the torch engine holds them: each prompt converted to int64 once (_Request.prompt_array)
    prompts = [np.asarray([rng.randrange(VOCAB) for _ in range(prompt)], dtype=np.int64) for _ in range(batch)]
    outputs = [[rng.randrange(VOCAB) for _ in range(output)] for _ in range(batch)]

    def step(history):
        t0 = time.perf_counter()
        rows = [SamplingRow.of(params, i, outputs[i], prompts[i], key=i) for i in range(batch)]
        _Plan(rows, VOCAB, torch.device("cpu"), history=history)
        return time.perf_counter() - t0

    afresh = [step(None) for _ in range(repeats)]
    history = PenaltyHistory()
    step(history)                       # the first step builds every row
    kept = []
    for _ in range(repeats):
        for out in outputs:
            out.append(rng.randrange(VOCAB))
        kept.append(step(history))
    return 1000 * statistics.median(afresh), 1000 * statistics.median(kept)


def wire_ms(params, batch: int, prompt: int, output: int, repeats: int, seed: int, as_array: bool) -> float:
    """Median ms to build a step's rows and carry them over a process boundary (pickled
    and unpickled, as the online pipeline sends them to its last stage), the prompts held
    as lists or as the int64 arrays each request converts once (``PromptArray``)."""
    import pickle

    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(prompt)] for _ in range(batch)]
    if as_array:
        prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    outputs = [[rng.randrange(VOCAB) for _ in range(output)] for _ in range(batch)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = [SamplingRow.of(params, i, outputs[i], prompts[i], key=i) for i in range(batch)]
        pickle.loads(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    batches = int_list(args.batches)
    if batches is None:
        print(f"error: --batches: comma-separated integers >= 1, got '{args.batches}'", file=sys.stderr)
        return 2
    if args.prompt < 0 or args.output < 0 or args.repeats < 1:
        print("error: --prompt, --output: at least 0; --repeats: at least 1", file=sys.stderr)
        return 2
    rows = []
    print(f"host work per step, prompt {args.prompt} + output {args.output} tokens, vocabulary {VOCAB}, "
          f"median of {args.repeats}")
    print("| sampling | batch | host ms, history afresh | host ms, history kept | H200 decode step ms "
          "(Llama-3-8B) | kept / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, params in PARAMS.items():
        for b in batches:
            afresh, kept = host_ms(params, b, args.prompt, args.output, args.repeats, args.seed)
            step = H200_STEP_MS.get(b)
            rows.append({"sampling": name, "batch": b, "host_ms": kept, "host_ms_afresh": afresh,
                         "gpu_step_ms": step})
            ratio = f"{kept / step:.2f}" if step else ""
            print(f"| {name} | {b} | {afresh:.2f} | {kept:.2f} | {step or ''} | {ratio} |", flush=True)
    wire = []
    params = PARAMS["repetition + presence"]
    print("\nrows carried to another process (pickled and unpickled), repetition + presence")
    print("| batch | prompts as lists, ms | as int64 arrays, ms |")
    print("|---:|---:|---:|")
    for b in batches:
        lists, arrays = (wire_ms(params, b, args.prompt, args.output, args.repeats, args.seed, a) for a in (False, True))
        wire.append({"batch": b, "lists_ms": lists, "arrays_ms": arrays})
        print(f"| {b} | {lists:.2f} | {arrays:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "wire": wire}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
