"""GPU readiness: run every raycolo path that has a CUDA branch, against independent references.

``make gpu-check`` (or ``python -m raycolo.engine.gpu_check``) prints one row per path::

    path | result | figures

Each check does real work on the device and compares it with a reference that does not
use the code under test: transformers' own ``forward``/``generate()`` on CPU in float64
(the same seeded tiny model, built in code: nothing is downloaded), peft's own training
step, and for NVML the CUDA driver's own memory figures. Rows:

* ``executor.whole``     ModelExecutor, whole model (torch attention path, SDPA on CUDA), float64
* ``executor.slices``    two chained layer slices (hidden states between them), float64
* ``executor.windows``   Qwen2 (q/k/v biases, per-layer windows) and Mistral (sliding window)
* ``executor.decode``    float32 decode timing, batch 1 and a larger batch: ms/step, tok/s,
                         logits diff and greedy agreement (a mismatch only at a near-tie)
* ``torch_engine``       TorchEngine on the device: continuous batching, sleep/wake_up
* ``stage.inproc``       StageModel slices with LoRA: serving tokens, a pipelined training
                         step's losses and LoRA weights against peft's unsplit step
* ``stage.p2p``          two stage processes running executor/stage_process.StageProcess over a
                         real process group: NCCL with 2+ GPUs (one GPU each), gloo on one
                         GPU (NCCL refuses two ranks on one device) or on CPU
* ``device_stats``       raycolo/engine/device_stats.py: NVML figures against
                         ``torch.cuda.mem_get_info`` and a known allocation
* ``vllm``               the vllm backend, where ``import vllm`` works on this platform

* ``executor.graphs``    decode steps replayed as CUDA graphs (executor/graphs.py): float64
                         tokens vs generate(), whole and sliced; float32 ms/step eager vs graphs

vLLM's own graphs are exercised by the ``vllm`` row (its default, compiled mode).

Without CUDA it prints ``skipped: no CUDA device`` and exits 0. ``--device cpu`` runs the
same checks on the CPU (a dry run of the comparison logic; the CPU takes the native-kernel
and packed-weight paths, not the CUDA branches). Exit status: 1 if any row failed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
MODEL = "tiny-llama-m"
CUTS = (0, 2, 4)


@dataclass
class Row:
    path: str
    result: str
    figures: dict = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0

    def figures_text(self) -> str:
        parts = [f"{k}={_fmt(v)}" for k, v in self.figures.items()]
        if self.detail:
            parts.append(self.detail)
        return ", ".join(parts)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:.4g}"
    return str(v)


class CheckFailed(AssertionError):
    pass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


# -- shared pieces ---------------------------------------------------------------------------
def _prompts(lengths, seed: int = 1) -> list[list[int]]:
    from raycolo.engine.models import BOS_ID, BYTE_OFFSET

    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(n - 1)]
            for n in lengths]


def _model(model_id: str, dtype: str, device):
    from raycolo.engine.models import build_tiny_model

    return build_tiny_model(model_id, 0, dtype)[0].to(device)


def _logits_tol(device) -> float:
    """How close float64 logits must be to transformers' own on the same device. Its
    Llama/Qwen2/Mistral RMSNorm computes in float32 whatever the model's dtype. A CPU's
    float32 row reduction does not depend on how many rows the batch has; CUDA's does, so a
    token's norm in a packed batch of prompts and in one prompt alone round differently
    (9e-8 in the logits, seen on an H100). On CUDA the bound is float32's rounding; the
    greedy tokens must still be equal."""
    return 1e-8 if device.type == "cpu" else 1e-6


def _hf_greedy(model, prompt, n: int) -> list[int]:
    """transformers' own generate(), greedy, EOS ignored (the reference)."""
    import torch
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=0)
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)], device=dev),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=dev),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def _hf_last_logits(model, prompts):
    """transformers' own forward: each prompt's last logits (on the CPU)."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p], device=dev)).logits[0, -1].cpu() for p in prompts])


def _reference(model_id: str, device):
    """The reference for a path on ``device``: transformers' own float64 model on that same
    device. Not the CPU: transformers computes the rotary cos/sin in float32 whatever the
    model's dtype (its rotary embedding runs with autocast off), and CUDA's float32 sin/cos
    round differently from the CPU's, so even float64 logits differ by about 1e-7 between
    the two (seen on an H100). ``executor.whole`` reports that cross-device gap too."""
    return _model(model_id, "float64", device).eval()


def _greedy_agreement(ref_model, prompts, outputs, tie: float) -> tuple[int, int, float]:
    """Whether ``outputs`` are greedy under ``ref_model`` (CPU float64), teacher-forced on the
    outputs themselves: (tokens that are the reference's argmax, tokens, the largest gap
    between the reference's best logit and the chosen token's). A lower-precision run may
    pick another token only where the reference's top two are within ``tie``."""
    import torch

    same = total = 0
    worst = 0.0
    with torch.no_grad():
        for p, out in zip(prompts, outputs):
            ids = torch.tensor([list(p) + list(out)])
            logits = ref_model(ids).logits[0, len(p) - 1:len(p) - 1 + len(out)]
            best = logits.max(-1).values
            chosen = logits.gather(1, torch.tensor(out).view(-1, 1))[:, 0]
            gap = (best - chosen)
            same += int((gap == 0).sum())
            total += len(out)
            worst = max(worst, float(gap.max()))
    _require(worst <= tie, f"a token {worst:.3g} below the reference's best logit (allowed {tie:g})")
    return same, total, worst


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Chain:
    """Executors (or one) over shared block tables: prefill, then greedy decode steps."""

    def __init__(self, executors, num_blocks: int, block_size: int):
        from raycolo.batching.blocks import BlockAllocator

        self.executors, self.block_size = executors, block_size
        self.alloc = BlockAllocator(num_blocks)
        self.lens: dict[int, int] = {}

    def step(self, rids, toks):
        import math

        from raycolo.engine.executor import SeqChunk

        chunks = []
        for rid, t in zip(rids, toks):
            start = self.lens.get(rid, 0)
            need = math.ceil((start + len(t)) / self.block_size) - self.alloc.blocks_of(rid)
            if need > 0:
                self.alloc.allocate(rid, need)
            chunks.append(SeqChunk(list(t), start=start, table=self.alloc.tables[rid]))
            self.lens[rid] = start + len(t)
        hidden = None
        for ex in self.executors:
            hidden = ex.execute(ex.batch(chunks), hidden)
        return hidden

    def greedy(self, prompts, steps: int, timer: Optional[list] = None):
        rids = list(range(len(prompts)))
        first = self.step(rids, prompts)
        outs = [[int(t)] for t in first.argmax(-1).tolist()]
        device = first.device
        for _ in range(steps - 1):
            _sync(device)
            t0 = time.perf_counter()
            logits = self.step(rids, [[o[-1]] for o in outs])
            nxt = logits.argmax(-1).tolist()         # .tolist() waits for the device
            if timer is not None:
                timer.append(time.perf_counter() - t0)
            for o, t in zip(outs, nxt):
                o.append(int(t))
        return first, outs


# -- the checks ------------------------------------------------------------------------------
def check_executor_whole(device) -> Row:
    from raycolo.engine.executor import create_executor

    ps = _prompts([9, 23, 14, 40, 3, 17])
    ref = _reference(MODEL, device)
    ex = create_executor(_model(MODEL, "float64", device), num_blocks=128, block_size=16)
    first, outs = _Chain([ex], 128, 16).greedy(ps, 16)
    diff = float((first.cpu() - _hf_last_logits(ref, ps)).abs().max())
    _require(diff < _logits_tol(device), f"prefill logits differ from transformers' by {diff:.3g}")
    refs = [_hf_greedy(ref, p, 16) for p in ps]
    same = sum(a == b for o, r in zip(outs, refs) for a, b in zip(o, r))
    _require(outs == refs, f"greedy tokens: {same}/{16 * len(ps)} equal transformers' generate()")
    figures = {"max_abs_diff": diff, "tokens_equal": f"{same}/{16 * len(ps)}"}
    if device.type != "cpu":      # transformers on the CPU: float32 rotary rounds differently
        cpu_diff = float((first.cpu() - _hf_last_logits(_reference(MODEL, "cpu"), ps)).abs().max())
        _require(cpu_diff < 1e-5, f"prefill logits differ from transformers' on the CPU by {cpu_diff:.3g}")
        figures["cpu_ref_diff"] = cpu_diff
    return Row("executor.whole", PASS, figures, f"{MODEL} float64 vs transformers generate() on the device")


def check_executor_slices(device) -> Row:
    from raycolo.engine.executor import create_executor

    ps = _prompts([12, 31, 7])
    ref = _reference(MODEL, device)
    model = _model(MODEL, "float64", device)
    exs = [create_executor(model, 64, 16, layers=(a, b)) for a, b in zip(CUTS[:-1], CUTS[1:])]
    first, outs = _Chain(exs, 64, 16).greedy(ps, 12)
    diff = float((first.cpu() - _hf_last_logits(ref, ps)).abs().max())
    _require(diff < _logits_tol(device), f"chained slices' logits differ from transformers' by {diff:.3g}")
    refs = [_hf_greedy(ref, p, 12) for p in ps]
    _require(outs == refs, "chained slices' greedy tokens differ from transformers' generate()")
    return Row("executor.slices", PASS, {"max_abs_diff": diff, "tokens_equal": f"{12 * len(ps)}/{12 * len(ps)}"},
               f"layers {list(zip(CUTS[:-1], CUTS[1:]))}")


def check_executor_windows(device) -> Row:
    from raycolo.engine.executor import create_executor

    ps = _prompts([70, 20, 55], seed=2)     # past the tiny models' 48-token window
    figures = {}
    for model_id in ("tiny-qwen2-s", "tiny-mistral-s"):
        ref = _reference(model_id, device)
        ex = create_executor(_model(model_id, "float64", device), 64, 16)
        first, outs = _Chain([ex], 64, 16).greedy(ps, 10)
        diff = float((first.cpu() - _hf_last_logits(ref, ps)).abs().max())
        _require(diff < _logits_tol(device), f"{model_id}: logits differ from transformers' by {diff:.3g}")
        _require(outs == [_hf_greedy(ref, p, 10) for p in ps],
                 f"{model_id}: greedy tokens differ from transformers' generate()")
        figures[f"{model_id.split('-')[1]}_diff"] = diff
    return Row("executor.windows", PASS, figures, "sliding window 48, prompts to 70 tokens")


def check_executor_decode(device) -> Row:
    """float32 decode steps timed; the tokens must be greedy under the float64 reference."""
    from raycolo.engine.executor import create_executor

    cuda = device.type == "cuda"
    model_id, batch, prompt_len, steps = ("tiny-llama-xl", 64, 128, 64) if cuda else (MODEL, 8, 32, 8)
    ref = _model(model_id, "float64", "cpu").eval()
    model = _model(model_id, "float32", device)
    figures, worst = {}, 0.0
    same_all = total_all = 0
    for b in (1, batch):
        ps = _prompts([prompt_len] * b, seed=3 + b)
        blocks = b * ((prompt_len + steps) // 16 + 2)
        chain = _Chain([create_executor(model, blocks, 16)], blocks, 16)
        chain.greedy(ps[:1], 3)                       # warm-up (kernels, allocator)
        chain = _Chain([create_executor(model, blocks, 16)], blocks, 16)
        times: list = []
        first, outs = chain.greedy(ps, steps, timer=times)
        ms = 1000 * sorted(times)[len(times) // 2]
        figures[f"ms_step_b{b}"] = ms
        figures[f"tok_s_b{b}"] = round(b / (ms / 1000))
        if b == batch:
            figures["max_abs_diff"] = float((first[:4].double().cpu() - _hf_last_logits(ref, ps[:4])).abs().max())
        check = ps[:4]
        same, total, gap = _greedy_agreement(ref, check, outs[:4], tie=1e-3)
        same_all, total_all, worst = same_all + same, total_all + total, max(worst, gap)
    _require(figures["max_abs_diff"] < 1e-3, f"float32 logits differ from the float64 reference by "
                                             f"{figures['max_abs_diff']:.3g}")
    figures["greedy_equal"] = f"{same_all}/{total_all}"
    return Row("executor.decode", PASS, figures,
               f"{model_id} float32, prompts {prompt_len}, median of {steps - 1} steps")


def _graph_executor(model, blocks: int, layers=None):
    """An executor with padded decode steps: captured as CUDA graphs on a CUDA device (the
    engine's own setting), run eagerly on the CPU (the same padding, no capture)."""
    from raycolo.engine.executor import ModelExecutor, create_executor
    from raycolo.engine.executor.graphs import enable_padded_decode

    if next(model.parameters()).device.type == "cuda":
        ex = create_executor(model, blocks, 16, layers, cuda_graphs=True)
        _require(ex.graphs is not None, "create_executor(cuda_graphs=True) captured no graphs")
        return ex
    ex = ModelExecutor(model, blocks, 16, layers, native_attention=False)
    enable_padded_decode(ex, capture=False)
    return ex


def check_executor_graphs(device) -> Row:
    """Decode steps as CUDA graphs (executor/graphs.py): float64 greedy tokens against
    transformers on the device, whole and in slices, then float32 ms per decode step with
    and without graphs at batch 1 and a larger batch. The CPU runs the padded steps eagerly."""
    from raycolo.engine.executor import create_executor

    cuda = device.type == "cuda"
    ps = _prompts([9, 23, 14])                       # 3 rows: padded to 4
    ref = _reference(MODEL, device)
    refs = [_hf_greedy(ref, p, 12) for p in ps]
    model = _model(MODEL, "float64", device)
    whole = _graph_executor(model, 64)
    _, outs = _Chain([whole], 64, 16).greedy(ps, 12)
    _require(outs == refs, "greedy tokens through graphs differ from transformers' generate()")
    chain = [_graph_executor(model, 64, (a, b)) for a, b in zip(CUTS[:-1], CUTS[1:])]
    _, outs = _Chain(chain, 64, 16).greedy(ps, 12)
    _require(outs == refs, "greedy tokens through graphed slices differ from transformers' generate()")
    captured = sum(g.graph is not None for ex in [whole] + chain for g in ex.graphs.graphs.values())
    _require(captured > 0 if cuda else captured == 0, f"{captured} graphs captured")
    model_id, batch, prompt_len, steps = ("tiny-llama-xl", 64, 128, 64) if cuda else (MODEL, 8, 32, 8)
    ref = _model(model_id, "float64", "cpu").eval()
    fast = _model(model_id, "float32", device)
    figures = {"tokens_equal": f"{2 * 12 * len(ps)}/{2 * 12 * len(ps)}", "graphs": captured}
    for b in (1, batch):
        bps = _prompts([prompt_len] * b, seed=3 + b)
        blocks = b * ((prompt_len + steps) // 16 + 2)
        for name, make in (("eager", lambda: create_executor(fast, blocks, 16)),
                           ("graphs", lambda: _graph_executor(fast, blocks))):
            ex = make()
            _Chain([ex], blocks, 16).greedy(bps, 3)    # warm-up; graphs capture here (stale
            # cache slots the next chain reuses are masked: positions past a context)
            times: list = []
            _, gouts = _Chain([ex], blocks, 16).greedy(bps, steps, timer=times)
            figures[f"ms_{name}_b{b}"] = 1000 * sorted(times)[len(times) // 2]
            _greedy_agreement(ref, bps[:4], gouts[:4], tie=1e-3)
        figures[f"speedup_b{b}"] = round(figures[f"ms_eager_b{b}"] / figures[f"ms_graphs_b{b}"], 2)
    how = "captured" if cuda else "padded steps eagerly (no capture on the CPU)"
    return Row("executor.graphs", PASS, figures,
               f"{MODEL} float64 vs generate(); {model_id} float32 timing, prompts {prompt_len}; {how}")


def check_torch_engine(device) -> Row:
    import torch

    from raycolo.engine.base import SamplingParams
    from raycolo.engine.factory import create_engine

    ps = _prompts([9, 23, 14, 40])
    ref = _model(MODEL, "float64", "cpu").eval()
    refs = [_hf_greedy(ref, p, 16) for p in ps]
    engine = create_engine({"backend": "torch",
                            "model_loading_config": {"model_id": MODEL, "dtype": "float64"},
                            "engine_kwargs": {"device": str(device), "max_num_seqs": 8,
                                              "kv_cache_tokens": 4096, "cpu_threads": 1}})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    try:
        got = [o.token_ids for o in engine.generate(ps, params)]
        _require(got == refs, "engine tokens differ from transformers' generate()")
        figures = {"tokens_equal": f"{16 * len(ps)}/{16 * len(ps)}"}
        decode = [r.seconds for r in engine.stats.iterations if r.kind == "decode"]
        if decode:
            figures["ms_decode_iter"] = 1000 * sorted(decode)[len(decode) // 2]
        # seeded sampling (the sampler draws on the CPU) must not depend on the device
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
        drawn = [o.token_ids for o in engine.generate(ps, seeded)]
        if device.type != "cpu":
            cpu_engine = create_engine({"backend": "torch",
                                        "model_loading_config": {"model_id": MODEL, "dtype": "float64"},
                                        "engine_kwargs": {"device": "cpu", "max_num_seqs": 8,
                                                          "kv_cache_tokens": 4096}})
            try:
                cpu_drawn = [o.token_ids for o in cpu_engine.generate(ps, seeded)]
            finally:
                cpu_engine.release()
            _require(drawn == cpu_drawn, "seeded sampling on the device differs from the CPU engine's")
            figures["seeded_equal_cpu"] = f"{16 * len(ps)}/{16 * len(ps)}"
        else:
            _require(drawn == [o.token_ids for o in engine.generate(ps, seeded)], "seeded sampling not repeatable")
            figures["seeded_repeat"] = "ok"
        awake = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if engine.sleep():
            held = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            engine.wake_up()
            again = [o.token_ids for o in engine.generate(ps, params)]
            _require(again == refs, "tokens after sleep/wake_up differ")
            figures["sleep_wake"] = "ok"
            if held is not None:
                figures["MiB_awake"] = round(awake / 2**20, 1)
                figures["MiB_asleep"] = round(held / 2**20, 1)
                _require(held < awake, "sleep() freed no device memory")
        return Row("torch_engine", PASS, figures, "float64, continuous batching on the device")
    finally:
        engine.release()


def _stage_chain(device, dtype: str = "float64"):
    from raycolo.engine.executor.stage import LoraSettings, StageModel, add_lora

    lora = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3)
    chain = []
    for a, b in zip(CUTS[:-1], CUTS[1:]):
        model = add_lora(_model(MODEL, dtype, device), lora)
        chain.append(StageModel(model, (a, b), 64, 16, lr=lora.lr))
    return chain, lora


def _reference_training(lora, batch, steps: int, device):
    """peft's own whole-model steps (float64 on ``device``, see :func:`_reference`): the
    losses and the final LoRA state (on the CPU)."""
    import torch
    from peft import get_peft_model_state_dict

    from raycolo.engine.executor.stage import add_lora, causal_lm_loss

    whole = add_lora(_model(MODEL, "float64", device), lora)
    opt = torch.optim.AdamW([p for p in whole.parameters() if p.requires_grad], lr=lora.lr)
    ids, labels, lengths = batch
    ids, labels = ids.to(device), labels.to(device)
    mask = torch.tensor([[1] * n + [0] * (ids.shape[1] - n) for n in lengths], device=device)
    losses = []
    for _ in range(steps):
        loss = causal_lm_loss(whole(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().cpu() for k, v in get_peft_model_state_dict(whole).items()}


def _training_batch():
    from raycolo.engine.executor.stage import training_batch

    return training_batch([(p, p[1:6]) for p in _prompts([8, 13, 5], seed=4)])


def check_stage_inproc(device) -> Row:
    ps = _prompts([9, 23, 14])
    chain, lora = _stage_chain(device)
    rids = list(range(len(ps)))
    hidden = None
    for st in chain:
        hidden = st.forward(rids, ps, hidden)
    outs = [[int(t)] for t in hidden.argmax(-1).tolist()]
    for _ in range(11):
        hidden = None
        for st in chain:
            hidden = st.forward(rids, [[o[-1]] for o in outs], hidden)
        for o, t in zip(outs, hidden.argmax(-1).tolist()):
            o.append(int(t))
    ref = _reference(MODEL, device)      # a fresh LoRA (B = 0) is the base model
    _require(outs == [_hf_greedy(ref, p, 12) for p in ps], "stage serving tokens differ from generate()")
    for st in chain:
        for rid in rids:
            st.release(rid)
    batch = _training_batch()
    ids, labels, lengths = batch
    ref_losses, ref_state = _reference_training(lora, batch, 2, device)
    losses = []
    for task in range(2):
        x = ids.to(device)
        for st in chain[:-1]:
            x = st.train_forward(task, x, lengths)
        losses.append(float(chain[-1].train_forward(task, x, lengths, labels.to(device)).detach()))
        grad = None
        for st in reversed(chain):
            grad = st.train_backward(task, grad)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    _require(loss_diff < 1e-8, f"training losses {losses} vs peft's {ref_losses}")
    merged = {}
    for st in chain:
        merged.update({k: v.detach().cpu() for k, v in st.lora_state().items()})
    _require(set(merged) == set(ref_state), "LoRA state keys differ from peft's")
    wdiff = max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state)
    _require(wdiff < 1e-8, f"LoRA weights after 2 steps differ from peft's by {wdiff:.3g}")
    return Row("stage.inproc", PASS, {"tokens_equal": f"{12 * len(ps)}/{12 * len(ps)}",
                                      "loss_diff": loss_diff, "lora_diff": wdiff},
               f"{len(chain)} StageModels, serve + 2 LoRA steps vs peft")


# stage.p2p: each rank is a spawned process that runs the real StageProcess over a process group.
P2P_STEPS = 8
P2P_PROMPTS = (9, 23, 14)


def _p2p_rank(rank: int, backend: str, device_str: str, store_path: str, tokens_q, results_q) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from raycolo.engine.executor.stage_ops import ForwardStep, TrainBackward, TrainForward
        from raycolo.engine.executor.stage_process import StageProcess
        device = torch.device(device_str)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, 2)
        dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                                **({"device_id": device} if backend == "nccl" else {}))
        chain, _ = _stage_chain(device)
        st = chain[rank]
        proc = StageProcess(st, rank, 2, st.model.config.hidden_size, torch.float64, dist)
        ps = _prompts(P2P_PROMPTS)
        rids = list(range(len(ps)))
        counts = [len(p) for p in ps]
        outs = [[] for _ in ps]
        seq = 0
        for step in range(P2P_STEPS):
            seq += 1
            toks = ps if step == 0 else [[o[-1]] for o in outs]
            op = ForwardStep(prefill=step == 0, requests=rids, seq=seq, after=seq,
                             counts=counts if step == 0 else [1] * len(ps), tokens=toks if rank == 0 else None)
            result = proc.run(op)
            new = result.tokens if rank == 1 else tokens_q.get(timeout=120)
            if rank == 1:
                tokens_q.put(new)
            for o, t in zip(outs, new):
                o.append(int(t))
        # one pipelined training step: train_f on both stages, then train_b back
        samples = [(p, p[1:6]) for p in _prompts([8, 13, 5], seed=4)]
        ids, _, lengths = _training_batch()
        shape = list(ids.shape)
        f = TrainForward(task=1, samples=samples, shape=shape, lengths=lengths, seq=1000 + rank, after=1000,
                         beta=0.1)
        result = proc.run(f)
        proc.run(TrainBackward(task=1, shape=shape, seq=2000 + rank, after=2001))
        proc.received(list(proc.pending))
        dist.barrier()
        # numpy, not tensors: torch pickles tensors through shared memory, gone with this process
        state = {k: v.detach().cpu().numpy() for k, v in st.lora_state().items()}
        results_q.put((rank, {"tokens": outs, "loss": result.loss, "state": state}))
        dist.destroy_process_group()
    except BaseException as exc:     # noqa: BLE001 - reported as the row's failure
        results_q.put((rank, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                              "trace": traceback.format_exc(limit=6)}))


def check_stage_p2p(device) -> Row:
    import multiprocessing as mp
    import queue

    import torch

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus >= 2:
        backend, devices, how = "nccl", ["cuda:0", "cuda:1"], "NCCL, one GPU per stage"
    elif device.type == "cuda":
        backend, devices, how = "gloo", ["cuda:0", "cuda:0"], "gloo, both stages on one GPU"
    else:
        backend, devices, how = "gloo", ["cpu", "cpu"], "gloo on CPU"
    ctx = mp.get_context("spawn")
    tokens_q, results_q = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_p2p_rank, args=(r, backend, devices[r], store, tokens_q, results_q),
                             daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + 240
        try:
            while len(results) < 2 and time.monotonic() < deadline:
                try:
                    rank, res = results_q.get(timeout=1.0)
                except queue.Empty:
                    # both gone, or one died (a crash leaves its peer blocked in a receive)
                    if all(p.exitcode is not None for p in procs) or \
                            any(p.exitcode not in (None, 0) for p in procs):
                        break
                    continue
                results[rank] = res
                if "error" in res:
                    break
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
    errors = [f"stage {r}: {res['error']}" for r, res in sorted(results.items()) if "error" in res]
    _require(not errors, "; ".join(errors) + f" [{how}]")
    _require(len(results) == 2, f"stage processes ended without a result "
                                f"(exit codes {[p.exitcode for p in procs]}) [{how}]")
    ps = _prompts(P2P_PROMPTS)
    ref = _reference(MODEL, device)
    refs = [_hf_greedy(ref, p, P2P_STEPS) for p in ps]
    _require(results[0]["tokens"] == refs and results[1]["tokens"] == refs,
             f"pipelined greedy tokens differ from generate() [{how}]")
    from raycolo.engine.executor.stage import LoraSettings
    ref_losses, ref_state = _reference_training(LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3),
                                                _training_batch(), 1, device)
    loss_diff = abs(results[1]["loss"] - ref_losses[0])
    _require(loss_diff < 1e-8, f"pipelined loss {results[1]['loss']} vs peft's {ref_losses[0]} [{how}]")
    merged = {k: torch.from_numpy(v) for r in (0, 1) for k, v in results[r]["state"].items()}
    _require(set(merged) == set(ref_state), "LoRA state keys differ from peft's")
    wdiff = max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state)
    _require(wdiff < 1e-8, f"LoRA weights after the pipelined step differ by {wdiff:.3g} [{how}]")
    n = P2P_STEPS * len(ps)
    return Row("stage.p2p", PASS, {"tokens_equal": f"{n}/{n}", "loss_diff": loss_diff, "lora_diff": wdiff},
               f"StageProcess x2, {how}")


def check_device_stats(device) -> Row:
    import torch

    from raycolo.engine.device_stats import device_reading

    if device.type == "cuda":
        torch.cuda.empty_cache()        # a 1 GiB allocation below must reach the driver
        before = device_reading(device)
        _require(before["source"] == "nvml", f"source {before['source']!r}, not nvml")
        free, total = torch.cuda.mem_get_info(device)
        used_cuda = total - free
        _require(0 < before["memory_used_bytes"] <= before["memory_total_bytes"], f"used/total {before}")
        _require(abs(before["memory_total_bytes"] - total) <= 0.05 * total,
                 f"NVML total {before['memory_total_bytes']} vs CUDA's {total}")
        _require(abs(before["memory_used_bytes"] - used_cuda) <= 0.05 * total,
                 f"NVML used {before['memory_used_bytes']} vs CUDA's {used_cuda}")
        block = torch.ones(2**28, dtype=torch.float32, device=device)          # 1 GiB
        busy_until = time.monotonic() + 1.0
        a = torch.randn(4096, 4096, device=device)
        while time.monotonic() < busy_until:
            a = (a @ a).tanh_()
            _sync(device)               # keep the launch queue short: busy for about 1 s
        _sync(device)
        after = device_reading(device)
        grew = after["memory_used_bytes"] - before["memory_used_bytes"]
        del block, a
        torch.cuda.empty_cache()
        _require(grew >= 0.9 * 2**30, f"NVML used grew {grew} bytes after a 1 GiB allocation")
        util = after["utilization"]
        _require(util is not None and 0.0 <= util <= 1.0, f"utilization {util}")
        import pynvml
        from raycolo.engine.device_stats import _nvml_handle
        name = pynvml.nvmlDeviceGetName(_nvml_handle(device.index or 0))
        name = name.decode() if isinstance(name, bytes) else name
        _require(name == torch.cuda.get_device_name(device),
                 f"NVML device {name!r} is not torch's {torch.cuda.get_device_name(device)!r}")
        return Row("device_stats", PASS, {"used_GiB": round(before["memory_used_bytes"] / 2**30, 2),
                                          "total_GiB": round(before["memory_total_bytes"] / 2**30, 1),
                                          "alloc_seen_GiB": round(grew / 2**30, 2), "util_busy": util},
                   f"nvml, {name}")
    before = device_reading(device)
    _require(before["source"] == "process_rss", f"source {before['source']!r}")
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    _require(abs(before["memory_used_bytes"] - vmrss) <= 0.1 * vmrss, f"rss {before} vs VmRSS {vmrss}")
    block = torch.ones(2**26, dtype=torch.float32)      # 256 MiB, touched
    after = device_reading(device)
    grew = after["memory_used_bytes"] - before["memory_used_bytes"]
    del block
    # at least half: the allocator may reuse pages earlier checks freed that are still
    # resident (a fresh-clone run saw 230 MiB of 256 MiB)
    _require(grew >= 0.5 * 2**28, f"rss grew {grew} bytes after a 256 MiB allocation")
    _require(before["utilization"] is None, "a CPU reading has no utilization")
    return Row("device_stats", PASS, {"rss_MiB": round(before["memory_used_bytes"] / 2**20),
                                      "alloc_seen_MiB": round(grew / 2**20)}, "process_rss vs /proc VmRSS")


def check_vllm(device) -> Row:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:      # noqa: BLE001 - ImportError, or a wheel that fails to load
        return Row("vllm", SKIP, {}, f"vllm does not import here ({type(exc).__name__})")
    platform = str(current_platform.device_type)
    if platform != device.type:
        return Row("vllm", SKIP, {}, f"installed vllm runs on {platform!r}, not {device.type!r}")
    import torch

    from raycolo.engine.base import SamplingParams
    from raycolo.engine.factory import create_engine
    from raycolo.engine.models import save_tiny_checkpoint

    if device.type == "cuda":
        torch.cuda.empty_cache()     # vLLM wants gpu_memory_utilization (0.9) of the device free

    ps = _prompts([9, 23, 14, 40])
    ref = _model(MODEL, "float64", "cpu").eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_checkpoint(MODEL, tmp, seed=0)
        kwargs = {"max_num_seqs": 8, "kv_cache_tokens": 8192}
        if platform == "cpu":
            kwargs["block_size"] = 32
        engine = create_engine({"backend": "vllm",
                                "model_loading_config": {"model_id": str(path), "dtype": "float32"},
                                "engine_kwargs": kwargs})
        try:
            t0 = time.perf_counter()
            outs = [o.token_ids for o in engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=32,
                                                                            ignore_eos=True))]
            elapsed = time.perf_counter() - t0
            load_s = engine.stats.load_seconds
        finally:
            engine.release()
    same, total, gap = _greedy_agreement(ref, ps, outs, tie=1e-3)
    return Row("vllm", PASS, {"greedy_equal": f"{same}/{total}", "max_gap": gap,
                              "tok_s": round(total / elapsed), "load_s": round(load_s, 1)},
               f"vllm {vllm.__version__} float32 vs transformers float64 (teacher-forced)")


CHECKS: dict[str, Callable] = {
    "executor.whole": check_executor_whole,
    "executor.slices": check_executor_slices,
    "executor.windows": check_executor_windows,
    "executor.decode": check_executor_decode,
    "executor.graphs": check_executor_graphs,
    "torch_engine": check_torch_engine,
    "stage.inproc": check_stage_inproc,
    "stage.p2p": check_stage_p2p,
    "device_stats": check_device_stats,
    "vllm": check_vllm,
}


def run_checks(device, only=None, log=print) -> list[Row]:
    rows = []
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            row = fn(device)
        except Exception as exc:   # noqa: BLE001 - every failure is a row, the rest still run
            msg = str(exc).strip().splitlines()
            row = Row(name, FAIL, {}, f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300])
            if not isinstance(exc, CheckFailed):
                traceback.print_exc(limit=4, file=sys.stderr)
        row.seconds = round(time.perf_counter() - started, 1)
        rows.append(row)
        log(f"  {row.path}: {row.result} ({row.seconds} s)")
    return rows


def table(rows: list[Row]) -> str:
    cells = [("path", "result", "figures")] + [(r.path, r.result, r.figures_text()) for r in rows]
    w0 = max(len(c[0]) for c in cells)
    w1 = max(len(c[1]) for c in cells)
    lines = [f"{a:<{w0}} | {b:<{w1}} | {c}" for a, b, c in cells]
    lines.insert(1, f"{'-' * w0}-+-{'-' * w1}-+-{'-' * 40}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycolo.engine.gpu_check",
                                     description="Run raycolo's CUDA paths against independent references.")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto/cuda: the first CUDA device (skipped without one); cpu: a dry run "
                             "of the same checks on the CPU")
    parser.add_argument("--only", default="", help=f"comma-separated rows ({', '.join(CHECKS)})")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown rows {unknown}")

    import torch

    if args.device == "cpu":
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("skipped: no CUDA device")
        print(f"(torch {torch.__version__}: "
              f"{'built without CUDA' if torch.version.cuda is None else 'no device visible'})", file=sys.stderr)
        if args.json:
            _write_json(args.json, {"device": None, "skipped": "no CUDA device", "rows": []})
        return 0
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu-check on {name} (torch {torch.__version__}, {torch.cuda.device_count() if device.type == 'cuda' else 0} "
          f"CUDA devices)", flush=True)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)    # a dry run: one thread never spins against a busy machine
    started = time.perf_counter()
    try:
        rows = run_checks(device, only, log=lambda s: print(s, flush=True))
    finally:
        torch.set_num_threads(threads)
    print()
    print(table(rows))
    failed = [r.path for r in rows if r.result == FAIL]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} rows passed or skipped in "
          f"{time.perf_counter() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if args.json:
        _write_json(args.json, {"device": name, "torch": torch.__version__,
                                "rows": [asdict(r) for r in rows]})
    return 1 if failed else 0


def _write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
