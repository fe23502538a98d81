"""Engine benchmark: the raycolo torch engine against plain transformers ``generate()``.

For each tiny model, one seeded request set (random prompt token ids, output lengths
sampled from the model's output-length eCDF) is answered three ways in the same process,
float32 on CPU with a fixed thread count:

* ``hf-sequential``: ``model.generate`` one request at a time;
* ``hf-static-batch``: left-padded static batches of ``--batch-size``; a batch runs until
  its longest request is done, and only the requested tokens count as useful output;
* ``raycolo-torch``: the raycolo torch engine (continuous batching, ``max_num_seqs`` =
  ``--batch-size``) on all requests at once.

Every method generates exactly the sampled number of tokens per request (EOS ignored),
so all of them produce the same useful token count. Times are medians of ``--repeats``
runs after one warm-up. The table gives useful output tokens/s, the tokens each method
computed (padding included), its model forward calls (counted by a hook; prefills and
decode steps alike) and the ratio of raycolo-torch's tokens/s over each method; then
greedy outputs of raycolo-torch are compared token-for-token with hf-sequential on the
first requests. ``--profile`` adds a cProfile of one more raycolo-torch run.

    .venv/bin/python bench/engine.py [--quick] [--models tiny-llama-s,tiny-llama-m]
        [--requests 64] [--batch-size 16] [--max-tokens 256] [--repeats 3] [--threads 2]
        [--profile] [--json out/bench_engine.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from raycolo.catalog import get_model  # noqa: E402
from raycolo.costmodel.sampler import OutputLengthSampler, seeded_rng  # noqa: E402
from raycolo.engines import SamplingParams, create_engine  # noqa: E402
from raycolo.engines.models import BOS_ID, BYTE_OFFSET, PAD_ID, build_tiny_model  # noqa: E402
from common import write_json  # noqa: E402

METHODS = ["hf-sequential", "hf-static-batch", "raycolo-torch"]
REFERENCE = "raycolo-torch"
CHECK_REQUESTS = 4


# -- request set -------------------------------------------------------------------------
def build_requests(model_id: str, n: int, max_tokens: int, prompt_min: int, prompt_max: int,
                   seed: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (BOS + random non-special ids) and eCDF-sampled output lengths."""
    spec = get_model(model_id)
    rng = seeded_rng(seed, "bench-engine", model_id)
    prompt_lens = rng.integers(prompt_min, prompt_max + 1, size=n)
    prompts = [[BOS_ID] + [int(t) for t in rng.integers(BYTE_OFFSET, spec.vocab, size=int(p) - 1)]
               for p in prompt_lens]
    lengths = OutputLengthSampler(spec).sample(prompt_lens, max_tokens, rng)
    return prompts, [int(x) for x in lengths]


# -- methods -----------------------------------------------------------------------------
def generation_config(max_new: int):
    """Greedy, exactly ``max_new`` tokens: no EOS (nothing stops or suppresses a token)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                            num_beams=1, eos_token_id=None, pad_token_id=PAD_ID,
                            bos_token_id=BOS_ID, use_cache=True)


@torch.inference_mode()
def hf_sequential(model, prompts, lengths, batch_size):
    outs = []
    for prompt, length in zip(prompts, lengths):
        ids = torch.tensor([prompt])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=generation_config(length))
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs, sum(lengths)


@torch.inference_mode()
def hf_static_batch(model, prompts, lengths, batch_size):
    """Left-padded batches in request order; returns outputs and tokens actually computed."""
    outs, generated = [], 0
    for start in range(0, len(prompts), batch_size):
        batch, want = prompts[start:start + batch_size], lengths[start:start + batch_size]
        width, longest = max(len(p) for p in batch), max(want)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=generation_config(longest))
        generated += len(batch) * longest
        outs.extend(gen[i, width:width + w].tolist() for i, w in enumerate(want))
    return outs, generated


def raycolo_torch(engine, prompts, lengths, batch_size):
    params = [SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True) for length in lengths]
    results = engine.generate(prompts, params)
    return [list(r.token_ids) for r in results], sum(len(r.token_ids) for r in results)


def make_engine(model_id, batch_size, kv_tokens, threads):
    return create_engine({
        "backend": "torch",
        "model_loading_config": {"model_id": model_id, "seed": 0, "dtype": "float32"},
        "engine_kwargs": {"max_num_seqs": batch_size, "kv_cache_tokens": kv_tokens,
                          "device": "cpu", "cpu_threads": threads},
    })


# -- one model ---------------------------------------------------------------------------
def compare(a: list[int], b: list[int]) -> tuple[int, int | None]:
    """(positions equal, first differing position or None)."""
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return same, first


def run_model(model_id, args):
    prompts, lengths = build_requests(model_id, args.requests, args.max_tokens, args.prompt_min,
                                      args.prompt_max, args.seed)
    useful = sum(lengths)
    kv_tokens = max(65536, 2 * args.batch_size * (args.prompt_max + args.max_tokens))
    hf_model, _ = build_tiny_model(model_id, seed=0, dtype="float32")
    # GenerationConfig fields left None fall back to the model's own generation config, so
    # EOS must be cleared there too, or generate() stops at (or, with min_new_tokens,
    # suppresses) EOS where the engine with ignore_eos emits it.
    hf_model.generation_config.eos_token_id = None
    engine = make_engine(model_id, args.batch_size, kv_tokens, args.threads)
    torch.set_num_threads(args.threads)
    runners = {
        "hf-sequential": lambda p, l: hf_sequential(hf_model, p, l, args.batch_size),
        "hf-static-batch": lambda p, l: hf_static_batch(hf_model, p, l, args.batch_size),
        "raycolo-torch": lambda p, l: raycolo_torch(engine, p, l, args.batch_size),
    }
    calls = [0]  # model forward calls (prefills and decode steps alike)

    def count_call(*_):
        calls[0] += 1

    hf_model.register_forward_pre_hook(count_call)
    engine.model.register_forward_pre_hook(count_call)
    rows, outputs = {}, {}
    warm = min(2, len(prompts))
    for name in METHODS:
        run = runners[name]
        run(prompts[:warm], [min(8, x) for x in lengths[:warm]])  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            calls[0] = 0
            outs, generated = run(prompts, lengths)
            forwards = calls[0]
            times.append(time.perf_counter() - started)
        bad = [i for i, (o, want) in enumerate(zip(outs, lengths)) if len(o) != want]
        if bad:
            raise SystemExit(f"{model_id} {name}: request {bad[0]} produced {len(outs[bad[0]])} "
                             f"tokens, expected {lengths[bad[0]]}")
        seconds = statistics.median(times)
        rows[name] = {"median_s": seconds, "times_s": times, "useful_tokens": useful,
                      "generated_tokens": generated, "forwards": forwards,
                      "tokens_per_s": useful / seconds}
        outputs[name] = outs
        sys.stdout.flush()
    ref = rows[REFERENCE]["tokens_per_s"]
    for r in rows.values():
        r["raycolo_ratio"] = ref / r["tokens_per_s"]

    checks = []
    for i in range(min(CHECK_REQUESTS, len(prompts))):
        same, first = compare(outputs["raycolo-torch"][i], outputs["hf-sequential"][i])
        same_static, first_static = compare(outputs["hf-static-batch"][i], outputs["hf-sequential"][i])
        checks.append({"request": i, "tokens": lengths[i], "raycolo_equal": same,
                       "raycolo_first_diff": first, "static_equal": same_static,
                       "static_first_diff": first_static})

    profile = None
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        raycolo_torch(engine, prompts, lengths, args.batch_size)
        profiler.disable()
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats("tottime").print_stats(args.profile_top)
        stats.sort_stats("cumulative").print_stats(args.profile_top)
        profile = buf.getvalue()
        if args.profile_dump:
            Path(args.profile_dump).parent.mkdir(parents=True, exist_ok=True)
            stats.dump_stats(f"{args.profile_dump}.{model_id}.prof")

    iters = engine.stats.iterations
    engine.release()
    info = {"requests": len(prompts), "useful_tokens": useful,
            "output_len_mean": float(np.mean(lengths)), "output_len_max": int(max(lengths)),
            "prompt_len_mean": float(np.mean([len(p) for p in prompts])),
            "engine_iterations": len(iters)}
    return {"info": info, "rows": rows, "checks": checks, "profile": profile}


def print_model(model_id, result, args, file=sys.stdout):
    info = result["info"]
    print(f"\n### {model_id}  ({info['requests']} requests, {info['useful_tokens']} output tokens, "
          f"output len mean {info['output_len_mean']:.1f} max {info['output_len_max']}, "
          f"prompt len mean {info['prompt_len_mean']:.1f}, batch {args.batch_size})", file=file)
    print("| method | median s | useful tok/s | tokens computed | model forwards | ms/forward "
          "| raycolo-torch speedup |", file=file)
    print("|---|---:|---:|---:|---:|---:|---:|", file=file)
    for name, r in result["rows"].items():
        print(f"| {name} | {r['median_s']:.2f} | {r['tokens_per_s']:.0f} | {r['generated_tokens']} "
              f"| {r['forwards']} | {1e3 * r['median_s'] / r['forwards']:.2f} "
              f"| {r['raycolo_ratio']:.2f}x |", file=file)
    print(f"\ngreedy outputs vs hf-sequential (first {len(result['checks'])} requests):", file=file)
    for c in result["checks"]:
        def say(equal, first):
            return "identical" if first is None else f"{equal}/{c['tokens']} equal, first diff at {first}"
        print(f"- request {c['request']} ({c['tokens']} tokens): raycolo-torch "
              f"{say(c['raycolo_equal'], c['raycolo_first_diff'])}; hf-static-batch "
              f"{say(c['static_equal'], c['static_first_diff'])}", file=file)
    exact = sum(c["raycolo_first_diff"] is None for c in result["checks"])
    print(f"raycolo-torch matched hf-sequential exactly on {exact}/{len(result['checks'])} requests",
          file=file)
    if result["profile"]:
        print(f"\ncProfile of one raycolo-torch run:\n```\n{result['profile']}```", file=file)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-llama-s,tiny-llama-m", help="comma-separated tiny models")
    ap.add_argument("--requests", type=int, default=None, help="requests per model (default 64)")
    ap.add_argument("--batch-size", type=int, default=16, help="static batch size and max_num_seqs")
    ap.add_argument("--max-tokens", type=int, default=None, help="output length cap (default 256, the tiny eCDFs' own maximum)")
    ap.add_argument("--prompt-min", type=int, default=8, help="shortest prompt in tokens")
    ap.add_argument("--prompt-max", type=int, default=96, help="longest prompt in tokens")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per method (median; default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="16 requests, max 48 tokens, 1 repeat (unless given explicitly)")
    ap.add_argument("--profile", action="store_true", help="cProfile one extra raycolo-torch run")
    ap.add_argument("--profile-top", type=int, default=25, help="functions listed per profile sort")
    ap.add_argument("--profile-dump", default=None, help="also dump pstats to PREFIX.<model>.prof")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    quick = {"requests": 16, "max_tokens": 48, "repeats": 1}
    full = {"requests": 64, "max_tokens": 256, "repeats": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.prompt_min < 2 or args.prompt_max < args.prompt_min:
        ap.error("need 2 <= --prompt-min <= --prompt-max")

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    print(f"Engine benchmark: torch {torch.__version__}, float32 CPU, {args.threads} threads, "
          f"{args.requests} requests/model, max {args.max_tokens} output tokens, batch {args.batch_size}, "
          f"median of {args.repeats}; speedup = raycolo-torch tok/s / method tok/s; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    report = {"config": dict(vars(args)), "models": {}}
    for model_id in [m.strip() for m in args.models.split(",") if m.strip()]:
        result = run_model(model_id, args)
        report["models"][model_id] = result
        print_model(model_id, result, args)
        sys.stdout.flush()
    wall = time.perf_counter() - started
    report["wall_s"] = wall
    report["load_average_end"] = os.getloadavg()[0]
    print(f"\nbenchmark wall time {wall:.0f}s (load average {os.getloadavg()[0]:.1f} at end; "
          "timings are only comparable on an otherwise idle machine)")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
