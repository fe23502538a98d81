"""Fitting the per-iteration latency model to measured iterations.

Each measured iteration gives (kind, n sequences, tokens, per-GPU FLOPs, seconds). The
model is SamuLLM's Eq. 5 with the constant parts folded into the per-bucket intercept:

    seconds = a[b(n)] + c[b(n)] * TFLOPs + p1 * tokens + s1 * n

solved by non-negative least squares (coefficients are times, never negative).
Buckets without samples borrow the nearest bucket that has some.

The full sampler (temperature, penalties, ``min_tokens``, logprobs) costs more than the
plain argmax: on a CPU about half a millisecond per decode iteration, a quarter of a small
model's step. Its extra cost ``f0 + f1 * n`` is timed directly on the engine
(:func:`raycolo.offline.profiler.time_full_sampler`: the same prompts decoded greedily
and drawn, alternating, so the machine's drift cancels), taken off the decode iterations
that ran it, and stored in the profile; a regression on the engine's iterations could
not separate it from that drift.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from raycolo.batching.step_scheduler import StepKind
from raycolo.lsq import scaled_nnls
from raycolo.offline.costmodel.latency import DEFAULT_BUCKETS, IterationLatency, LatencyProfile

MIN_SAMPLES_PER_BUCKET = 3
# An iteration that took this many times the fit's prediction is not the engine's steady
# cost but a one-off (a Triton kernel compiled on first use of a shape, a page-in, another
# tenant's burst on a shared VM): it is dropped and the fit repeated without it.
OUTLIER_RATIO = 4.0


@dataclass
class IterationSample:
    kind: StepKind
    num_seqs: int
    tokens: int        # prompt tokens (prefill) or attended tokens (decode)
    flops: float       # per-GPU FLOPs of the iteration
    seconds: float
    plain_sampling: bool = True    # False: the full sampler ran (IterationRecord.plain_sampling)


def samples_from_records(records: Iterable, latency: IterationLatency) -> list[IterationSample]:
    """Turn engine IterationRecords into samples, FLOPs computed as the simulator does."""
    out = []
    for r in records:
        tokens = sum(r.context_lens)
        if r.kind == StepKind.PREFILL:
            flops = latency.prefill_flops(tokens, sum(c * c for c in r.context_lens))
        else:
            flops = latency.decode_flops(r.num_seqs, tokens)
        out.append(IterationSample(r.kind, r.num_seqs, tokens, flops, r.seconds, r.plain_sampling))
    return out


def _fit_part(samples: Sequence[IterationSample], buckets: list[int]):
    """NNLS of one iteration kind; returns per-bucket (intercept, slope), per-token, per-seq."""
    n = np.array([s.num_seqs for s in samples])
    tflops = np.array([s.flops for s in samples]) / 1e12
    tokens = np.array([s.tokens for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples])
    b = np.minimum(np.searchsorted(np.asarray(buckets), n, side="left"), len(buckets) - 1)
    # A bucket needs a few samples to pin its line; thin ones join the nearest full bucket.
    counts = np.bincount(b, minlength=len(buckets))
    full = [i for i in range(len(buckets)) if counts[i] >= MIN_SAMPLES_PER_BUCKET] or [int(np.argmax(counts))]
    b = np.array([min(full, key=lambda f: (abs(f - v), f)) for v in b.tolist()])
    used = sorted(set(b.tolist()))
    col = {bk: i for i, bk in enumerate(used)}
    k = len(used)
    x = np.zeros((len(samples), 2 * k + 2))
    rows = np.arange(len(samples))
    x[rows, [col[v] for v in b]] = 1.0
    x[rows, [k + col[v] for v in b]] = tflops
    x[:, 2 * k] = tokens
    x[:, 2 * k + 1] = n
    coef = scaled_nnls(x, y)
    intercept = np.empty(len(buckets))
    slope = np.empty(len(buckets))
    for i in range(len(buckets)):
        nearest = min(used, key=lambda u: (abs(u - i), u))
        intercept[i] = coef[col[nearest]]
        slope[i] = coef[k + col[nearest]]
    return (intercept.tolist(), slope.tolist(), float(coef[2 * k]), float(coef[2 * k + 1]),
            x @ coef, y, [buckets[u] for u in used])


def _robust_fit_part(samples: Sequence[IterationSample], buckets: list[int]):
    """:func:`_fit_part`, then again without the iterations that took more than
    ``OUTLIER_RATIO`` times its prediction; the count dropped comes last."""
    fitted = _fit_part(samples, buckets)
    pred, y = fitted[4], fitted[5]
    keep = y <= OUTLIER_RATIO * pred
    if keep.all() or keep.sum() < 4:
        return fitted + (0,)
    return _fit_part([s for s, k in zip(samples, keep) if k], buckets) + (int((~keep).sum()),)


def fit_profile(samples: Sequence[IterationSample], model: str, tp: int, load_s: float,
                buckets: Sequence[int] = DEFAULT_BUCKETS, separate_prefill: bool = True,
                full_sampler: tuple[float, float] = (0.0, 0.0)) -> tuple[LatencyProfile, dict]:
    """Fit a LatencyProfile; returns it with fit statistics (R², median |error|, the
    iterations dropped as outliers: more than ``OUTLIER_RATIO`` times the first fit).

    With ``separate_prefill`` prefill and decode iterations get their own coefficients;
    otherwise one set serves both, as in the paper. ``full_sampler`` is the full sampler's
    extra (seconds, seconds per sequence) per decode iteration, timed apart: taken off the
    decode iterations that ran it before the fit, and kept in the profile.
    """
    buckets = list(buckets)
    f0, f1 = full_sampler
    samples = [replace(s, seconds=max(s.seconds - f0 - f1 * s.num_seqs, 0.0))
               if s.kind == StepKind.DECODE and not s.plain_sampling else s for s in samples]
    decode = [s for s in samples if s.kind == StepKind.DECODE] if separate_prefill else list(samples)
    prefill = [s for s in samples if s.kind == StepKind.PREFILL] if separate_prefill else []
    if len(decode) < 4 or (separate_prefill and len(prefill) < 4):
        raise ValueError("need at least 4 measured iterations of each kind to fit a profile")
    intercept, slope, per_token, per_seq, pred, y, used, dropped = _robust_fit_part(decode, buckets)
    extra = {}
    if separate_prefill:
        p_int, p_slope, p_tok, p_seq, p_pred, p_y, _, p_dropped = _robust_fit_part(prefill, buckets)
        dropped += p_dropped
        extra = dict(prefill_intercept_s=p_int, prefill_s_per_tflop=p_slope,
                     prefill_s_per_token=p_tok, prefill_s_per_seq=p_seq)
        pred, y = np.concatenate([pred, p_pred]), np.concatenate([y, p_y])
    profile = LatencyProfile(
        model=model, tp=tp, source="measured", buckets=buckets,
        compute_intercept_s=intercept, compute_s_per_tflop=slope,
        prepare_intercept_s=0.0, prepare_s_per_token=per_token,
        sample_intercept_s=0.0, sample_s_per_seq=per_seq, load_s=load_s,
        full_sampler_intercept_s=f0, full_sampler_s_per_seq=f1, **extra)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-30
    stats = {"samples": len(samples), "r2": 1 - ss_res / ss_tot,
             "median_abs_error": float(np.median(np.abs(pred - y) / np.maximum(y, 1e-12))),
             "buckets_measured": used, "outlier_iterations": dropped}
    return profile, stats
