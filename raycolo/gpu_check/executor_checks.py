"""gpu-check's ``executor.*`` rows: ModelExecutor whole, in slices, with windows, float32
decode timing, and decode steps as CUDA graphs."""
from __future__ import annotations

from raycolo.gpu_check.common import CUTS, MODEL, PASS, Row, _Chain, _logits_tol, _model, _prompts, _require
from raycolo.gpu_check.references import _greedy_agreement, _hf_greedy, _hf_last_logits, _reference


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
