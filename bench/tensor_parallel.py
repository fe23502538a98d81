"""The torch engine at tensor-parallel degree 1 and 2 (and more with ``--tp``) on the same
model and requests: output tokens/s, the ratio to tp=1, and whether the greedy tokens are
equal. Every run has the same CPU threads in all (``--threads``, split evenly across the
ranks), so on a CPU the comparison is the cost of the split itself: the all-reduces over
gloo and the per-step broadcast to the other ranks. On GPUs each rank has its own device.

    python bench/tensor_parallel.py [--model tiny-llama-xl] [--requests 1,16] [--tokens 64]
        [--tp 1,2] [--threads 2] [--repeats 3] [--device cpu] [--json out/bench_tp.json]

The table prints the machine, the date and the command with the medians.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

from common import write_json


def run(model_id: str, tp: int, threads: int, device: str, prompts, tokens: int, repeats: int):
    from raycolo.engine.base import SamplingParams
    from raycolo.engine.factory import create_engine

    engine = create_engine({"model_loading_config": {"model_id": model_id, "dtype": "float32"},
                            "engine_kwargs": {"device": device, "max_num_seqs": max(64, len(prompts)),
                                              "kv_cache_tokens": 1 << 16, "tensor_parallel_size": tp,
                                              "cpu_threads": max(1, threads // tp)}})
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        engine.generate(prompts, params)                  # warm-up
        times, outs = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            times.append(time.perf_counter() - started)
        return times, [o.token_ids for o in outs]
    finally:
        engine.release()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama-xl")
    parser.add_argument("--requests", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    import torch

    from raycolo.engine.models import BOS_ID, BYTE_OFFSET

    tps = [int(t) for t in args.tp.split(",")]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in (int(r) for r in args.requests.split(",")):
        prompts = [[BOS_ID] + torch.randint(BYTE_OFFSET, BYTE_OFFSET + 256, (args.prompt - 1,), generator=gen).tolist()
                   for _ in range(n)]
        base_tokens, base_tps = None, None
        for tp in tps:
            times, tokens = run(args.model, tp, args.threads, args.device, prompts, args.tokens, args.repeats)
            tok_s = n * args.tokens / statistics.median(times)
            if base_tokens is None:
                base_tokens, base_tps = tokens, tok_s
            rows.append({"requests": n, "tp": tp, "tok_s": tok_s, "ratio": tok_s / base_tps,
                         "spread_s": max(times) - min(times), "tokens_equal": tokens == base_tokens})
            print(f"  {n} requests, tp={tp}: {tok_s:,.0f} tok/s", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    print(f"\n{platform.node()} ({args.device}, {args.threads} threads in all), {stamp}, "
          f"`python bench/tensor_parallel.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"| model | requests | tp | output tok/s (median of {args.repeats}) | vs tp=1 | tokens equal tp=1 |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {args.model} | {r['requests']} | {r['tp']} | {r['tok_s']:,.0f} | {r['ratio']:.2f}x | "
              f"{'yes' if r['tokens_equal'] else 'no'} |")
    if args.json:
        write_json(args.json, {"args": vars(args), "date": stamp, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
