"""gpu-check's rows for the decode fast path: ``executor.triton`` (the Triton paged
attention kernel, on its own and inside the executor) and ``stage.graphs`` (an online
stage with LoRA decoding through CUDA graphs, every adapter variant)."""
from __future__ import annotations

import os

from raycolo.gpu_check.common import (CUTS, MODEL, PASS, SKIP, Row, _Chain, _model, _prompts, _random_lora_b,
                                      _require, _train_chain)
from raycolo.gpu_check.references import _greedy_agreement, _reference


def _triton_missing(device) -> str:
    """Why the Triton kernel cannot run here ('' where it can)."""
    from raycolo.engine.executor.attention import triton_installed

    if not triton_installed():
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "on the CPU the Triton kernel runs only under TRITON_INTERPRET=1"
    return ""


def _kernel_error(device, dtype, window, tiles: bool) -> float:
    """Largest error of the kernel against dense float64 attention over K/V blocks
    scattered through a cache: decode queries (split-K where the batch is small) or query
    tiles of prefill chunks, GQA group 4, head_dim 64, optional sliding window."""
    import torch

    from raycolo.engine.executor import triton_attention
    from raycolo.engine.executor.batch import query_tiles

    gen = torch.Generator().manual_seed(11)
    kv_heads, group, d, bs = 2, 4, 64, 16
    lengths = [1, 17, 200, 64]
    nb = [-(-n // bs) for n in lengths]
    order = torch.randperm(sum(nb) + 3, generator=gen).tolist()
    key = torch.zeros(len(order), kv_heads, d, bs)
    value = torch.zeros(len(order), kv_heads, bs, d)
    seqs, flat, starts = [], [], []
    for n, b in zip(lengths, nb):
        table, order = order[:b], order[b:]
        k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
        for t in range(n):
            key[table[t // bs], :, :, t % bs] = k[t]
            value[table[t // bs], :, t % bs, :] = v[t]
        seqs.append((k, v))
        starts.append(len(flat))
        flat += table
    if tiles:      # chunks of every sequence's last tokens (up to 20)
        queries = [(s, p) for s, n in enumerate(lengths) for p in range(max(0, n - 20), n)]
        tiled = query_tiles([min(n, 20) for n in lengths], device)
    else:
        queries, tiled = [(s, n - 1) for s, n in enumerate(lengths)], None
    q = torch.randn(len(queries), kv_heads * group, d, generator=gen)
    as_dev = lambda x: x.to(device=device, dtype=dtype)           # noqa: E731
    long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    out = triton_attention.paged_attention(
        as_dev(q), as_dev(key), as_dev(value), long(flat), long([starts[s] for s, _ in queries]),
        long([p for _, p in queries]), window, d ** -0.5, tiled).double().cpu()
    worst = 0.0
    for row, (s, p) in enumerate(queries):
        lo = 0 if window is None else max(0, p - window + 1)
        k, v = (x[lo:p + 1].to(dtype).double().repeat_interleave(group, dim=1) for x in seqs[s])
        w = torch.einsum("hd,thd->ht", q[row].to(dtype).double(), k).mul(d ** -0.5).softmax(-1)
        worst = max(worst, float((out[row] - torch.einsum("ht,thd->hd", w, v)).abs().max()))
    return worst


def _pointwise_error(device, dtype) -> float:
    """Largest difference of the Triton pointwise kernels (add + RMSNorm, rotary, SiLU * up)
    from transformers' LlamaRMSNorm and apply_rotary_pos_emb and torch's silu in ``dtype``,
    relative to the largest magnitude of each result."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from raycolo.engine.executor import triton_pointwise as ops
    from raycolo.engine.executor.kv_cache import PagedKVCache

    gen = torch.Generator().manual_seed(2)
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())  # noqa: E731
    errors = []
    with torch.inference_mode():
        norm = LlamaRMSNorm(4096, eps=1e-5).to(device=device, dtype=dtype)
        r, x = (torch.randn(7, 4096, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        total = r + x
        errors.append(rel(ops.add_rms_norm(r, x, norm.weight, 1e-5), norm(total)))
        q, k, v = (torch.randn(5, h, 128, generator=gen).to(device=device, dtype=dtype) for h in (32, 8, 8))
        angle = torch.rand(5, 64, generator=gen) * 100
        cos, sin = (torch.cat([f(angle)] * 2, -1).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
        eq, ek = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        cache = PagedKVCache(1, 4, 16, 8, 128, dtype, device)
        ops.rope_and_write(q, k, v, cos, sin, torch.arange(5, device=device) * 3, cache.keys[0], cache.values[0])
        errors.append(rel(q, eq))
        gate, up = (torch.randn(5, 14336, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        errors.append(rel(ops.silu_mul(gate.clone(), up), torch.nn.functional.silu(gate) * up))
    return max(errors)


def check_executor_triton(device) -> Row:
    """The Triton paged attention kernel (executor/triton_attention.py) against dense
    attention (float32, and bfloat16 on a GPU), then a float32 executor on it, with decode
    steps as CUDA graphs on a GPU, teacher-forced against transformers in float64."""
    import torch

    from raycolo.engine.executor import ModelExecutor
    from raycolo.engine.executor.attention import AttentionKernel
    from raycolo.engine.executor.graphs import enable_padded_decode

    missing = _triton_missing(device)
    if missing:
        return Row("executor.triton", SKIP, {}, missing)
    cuda = device.type == "cuda"
    figures = {}
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)) if cuda else ((torch.float32, 2e-4),):
        name = str(dtype).split(".")[-1]
        combos = [(w, t) for w in (None, 37) for t in (False, True)] if cuda else [(37, False), (None, True)]
        errors = [_kernel_error(device, dtype, w, t) for w, t in combos]
        figures[f"kernel_err_{name}"] = max(errors)
        _require(max(errors) < tol, f"{name} kernel differs from dense attention by {max(errors):.3g}")
    if cuda:
        figures["pointwise_bf16_err"] = _pointwise_error(device, torch.bfloat16)
        _require(figures["pointwise_bf16_err"] <= 1e-2, "bf16 pointwise kernels differ from transformers' "
                                                        f"modules by {figures['pointwise_bf16_err']:.3g}")
    ps = _prompts([9, 23, 14, 40] if cuda else [9, 23])        # the interpreter: fewer, shorter
    model = _model(MODEL, "float32", device)
    ex = ModelExecutor(model, 64, 16, attention=AttentionKernel.TRITON, cuda_graphs=cuda)
    if not cuda:
        enable_padded_decode(ex, capture=False)
    first, outs = _Chain([ex], 64, 16).greedy(ps, 10 if cuda else 5)
    same, total, gap = _greedy_agreement(_reference(MODEL, "cpu"), ps, outs, tie=1e-3)
    captured = sum(g.graph is not None for g in ex.graphs.graphs.values())
    _require(captured > 0 if cuda else captured == 0, f"{captured} graphs captured")
    figures.update(greedy_equal=f"{same}/{total}", worst_gap=gap, graphs=captured)
    return Row("executor.triton", PASS, figures,
               f"kernel vs dense float64 (decode, split-K, prefill tiles, window 37); {MODEL} float32 "
               f"{'with CUDA graphs' if cuda else 'padded steps (interpreter)'} vs transformers")


def check_stage_graphs(device) -> Row:
    """A LoRA stage chain decoding through CUDA graphs (padded steps run eagerly on the
    CPU) against the same chain run eagerly: rows on the latest adapter and rows on the
    base model in one step, before and after a training step changes the adapter."""
    from raycolo.engine.executor.graphs import enable_padded_decode
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora, training_batch

    cuda = device.type == "cuda"
    lora = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3)

    def chain(graphs: bool):
        out = []
        for a, b in zip(CUTS[:-1], CUTS[1:]):
            st = StageModel(add_lora(_model(MODEL, "float32", device), lora), (a, b), 64, 16,
                            lr=lora.lr, cuda_graphs=graphs and cuda)
            if graphs and not cuda:
                enable_padded_decode(st.executor, capture=False)
            _random_lora_b(st)
            out.append(st)
        return out

    fast, slow = chain(True), chain(False)
    # two base rows and two latest ones: both passes pad to one shape, so only the adapter
    # state keeps their graphs apart (on every stage, the later ones included)
    ps = _prompts([9, 23, 14, 5])
    rids, base = [0, 1, 2, 3], [1, 3]
    worst = 0.0

    def step(stages, toks):
        hidden = None
        for st in stages:
            hidden = st.forward(rids, toks, hidden, base=base)
        return hidden

    a, b = step(fast, ps), step(slow, ps)
    for rnd in range(2):
        for _ in range(6):
            worst = max(worst, float((a - b).abs().max()))
            toks = [[int(t)] for t in b.argmax(-1).tolist()]
            a, b = step(fast, toks), step(slow, toks)
        if rnd == 0:     # one training step on both chains: the graphs must see the new weights
            batch = training_batch([(p, p[1:6]) for p in _prompts([8, 13], seed=4)])
            for stages in (fast, slow):
                _train_chain(stages, batch, device, 7)
    _require(worst < 1e-4, f"graphed stage logits differ from eager ones by {worst:.3g}")
    for st in fast:
        keys = {k[0][0] for k in st.executor.graphs.graphs}
        _require(keys == {False, True}, f"layers [{st.first}, {st.last}): adapter states with graphs: {sorted(keys)}")
    captured = sum(g.graph is not None for st in fast for g in st.executor.graphs.graphs.values())
    _require(captured > 0 if cuda else captured == 0, f"{captured} graphs captured")
    return Row("stage.graphs", PASS, {"max_abs_diff": worst, "graphs": captured},
               f"{MODEL} float32, LoRA rank 4, latest and base rows, a training step in between")


def check_tp(device) -> Row:
    """Tensor parallelism (executor/tensor_parallel.py, tp_ranks.py): rank 0 here, rank 1 a
    spawned process, over NCCL where there are two GPUs, else gloo (two ranks sharing one
    GPU, or the CPU): float64 greedy tokens and logits against the unsplit executor and
    transformers' generate() on the device."""
    from raycolo.engine.executor import ModelExecutor
    from raycolo.engine.executor.tp_ranks import LocalRanks, RankSpec
    from raycolo.gpu_check.references import _hf_greedy

    ps = _prompts([9, 23, 14])
    steps = 10 if device.type == "cuda" else 6
    whole = ModelExecutor(_model(MODEL, "float64", device), 64, 16)
    first_ref, ref = _Chain([whole], 64, 16).greedy(ps, steps)
    ranks = LocalRanks(2, device.type)
    try:
        # as a tp replica loads: each rank's model in host memory, only its shard on the device
        leader = ranks.load(RankSpec(MODEL, 0, "float64", device.type, 64, 16),
                            _model(MODEL, "float64", "cpu"))
        first, outs = _Chain([leader], 64, 16).greedy(ps, steps)
        backend = ranks.backend
    finally:
        ranks.close()
    diff = float((first - first_ref).abs().max())
    _require(diff < 1e-9, f"tp=2 prefill logits differ from tp=1 by {diff:.3g}")
    _require(outs == ref, "tp=2 greedy tokens differ from tp=1")
    hf = _reference(MODEL, device)
    _require(outs == [_hf_greedy(hf, p, steps) for p in ps], "tp=2 greedy tokens differ from generate()")
    n = steps * len(ps)
    return Row("tp", PASS, {"tokens_equal": f"{n}/{n}", "max_abs_diff": diff, "backend": backend},
               f"{MODEL} float64, tp=2 (rank 1 a spawned process) vs tp=1 and generate()")
