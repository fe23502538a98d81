"""vLLM peer for bench/engine.py: one vLLM engine, timed on the request sets it is given.

A standalone script for the vLLM venv (``.venv-vllm``): it imports vllm, torch and the
standard library only, never raycolo (``.venv-vllm`` pins an older transformers than
``.venv``). bench/engine.py writes the checkpoint and the request sets, runs

    .venv-vllm/bin/python bench/vllm_peer.py --model DIR --requests REQ.json \\
        --threads 2 --mode eager|compiled --repeats 3 --out OUT.json

and reads OUT.json back. REQ.json holds ``{"sets": {NAME: {"prompts": [[ids]...],
"lengths": [n...]}}, "steady": {...} or null, "steady_repeats": 3, "check": 4}``.
Every request is greedy, runs exactly its length (``min_tokens`` = ``max_tokens``, EOS
ignored) and is submitted at once in one ``LLM.generate`` call. Start-up
(``vllm.LLM(...)``: model load, KV allocation, compilation in ``compiled`` mode) is timed
separately; then one small warm-up generate, then ``--repeats`` timed generate calls per
set. ``steady`` (optional) runs ``steady_repeats`` times, stepping ``llm_engine`` one
iteration at a time and timing each step, so that the caller can take the steps in which
every request decoded (a steady batch) for a roofline figure.

Settings: float32, ``max_num_seqs`` (default 256), ``seed`` 0, no tokenizer (token ids
in and out), prefix caching off (the timed runs repeat the same prompts; raycolo has no
prefix cache), ``enforce_eager`` in eager mode. Environment (set here unless already
set): ``VLLM_CPU_KVCACHE_SPACE`` (GiB, ``--kv-gib``), ``OMP_NUM_THREADS`` = ``--threads``
and ``VLLM_CPU_OMP_THREADS_BIND`` = the first ``--threads`` CPUs of this process's
affinity mask. By default vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
one synchronous iteration per step, no extra processes competing for the cores);
``--multiprocessing`` keeps vLLM's default engine-core and worker processes (the worker's
OpenMP threads are then bound to those CPUs by vLLM).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def set_env(args) -> dict:
    cpus = sorted(os.sched_getaffinity(0))[:args.threads]
    bind = ",".join(str(c) for c in cpus)
    wanted = {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if args.multiprocessing else "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    # oneDNN's primitive cache: bench/engine.py passes on raycolo's (packed.py), the same room
    # for both engines' products; reported so the table says what each ran with.
    shown = {key: os.environ[key] for key in wanted}
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        shown["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    return shown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--requests", required=True, help="JSON file of request sets")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--multiprocessing", action="store_true",
                    help="vLLM's default engine-core/worker processes instead of in-process")
    args = ap.parse_args()
    env = set_env(args)
    spec = json.loads(open(args.requests).read())

    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import_s = time.perf_counter() - t0

    started = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", seed=0,
              enforce_eager=args.mode == "eager", max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False, disable_log_stats=True)
    startup_s = time.perf_counter() - started
    cfg = llm.llm_engine.vllm_config
    settings = {"max_num_seqs": cfg.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                "block_size": cfg.cache_config.block_size,
                "num_kv_blocks": cfg.cache_config.num_gpu_blocks,
                "compilation_mode": str(cfg.compilation_config.mode),
                "torch_threads": torch.get_num_threads()}

    def params(length: int):
        return SamplingParams(max_tokens=length, min_tokens=length, ignore_eos=True,
                              temperature=0.0, detokenize=False)

    def generate(prompts, lengths):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            [params(n) for n in lengths], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    check = int(spec.get("check", 4))
    sets = spec["sets"]
    first = next(iter(sets.values()))
    warm_n = min(4, len(first["prompts"]))
    started = time.perf_counter()
    generate(first["prompts"][:warm_n], [min(8, n) for n in first["lengths"][:warm_n]])
    warmup_s = time.perf_counter() - started

    results = {}
    for name, req in sets.items():
        prompts, lengths = req["prompts"], req["lengths"]
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            outs = generate(prompts, lengths)
            times.append(time.perf_counter() - started)
        bad = [i for i, (o, n) in enumerate(zip(outs, lengths)) if len(o) != n]
        if bad:
            raise SystemExit(f"vllm_peer: set {name} request {bad[0]} produced "
                             f"{len(outs[bad[0]])} tokens, expected {lengths[bad[0]]}")
        results[name] = {"times_s": times, "median_s": statistics.median(times),
                         "useful_tokens": sum(lengths), "outputs": outs[:check]}
        print(f"[vllm_peer] {args.mode} set {name}: median {statistics.median(times):.2f}s "
              f"({sum(lengths) / statistics.median(times):.0f} tok/s)", file=sys.stderr, flush=True)

    steady = None
    if spec.get("steady"):
        steady = {"runs": [run_steady(llm, spec["steady"], params, f"steady{r}")
                           for r in range(int(spec.get("steady_repeats", 1)))]}

    out = {"vllm": vllm.__version__, "torch": torch.__version__, "mode": args.mode,
           "env": env, "settings": settings, "import_s": import_s, "startup_s": startup_s,
           "warmup_s": warmup_s, "sets": results, "steady": steady}
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


def run_steady(llm, req, params, tag):
    """All requests at once, one engine step at a time; per step: seconds, requests that
    got a token, how many of those got their first, and the tokens they attended."""
    engine = llm.llm_engine
    prompts, lengths = req["prompts"], req["lengths"]
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params(n))
    have = {f"{tag}-{i}": 0 for i in range(len(prompts))}
    plen = {f"{tag}-{i}": len(p) for i, p in enumerate(prompts)}
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        seqs = first = 0
        contexts = []
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            fresh = n - have.get(out.request_id, 0)
            if fresh > 0:
                seqs += 1
                first += have[out.request_id] == 0
                contexts.append(plen[out.request_id] + have[out.request_id])
            have[out.request_id] = n
        steps.append({"seconds": seconds, "num_seqs": seqs, "first_tokens": first,
                      "context_sum": sum(contexts)})
    return steps


if __name__ == "__main__":
    sys.exit(main())
