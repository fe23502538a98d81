"""gpu-check's ``sampler`` row: a decode's batches sampled on the device, the penalties
read from the history kept there across steps (raycolo/generation/penalty_history.py),
against the same rows and logits sampled on the CPU with the history built afresh at
every step; then, on a GPU, one step's time at batch 256 and Llama 3's vocabulary with the
history kept and built afresh."""
from __future__ import annotations

import random
import statistics
import time

from raycolo.gpu_check.common import PASS, Row, _require, _sync

VOCAB = 4096
BATCH = 48
STEPS = 24
TIMED_BATCH, TIMED_VOCAB, TIMED_STEPS = 256, 128256, 10


def _params():
    from raycolo.engine.base import SamplingParams as P

    return [P(max_tokens=999, repetition_penalty=1.3),
            P(max_tokens=999, temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.2),
            P(max_tokens=999, temperature=1.0, top_k=50, repetition_penalty=1.1),
            P(max_tokens=999, logit_bias={5: 3.0, 9: -2.0}, frequency_penalty=0.4),
            P(max_tokens=999, temperature=0.7, min_p=0.05, repetition_penalty=0.9),
            P(max_tokens=999)]


def _requests(rng: random.Random, keys, vocab: int) -> dict:
    params = _params()
    return {k: [params[k % len(params)], 1000 + k, [rng.randrange(vocab) for _ in range(rng.randrange(4, 200))], []]
            for k in keys}


def _compare(device) -> dict:
    import torch

    from raycolo.generation.penalty_history import PenaltyHistory
    from raycolo.generation.rows import SamplingRow
    from raycolo.generation.sampler import processed_logits, sample

    rng = random.Random(7)
    live, history = _requests(rng, range(BATCH), VOCAB), PenaltyHistory()
    drawn = drawn_equal = greedy = 0
    worst = 0.0
    for step in range(STEPS):
        if step == STEPS // 2:      # a quarter of the requests leave, new ones come
            for k in list(live)[:BATCH // 4]:
                del live[k]
                history.forget(k)
            live.update(_requests(rng, range(1000 + step, 1000 + step + BATCH // 4), VOCAB))
        rows = [SamplingRow.of(p, seed, out, prompt, key=k) for k, (p, seed, prompt, out) in live.items()]
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step)) * 4
        ours = processed_logits(logits.to(device), rows, history=history).cpu()
        theirs = processed_logits(logits, rows)
        _require(torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), f"step {step}: excluded tokens differ")
        finite = torch.isfinite(theirs)
        worst = max(worst, float((ours[finite] - theirs[finite]).abs().max()))
        on_device, on_cpu = sample(logits.to(device), rows, history=history).tokens, sample(logits, rows).tokens
        for row, a, b in zip(rows, on_device, on_cpu):
            if row.params.greedy:
                greedy += 1
                _require(a == b, f"step {step}: a greedy row took {a} on {device}, {b} on the CPU")
            else:
                drawn += 1
                drawn_equal += a == b
        for (p, seed, prompt, out), token in zip(live.values(), on_device):
            out.append(token)
    _require(worst <= 1e-4, f"processed logits differ by {worst:.2e}")
    # a draw may differ only where two tokens tie to the last bit of the softmax
    _require(drawn_equal >= 0.99 * drawn, f"{drawn - drawn_equal} of {drawn} draws differ from the CPU's")
    return {"steps": STEPS, "greedy_equal": f"{greedy}/{greedy}", "draws_equal": f"{drawn_equal}/{drawn}",
            "max_logit_diff": worst}


def _timed(device) -> dict:
    """Median ms of one sampling step (penalties, top-p, draws) at batch 256 over Llama 3's
    vocabulary: with the history kept, and built afresh (every id of every row uploaded)."""
    import numpy as np
    import torch

    from raycolo.engine.base import SamplingParams
    from raycolo.generation.penalty_history import PenaltyHistory
    from raycolo.generation.rows import SamplingRow
    from raycolo.generation.sampler import sample

    rng = random.Random(3)
    params = SamplingParams(max_tokens=999, temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2)
    prompts = [np.asarray([rng.randrange(TIMED_VOCAB) for _ in range(512)], dtype=np.int64)
               for _ in range(TIMED_BATCH)]
    outs = [[rng.randrange(TIMED_VOCAB) for _ in range(128)] for _ in range(TIMED_BATCH)]
    logits = torch.randn(TIMED_BATCH, TIMED_VOCAB, device=device, dtype=torch.bfloat16)
    out = {}
    for name, history in (("kept", PenaltyHistory()), ("afresh", None)):
        times = []
        for step in range(TIMED_STEPS + 2):
            rows = [SamplingRow.of(params, i, outs[i], prompts[i], key=i) for i in range(TIMED_BATCH)]
            _sync(device)
            started = time.perf_counter()
            tokens = sample(logits, rows, history=history).tokens       # ends with its device-to-host copy
            times.append(time.perf_counter() - started)
            for o, t in zip(outs, tokens):
                o.append(t)
        out[f"b{TIMED_BATCH}_ms_{name}"] = round(1000 * statistics.median(times[2:]), 2)
    return out


def check_sampler(device) -> Row:
    figures = _compare(device)
    if device.type == "cuda":
        figures.update(_timed(device))
    return Row("sampler", PASS, figures, f"kept history on {device.type} vs afresh on the CPU")
