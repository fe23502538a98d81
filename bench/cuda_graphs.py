"""The torch engine with and without CUDA graphs (``engine_kwargs.cuda_graphs``).

For each request count (``--requests``, default 1 and 64), prompts of 64 tokens (BOS, then
random byte ids, seed 0) and ``--tokens`` (128) greedy output tokens each, EOS ignored: the
engine is built with graphs off, then on; one warm-up run (graphs are captured there), then
``--repeats`` (3) timed runs; the median's output tokens/s, the ratio, and whether the
greedy tokens are equal both ways (``max_num_seqs`` 64, ``kv_cache_tokens`` 16384). For one
request, the model's own cost beside them: transformers' ``generate()`` on the same model,
device and prompt (greedy, EOS ignored, its default dynamic cache), and whether its tokens
equal the engine's. Needs
a CUDA device; ``--device cpu`` is a dry run of the script (the CPU never uses graphs, so
both runs are eager there).

    python bench/cuda_graphs.py [--model tiny-llama-xl] [--requests 1,64] [--tokens 128]

README ("On a GPU machine"): tiny-llama-xl float32 on an H100, 1 request 141 -> 876
tok/s (6.2x), 64 requests 3,917 -> 26,330 tok/s (6.7x), tokens equal; on an H200
(with the generate() line): 156 -> 889 (5.7x), 4,642 -> 23,841 (5.1x), generate() 149
tok/s (6.71 ms/token against 1.12 with graphs), tokens equal.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from raycolo.engine.base import SamplingParams
from raycolo.engine.factory import create_engine
from raycolo.engine.models import BOS_ID, BYTE_OFFSET


def run(model_id: str, device: str, prompts, tokens: int, graphs: bool, repeats: int):
    engine = create_engine({"backend": "torch",
                            "model_loading_config": {"model_id": model_id, "dtype": "float32"},
                            "engine_kwargs": {"device": device, "max_num_seqs": 64, "kv_cache_tokens": 16384,
                                              "cuda_graphs": graphs}})
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        engine.generate(prompts, params)                 # warm-up; graphs are captured here
        times, outs = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            times.append(time.perf_counter() - started)
        return statistics.median(times), [o.token_ids for o in outs]
    finally:
        engine.release()


def hf_generate(model_id: str, device: str, prompt, tokens: int, repeats: int):
    """transformers' own generate() for one prompt: (median seconds, token ids)."""
    from transformers import GenerationConfig

    from raycolo.engine.models import build_tiny_model

    model = build_tiny_model(model_id, 0, "float32")[0].to(device).eval()
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                           eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([list(prompt)], device=device)
    mask = torch.ones_like(ids)
    times, out = [], None
    with torch.no_grad():
        for i in range(repeats + 1):                     # the first is a warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=cfg)
            if device == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - started)
    return statistics.median(times), out[0, len(prompt):].tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama-xl")
    parser.add_argument("--requests", default="1,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    rng = random.Random(0)
    print(f"{args.model} float32 on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"{args.tokens} greedy tokens per request, median of {args.repeats}")
    print(f"{'requests':>8} | {'eager tok/s':>11} | {'graphs tok/s':>12} | {'ratio':>5} | tokens equal")
    for n in [int(x) for x in args.requests.split(",")]:
        prompts = [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(63)]
                   for _ in range(n)]
        eager, eager_toks = run(args.model, args.device, prompts, args.tokens, False, args.repeats)
        graphs, graph_toks = run(args.model, args.device, prompts, args.tokens, True, args.repeats)
        useful = n * args.tokens
        print(f"{n:>8} | {useful / eager:>11.0f} | {useful / graphs:>12.0f} | {eager / graphs:>5.2f} | "
              f"{eager_toks == graph_toks}")
        if n == 1:
            hf, hf_toks = hf_generate(args.model, args.device, prompts[0], args.tokens, args.repeats)
            print(f"{'':>8} | transformers generate(), the same request: {useful / hf:.0f} tok/s, "
                  f"{1000 * hf / args.tokens:.2f} ms/token (graphs: {1000 * graphs / args.tokens:.2f}); "
                  f"tokens equal the engine's: {hf_toks == graph_toks[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
