"""Real-size models at the speed of the GPU: every decode path against the memory roofline.

Builds Llama-3-8B- and Llama-3.2-1B-shaped models with random weights directly on the
device (seeded; nothing is downloaded or written), measures the card's limits in the same
run, then times each path with prompts of ``--prompt`` tokens and ``--output`` greedy
tokens (EOS ignored):

* **limits**: copy bandwidth (device-to-device copies of 1 GiB, 20 back to back; bytes
  read plus written, 2 GiB a copy, as the decode roofline counts them) and the dense
  matmul rate (8192^3 in the model dtype, 64 back to back after 64 to warm up);
* ``engine.graphs`` at each ``--batches``, ``engine.eager`` at batch 1: the torch engine
  (scheduler, executor, sampler: one ``engine.step()`` per decode iteration);
  ``engine.unfused``: graphs at batch 1 with q/k/v and gate/up as separate matmuls
  (``fuse_projections: false``), what fusing them (executor/fused.py) gains;
* ``stage.graphs`` / ``stage.eager``: the online ``StageModel`` on the whole model with an
  active LoRA (rank 8 on q/k/v/o, lora_B random), one decode step of every row;
* ``stage.versions`` / ``stage.versions1p``: a stage step whose rows are a third on the
  latest adapter, a third ``@base``, a third pinned to a saved version, at batch 16 (or the
  largest stage batch below it): one pass per version (graph replays) against one eager
  pass with each row's own LoRA (batched LoRA): which serves mixed versions faster;
* ``stage.split2``: two ``StageModel`` slices (half the layers each, each from its own copy
  of the model) chained in one process, per token; ``stage.split2p``: the same split as two
  spawned ``StageProcess``es over gloo on the one device, as a live node runs them
  (bench/realsize_split.py);
* ``transformers``: ``generate()`` at batch 1, per output token (its dynamic cache);
* ``attention.*``: one layer's decode attention at each batch, every sequence at the mean
  decode context: the Triton kernel reading the paged cache in place, the torch path
  (gather the blocks, SDPA under a mask), and compiled FlexAttention over K/V already
  contiguous (what a paged FlexAttention could at best reach), against the K/V roofline;
* ``prefill``: the engine's prefill iterations at batch >= 16, against the matmul rate;
* ``lora.train``: one LoRA training step of ``StageModel`` (forward and backward, AdamW) on
  8 x ``--prompt`` tokens, against the matmul rate (4 N FLOPs per token: forward, and the
  backward of the activations; the frozen weights take no gradient);
* ``agreement``: the engine's bf16 greedy tokens teacher-forced through transformers'
  forward of the same model: each must be its argmax, or within the near-tie margin of its
  best logit: the larger of ``--tie`` and ``--tie-ulps`` units in the last place of the
  dtype at that logit (8 by default: two correct bf16 forwards round differently).

The roofline of a decode step is the bytes it must read (every weight matrix, the final
norm and the LM head; the embedding's rows of the step's tokens; each sequence's K/V up to
its context) over the measured copy bandwidth; ``fraction`` is roofline / measured step.
Targets (issue 46) are printed beside each row.

    make gpu-bench                                     # the machine's own python3, one GPU
    python3 bench/gpu_realsize.py --json out/gpu_realsize.json
    python3 bench/gpu_realsize.py --device cpu --shapes tiny --dtype float32 \\
        --batches 1,4 --prompt 32 --output 8          # a dry run of the script (tests do this)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from realsize_models import (BLOCK, SHAPES, Model, active_lora, add_active_lora, build_model, limits,
                             prompts_for, sync, timed, timed_loop)

TARGETS = {     # issue 46: fraction of the roofline (decode) or of the matmul rate
    ("engine.graphs", 1): 0.80, ("engine.graphs", 16): 0.70, ("engine.graphs", 64): 0.70,
    ("engine.graphs", 256): 0.60, ("prefill", None): 0.60, ("lora.train", None): 0.45,
}
STAGE_OVER_ENGINE = 1.15     # stage.graphs step at most this times the engine's
SPLIT_OVER_WHOLE = 1.3       # stage.split2 per token at most this times the whole stage's
OPTIONAL_ROWS_S = 60         # with --time-limit: the optional rows (flex, versions1p, split2p) need this left
L2_MISS_BYTES = 256 << 20    # the attention rows cycle through this many bytes of caches (an H200's L2: 50 MB)


class SavedRows(list):
    """A shape's rows; each one added saves the JSON (a run cut off keeps every row)."""

    def __init__(self, save):
        super().__init__()
        self.save = save

    def append(self, row) -> None:
        super().append(row)
        self.save()


class Clock:
    """Seconds left of ``--time-limit`` (none: unlimited)."""

    def __init__(self, limit_s: float):
        self.end = time.monotonic() + limit_s if limit_s > 0 else None

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def allows(self, what: str) -> bool:
        """Whether an optional row still fits; says so where it does not."""
        if self.left() >= OPTIONAL_ROWS_S:
            return True
        print(f"  {what}: skipped, {self.left():.0f} s left of --time-limit", flush=True)
        return False


def engine_for(loaded, device, dtype_name: str, batch: int, prompt: int, output: int, graphs: bool,
               fuse: bool = True):
    from raycolo.engine.base import EngineConfig
    from raycolo.engine.torch_engine import TorchEngine

    tokens = batch * (prompt + output + BLOCK)
    config = EngineConfig.model_validate({
        "backend": "torch", "model_loading_config": {"model_id": "in-memory", "dtype": dtype_name},
        "engine_kwargs": {"device": str(device), "max_num_seqs": batch, "block_size": BLOCK,
                          "max_num_batched_tokens": max(4096, prompt), "kv_cache_tokens": tokens,
                          "cuda_graphs": graphs, "fuse_projections": fuse}})
    return TorchEngine(config, loaded=loaded)


def engine_run(loaded, device, dtype_name, prompts, output: int, graphs: bool, fuse: bool = True) -> dict:
    from raycolo.engine.base import SamplingParams

    engine = engine_for(loaded, device, dtype_name, len(prompts), len(prompts[0]), output, graphs, fuse)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
    its = engine.stats.iterations
    decode = [r for r in its if r.kind == "decode"][1:]       # the first may compile or capture
    prefill = [r for r in its if r.kind == "prefill"]
    result = {"step_s": statistics.median(r.seconds for r in decode),
              "context": statistics.mean(statistics.mean(r.context_lens) for r in decode),
              "prefill": [(r.tokens, r.num_seqs, r.seconds) for r in prefill],
              "tokens": [o.token_ids for o in outs], "captures": engine.executor.graph_captures}
    del engine
    gc.collect()
    return result


def agreement(model, prompts, outputs, tie: float, tie_ulps: float) -> dict:
    """Teacher-forced: the share of greedy tokens that are transformers' argmax on the same
    prefix, and the largest gap between its best logit and the chosen token's. A token
    within the near-tie margin of the best is allowed: the larger of ``tie`` and
    ``tie_ulps`` units in the last place of the model's dtype at the best logit's magnitude
    (two correct bf16 forwards round differently; bf16 logits in [4, 8) are 0.03125 apart)."""
    from raycolo.gpu_check.references import teacher_forced_gaps

    gaps, bests = teacher_forced_gaps(model, prompts, outputs)
    eps = torch.finfo(next(model.parameters()).dtype).eps
    ulps = eps * torch.exp2(torch.floor(torch.log2(bests.abs().clamp_min(1e-30))))
    margin = torch.clamp(tie_ulps * ulps, min=tie)
    i = int(torch.argmax(gaps / margin))
    return {"argmax": int((gaps == 0).sum()), "tokens": len(gaps), "worst_gap": float(gaps.max()),
            "worst_gap_ulps": float((gaps / ulps).max()), "within_tie": bool((gaps <= margin).all()),
            "tie": tie, "tie_ulps": tie_ulps, "margin_at_worst": float(margin[i])}


def hf_generate_step(model, prompt, output: int, device) -> float:
    """Seconds per output token of transformers' generate() (greedy, batch 1)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def gen(n):
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                               pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=cfg)

    one = timed(lambda: gen(1), device, 3)
    full = timed(lambda: gen(output), device, 3)
    return (full - one) / (output - 1)


def stage_step(chain, prompts, steps: int, device, **versions) -> float:
    """Median seconds of one decode step of every row through ``chain`` (StageModels);
    ``versions``: :meth:`StageModel.forward`'s ``base`` and ``pinned``."""
    rids = list(range(len(prompts)))
    hidden = None
    for st in chain:
        hidden = st.forward(rids, prompts, hidden, **versions)
    toks = hidden.argmax(-1).tolist()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        hidden = None
        for st in chain:
            hidden = st.forward(rids, [[t] for t in toks], hidden, **versions)
        toks = hidden.argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    for st in chain:
        for rid in rids:
            st.release(rid)
    return statistics.median(times[1:])


def versions_rows(rows, model, graphed, m, args, device, bw, batch: int) -> None:
    """A stage step mixing adapter versions (a third of the rows on the latest adapter, a
    third ``@base``, a third pinned to a saved version): one pass per version through
    ``graphed`` (each a graph replay on a GPU) against one eager pass with each row's own
    LoRA (batched LoRA, raycolo/online/stages/row_versions.py)."""
    import tempfile

    from raycolo.online.stages.peft_format import export_adapter
    from raycolo.online.stages.stage_model import StageModel

    saved = export_adapter([graphed.lora_state()], active_lora(), Path(tempfile.mkdtemp(prefix="raycolo-bench-")) / "v1")
    rids = list(range(batch))
    versions = {"base": rids[1::3], "pinned": {r: str(saved) for r in rids[2::3]}}
    ps = prompts_for(m.cfg.vocab_size, batch, args.prompt, seed=batch)
    roof = m.decode_bytes(batch, args.prompt + args.stage_steps / 2) / bw
    graphed.batched_versions = False
    per = stage_step([graphed], ps, args.stage_steps, device, **versions)
    decode_row(rows, "stage.versions", batch, per, roof)
    if not args.clock.allows("stage.versions1p"):
        return
    blocks = batch * -(-(args.prompt + args.stage_steps + 2) // BLOCK) + 1
    one = StageModel(model, (0, m.cfg.num_hidden_layers), blocks, BLOCK, cuda_graphs=False)
    step = stage_step([one], ps, args.stage_steps, device, **versions)
    decode_row(rows, "stage.versions1p", batch, step, roof, {"over_per_version": step / per})
    del one


def train_step(stage, vocab: int, rows: int, length: int, device) -> float:
    from raycolo.online.stages.stage_model import training_batch

    samples = [(p[:length // 2], p[length // 2:]) for p in prompts_for(vocab, rows, length, seed=9)]
    ids, labels, lengths = training_batch(samples)
    ids, labels = ids.to(device), labels.to(device)
    task = iter(range(1 << 30))

    def step():
        t = next(task)
        stage.train_forward(t, ids, lengths, labels)
        stage.train_backward(t)
    return timed(step, device, 5)


def attention_rows(rows, m: "Model", batches, context: int, device, dtype, bw: float, clock: Clock,
                   flex_batches=()) -> None:
    """One layer's decode attention at each batch (every sequence at ``context``): the
    Triton kernel in place, the torch path (gather the blocks, then SDPA under a mask) and,
    at ``flex_batches`` only (each batch compiles anew: tens of seconds of a short lease),
    FlexAttention (compiled) over K/V already contiguous, against the K/V bytes' roofline.
    Each is timed over back-to-back calls cycling through caches larger than the L2 cache."""
    import torch.nn.functional as F

    from raycolo.engine.executor.kv_cache import PagedKVCache

    cfg = m.cfg
    kvh, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_seq = -(-(context + 1) // BLOCK)
    try:
        from raycolo.engine.executor import triton_attention
    except ImportError:
        triton_attention = None
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception:                                   # noqa: BLE001 - an old torch: no row
        flex = None
    for b in batches:
        # several caches, more bytes than the L2 holds, each call on the next: one call's time
        # is then a read of its K/V from memory, not from the cache the call before filled
        cache_bytes = 2 * b * per_seq * BLOCK * kvh * d * m.itemsize
        copies = min(64, max(2, -(-L2_MISS_BYTES // cache_bytes))) if device.type == "cuda" else 2
        caches = []
        for _ in range(copies):
            cache = PagedKVCache(1, b * per_seq, BLOCK, kvh, d, dtype, device)
            cache.keys[0].normal_()
            cache.values[0].normal_()
            caches.append(cache)
        order = torch.randperm(b * per_seq, device=device)
        tables2d = order.view(b, per_seq)
        flat, starts = order.contiguous(), torch.arange(b, device=device) * per_seq
        pos = torch.full((b,), context, device=device)
        q = torch.randn(b, heads, d, device=device, dtype=dtype)
        scale = d ** -0.5
        roof = b * (context + 1) * 2 * kvh * d * m.itemsize / bw

        def gather_sdpa(cache):
            k, v = cache.read(0, tables2d)                            # (b, kvh, T, d)
            mask = (torch.arange(k.shape[2], device=device) <= pos.view(b, 1)).view(b, 1, 1, -1)
            qg = q.view(b, kvh, heads // kvh, d)
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        paths = {"attention.torch": [lambda c=c: gather_sdpa(c) for c in caches]}
        if triton_attention is not None and device.type == "cuda":
            paths["attention.triton"] = [lambda c=c: triton_attention.paged_attention(
                q, c.keys[0], c.values[0], flat, starts, pos, None, scale) for c in caches]
        if flex is not None and device.type == "cuda" and b in flex_batches and clock.allows(f"attention.flex b={b}"):
            contiguous = []
            for c in caches:
                k, v = c.read(0, tables2d)
                contiguous.append((k[:, :, :context + 1].contiguous(), v[:, :, :context + 1].contiguous()))
            paths["attention.flex"] = [lambda k=k, v=v: flex(q.view(b, heads, 1, d), k, v, scale=scale, enable_gqa=True)
                                       for k, v in contiguous]
        for path, fns in paths.items():
            try:
                step = timed_loop(fns, device, len(fns) * max(1, 64 // len(fns)) if device.type == "cuda" else len(fns))
            except Exception as exc:                    # noqa: BLE001 - a row that says why
                rows.append({"path": path, "batch": b, "error": f"{type(exc).__name__}: {exc}"[:200]})
                print(f"  {path:<16} b={b:<4} failed: {type(exc).__name__}", flush=True)
                continue
            decode_row(rows, path, b, step, roof, {"caches": copies})
        del caches, paths


def decode_row(rows, path, batch, step_s, roofline_s, extra=None):
    target = TARGETS.get((path, batch))
    row = {"path": path, "batch": batch, "step_ms": 1000 * step_s, "tok_s": batch / step_s,
           "roofline_ms": 1000 * roofline_s, "fraction": roofline_s / step_s, "target": target}
    row.update(extra or {})
    rows.append(row)
    print(f"  {path:<14} b={batch:<4} {1000 * step_s:8.2f} ms  roofline {1000 * roofline_s:6.2f} ms  "
          f"{100 * roofline_s / step_s:5.1f} %", flush=True)
    return row


def run_shape(shape: str, args, device, dtype, lim: dict, res: dict) -> None:
    """Every row of ``shape`` into ``res["rows"]`` (a :class:`SavedRows`)."""
    from raycolo.online.stages.stage_model import StageModel

    dtype_name = str(dtype).split(".")[-1]
    t0 = time.perf_counter()
    model, tok = build_model(shape, device, dtype, seed=0)
    sync(device)
    build_s = time.perf_counter() - t0
    m = Model(model)
    bw, peak = lim["copy_bytes_per_s"], lim["matmul_flops"]
    print(f"{shape}: {m.params / 1e9:.2f}B parameters built on {device} in {build_s:.1f} s", flush=True)
    res.update(params=m.params, build_s=build_s)
    rows = res["rows"]
    engine_steps: dict[int, float] = {}
    prefills = []
    vocab, plen, out = m.cfg.vocab_size, args.prompt, args.output
    agree = None
    for b in args.batches:
        ps = prompts_for(vocab, b, plen, seed=b)
        r = engine_run((model, tok), device, dtype_name, ps, out, graphs=True)
        engine_steps[b] = r["step_s"]
        decode_row(rows, "engine.graphs", b, r["step_s"], m.decode_bytes(b, r["context"]) / bw,
                   {"captures": r["captures"]})
        if b >= 16 or b == max(args.batches):     # (a first run's kernels compile in its prefill)
            prefills += r["prefill"][0 if b != args.batches[0] else 1:]
        if agree is None and (b >= 16 or b == max(args.batches)):
            n = min(4, b)
            agree = res["agreement"] = agreement(model, ps[:n], r["tokens"][:n], args.tie, args.tie_ulps)
            res["rows"].save()
    attention_rows(rows, m, args.batches, plen + out // 2, device, dtype, bw, args.clock,
                   args.flex_batches if shape == args.shapes[0] else ())
    ps = prompts_for(vocab, 1, plen, seed=1)
    r = engine_run((model, tok), device, dtype_name, ps, min(out, args.eager_output), graphs=False)
    decode_row(rows, "engine.eager", 1, r["step_s"], m.decode_bytes(1, r["context"]) / bw)
    r = engine_run((model, tok), device, dtype_name, ps, out, graphs=True, fuse=False)
    decode_row(rows, "engine.unfused", 1, r["step_s"], m.decode_bytes(1, r["context"]) / bw)
    hf = hf_generate_step(model, ps[0], min(out, args.eager_output), device)
    decode_row(rows, "transformers", 1, hf, m.decode_bytes(1, plen + out / 2) / bw)
    if prefills:
        tokens, seqs, secs = (sum(x[i] for x in prefills) for i in range(3))
        flops = m.prefill_flops(tokens, seqs, plen)
        rows.append({"path": "prefill", "batch": None, "tok_s": tokens / secs, "matmul_fraction": flops / secs / peak,
                     "target": TARGETS[("prefill", None)]})
        print(f"  prefill        {tokens / secs:10.0f} tok/s  {100 * flops / secs / peak:5.1f} % of matmul", flush=True)
    # the online stage path: the whole model with an active LoRA
    model = add_active_lora(model, seed=3)
    stage_batches = [b for b in args.batches if b <= 64]
    for graphs in (True, False):
        stage = StageModel(model, (0, m.cfg.num_hidden_layers), sum(-(-(plen + args.stage_steps + 2) // BLOCK)
                                                                    for _ in range(max(stage_batches))) + 1,
                           BLOCK, cuda_graphs=graphs)
        for b in (stage_batches if graphs else stage_batches[:1]):
            ps = prompts_for(vocab, b, plen, seed=b)
            step = stage_step([stage], ps, args.stage_steps, device)
            extra = {"captures": stage.executor.graph_captures} if graphs else {}
            if graphs and b in engine_steps:
                extra = {"over_engine": step / engine_steps[b], "target_over_engine": STAGE_OVER_ENGINE}
            decode_row(rows, "stage.graphs" if graphs else "stage.eager", b, step,
                       m.decode_bytes(b, plen + args.stage_steps / 2) / bw, extra)
        if graphs:
            whole_stage = stage
        else:
            del stage
    versions_rows(rows, model, whole_stage, m, args, device, bw, max(b for b in stage_batches if b <= 16))
    t = train_step(whole_stage, vocab, args.train_rows, plen, device)
    tokens = args.train_rows * plen
    flops = 4 * (m.layer_params + m.head_params) * tokens + 3 * m.attn_flops_per_key * tokens * (plen + 1) / 2
    rows.append({"path": "lora.train", "batch": args.train_rows, "tok_s": tokens / t,
                 "matmul_fraction": flops / t / peak, "target": TARGETS[("lora.train", None)]})
    print(f"  lora.train     {tokens / t:10.0f} tok/s  {100 * flops / t / peak:5.1f} % of matmul", flush=True)
    whole_b1 = next(r["step_ms"] for r in rows if r["path"] == "stage.graphs" and r["batch"] == stage_batches[0])
    del whole_stage, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # two slices, each from its own copy of the model (a slice drops the other's layers)
    half = m.cfg.num_hidden_layers // 2
    chain = []
    for layers in ((0, half), (half, m.cfg.num_hidden_layers)):
        part = add_active_lora(build_model(shape, device, dtype, seed=0)[0], seed=3)
        chain.append(StageModel(part, layers, -(-(plen + args.stage_steps + 2) // BLOCK) + 1, BLOCK, cuda_graphs=True))
    b = stage_batches[0]
    step = timed_split = stage_step(chain, prompts_for(vocab, b, plen, seed=b), args.stage_steps, device)
    decode_row(rows, "stage.split2", b, step, m.decode_bytes(b, plen + args.stage_steps / 2) / bw,
               {"over_whole": 1000 * timed_split / whole_b1, "target_over_whole": SPLIT_OVER_WHOLE})
    del chain
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.clock.allows("stage.split2p"):
        return
    from realsize_split import split_step
    try:
        step = split_step(shape, str(device), dtype_name, b, plen, args.stage_steps,
                          timeout_s=min(240.0, args.clock.left() - 20))
        decode_row(rows, "stage.split2p", b, step, m.decode_bytes(b, plen + args.stage_steps / 2) / bw,
                   {"over_whole": 1000 * step / whole_b1, "target_over_whole": SPLIT_OVER_WHOLE})
    except RuntimeError as exc:
        rows.append({"path": "stage.split2p", "batch": b, "error": str(exc).splitlines()[0][:200]})
        print(f"  stage.split2p failed: {exc}", flush=True)


def verdict(r: dict) -> tuple[str, str]:
    """A row's target and whether it was met ('' where it has none)."""
    if "over_engine" in r:
        return (f"<= {r['target_over_engine']}x engine: {r['over_engine']:.2f}x",
                "yes" if r["over_engine"] <= r["target_over_engine"] else "no")
    if "over_whole" in r:
        return (f"<= {r['target_over_whole']}x whole: {r['over_whole']:.2f}x",
                "yes" if r["over_whole"] <= r["target_over_whole"] else "no")
    if r.get("target") is None:
        return "", ""
    got = r.get("fraction", r.get("matmul_fraction"))
    return f">= {100 * r['target']:.0f} %", "yes" if got >= r["target"] else "no"


def limits_line(lim: dict) -> str:
    """The card's measured limits, in three significant figures (a CPU's are far below 1)."""
    return (f"copy bandwidth {lim['copy_bytes_per_s'] / 1e12:.3g} TB/s (read + write), "
            f"matmul {lim['matmul_flops'] / 1e12:.3g} TFLOP/s")


def table(results: list[dict], lim: dict, on_gpu: bool = True) -> str:
    """The rows as markdown; on a GPU, a graphs row whose step captured no graph says so."""
    lines = [limits_line(lim),
             "| shape | path | batch | step ms | tok/s | roofline ms | fraction | target | met |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for res in results:
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"| {res['shape']} | {r['path']} | {r['batch']} | {r['error']} | | | | | |")
                continue
            if "matmul_fraction" in r:
                frac = f"{100 * r['matmul_fraction']:.1f} % of matmul"
            else:
                frac = f"{100 * r['fraction']:.1f} %"
            target, met = verdict(r)
            path = r["path"] + (" (none captured: eager)" if r.get("captures") == 0 and on_gpu else "")
            step = f"{r['step_ms']:.2f}" if "step_ms" in r else ""
            roof = f"{r['roofline_ms']:.2f}" if "roofline_ms" in r else ""
            lines.append(f"| {res['shape']} | {path} | {r['batch'] or ''} | {step} | {r['tok_s']:,.0f} | "
                         f"{roof} | {frac} | {target} | {met} |")
        a = res["agreement"]
        if a:
            lines.append(f"| {res['shape']} | agreement | | | | | {a['argmax']}/{a['tokens']} argmax, worst gap "
                         f"{a['worst_gap']:.3g} ({a['worst_gap_ulps']:.1f} ulp) | gap <= max({a['tie']:g}, "
                         f"{a['tie_ulps']:g} ulp) | {'yes' if a['within_tie'] else 'no'} |")
    return "\n".join(lines)


def _batch_list(text: str):
    """A flag's comma-separated batch sizes, sorted, or None where one is not an integer >= 1."""
    try:
        sizes = sorted(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        return None
    return sizes if all(b >= 1 for b in sizes) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3-8b,llama3.2-1b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--eager-output", type=int, default=32, help="output tokens of the slow eager runs")
    parser.add_argument("--stage-steps", type=int, default=24, help="decode steps timed per stage batch")
    parser.add_argument("--train-rows", type=int, default=8)
    parser.add_argument("--tie", type=float, default=0.05,
                        help="near-tie margin of the agreement check (logits), at least")
    parser.add_argument("--tie-ulps", type=float, default=8.0,
                        help="near-tie margin in units in the last place of the dtype at the best logit")
    parser.add_argument("--flex-batches", default="1,64",
                        help="batches of the compiled FlexAttention row, first shape only (each compiles anew)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", default="", help="write the JSON here, after every row")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help=f"seconds the run has (0: no limit); the optional rows are skipped with less than "
                             f"{OPTIONAL_ROWS_S} s left")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    args.shapes = shapes
    args.batches, args.flex_batches = _batch_list(args.batches), _batch_list(args.flex_batches)
    # a run's first decode step is not timed (it may compile or capture): 3 tokens at least
    wrong = [(flag, need) for flag, bad, need in [
        ("--shapes", not shapes or any(s not in SHAPES for s in shapes), f"some of {', '.join(SHAPES)}"),
        ("--batches", not args.batches, "comma-separated integers >= 1"),
        ("--prompt", args.prompt < 2, "at least 2"), ("--output", args.output < 3, "at least 3"),
        ("--eager-output", args.eager_output < 3, "at least 3"), ("--stage-steps", args.stage_steps < 2, "at least 2"),
        ("--train-rows", args.train_rows < 1, "at least 1"),
        ("--flex-batches", args.flex_batches is None, "comma-separated integers >= 1, or empty"),
        ("--tie", args.tie < 0, "at least 0"), ("--tie-ulps", args.tie_ulps < 0, "at least 0"),
        ("--time-limit", not args.time_limit >= 0, "at least 0")] if bad]
    if wrong:
        flag, need = wrong[0]
        print(f"error: {flag}: must be {need}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (--device cpu for a dry run)")
        return 0
    dtype = getattr(torch, args.dtype)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    args.clock = Clock(args.time_limit)
    lim = limits(device, dtype)
    print(f"{card}, {args.dtype}: {limits_line(lim)}", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    results: list[dict] = []
    settings = {k: v for k, v in vars(args).items() if k != "clock"}

    def save(complete: bool = False) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"card": card, "date": stamp, "torch": torch.__version__,
                                                   "args": settings, "limits": lim, "results": results,
                                                   "complete": complete}, indent=2))
    for s in shapes:
        res = {"shape": s, "rows": SavedRows(save), "agreement": None}
        results.append(res)
        run_shape(s, args, device, dtype, lim, res)
    save(complete=True)
    command = ' '.join(['python3', 'bench/gpu_realsize.py'] + (argv if argv is not None else sys.argv[1:]))
    print(f"\n{card}, {stamp}, torch {torch.__version__}, `{command}`")
    print(table(results, lim, device.type == "cuda"))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
