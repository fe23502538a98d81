"""Harli's two-stage decode-latency predictor (Harli §5), fitted by least squares.

Stage 1, solo run (Harli eq. 2): the latency of one decode iteration of ``bs`` sequences
whose context is ``seqlen`` tokens on average is

    solo(bs, seqlen) = bs * b0 + c0 + bs * k0 * seqlen

Stage 2, co-located with fine-tuning (Harli eq. 3): with a share ``s_inf`` of the device
for inference and ``s_ft`` for the fine-tune task,

    colo(bs, seqlen, s_inf, s_ft) = (s_inf * b1 + s_ft * k1) * solo_at_share(bs, seqlen, s_inf)

Harli measures ``solo_at_share`` per SM ratio on the GPU. Where the share is time at
iteration granularity (the CPU, or a GPU without SM partitioning), an iteration at share
``s_inf`` gets the whole device for ``s_inf`` of the time, so ``solo_at_share = solo /
s_inf``; the factor ``(s_inf * b1 + s_ft * k1)`` then captures the interference left over
(caches, memory bandwidth, the switch). Both stages are linear in their coefficients.
Stage 1's are costs: it is fitted by non-negative least squares on relative errors (each
iteration weighs by one over its latency, as the held-out MAPE does; a plain ``lstsq`` let
the large batches pull the fixed cost ``c0`` below zero on a noisy CPU). Stage 2 is fitted
with ``numpy.linalg.lstsq``. Both come from measured iterations (``raycolo profile``
records them); :func:`mape` reports the error on held-out iterations (Harli reports 3 %
for stage 1 and about 5 % for stage 2).

Pure Python and numpy: the simulator and the live node scheduler share it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from raycolo.lsq import scaled_nnls


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode iteration: batch size, mean context length, the inference and
    fine-tune shares it ran under (1 and 0 for a solo run) and its latency in seconds."""

    bs: int
    seqlen: float
    latency_s: float
    share_inference: float = 1.0
    share_finetune: float = 0.0

    @property
    def solo(self) -> bool:
        return self.share_finetune <= 0 and self.share_inference >= 1


@dataclass(frozen=True)
class DecodeLatencyPredictor:
    b0: float
    c0: float
    k0: float
    b1: float = 1.0
    k1: float = 0.0

    def solo(self, bs: int, seqlen: float) -> float:
        """Stage 1: one decode iteration with the whole device."""
        return bs * self.b0 + self.c0 + bs * self.k0 * seqlen

    def colocated(self, bs: int, seqlen: float, share_inference: float, share_finetune: float) -> float:
        """Stage 2: one decode iteration with ``share_inference`` of the device while the
        fine-tune task has ``share_finetune``."""
        if not 0 < share_inference <= 1 or not 0 <= share_finetune <= 1:
            raise ValueError(f"shares must be in (0, 1] and [0, 1], got {share_inference}, {share_finetune}")
        factor = share_inference * self.b1 + share_finetune * self.k1
        return factor * self.solo(bs, seqlen) / share_inference

    def smallest_share(self, bs: int, seqlen: float, tpot_target_s: float,
                       shares: Sequence[float] = tuple(i / 10 for i in range(1, 11))) -> Optional[float]:
        """Harli's per-iteration decision: the smallest inference share (the fine-tune task
        gets the rest) whose predicted latency meets ``tpot_target_s``; None when even the
        whole device misses it (fine-tuning pauses)."""
        for share in sorted(shares):
            rest = 1.0 - share
            latency = self.solo(bs, seqlen) if rest <= 0 else self.colocated(bs, seqlen, share, rest)
            if latency <= tpot_target_s:
                return share
        return None

    def predict(self, sample: DecodeSample) -> float:
        if sample.solo:
            return self.solo(sample.bs, sample.seqlen)
        return self.colocated(sample.bs, sample.seqlen, sample.share_inference, sample.share_finetune)


def fit(samples: Iterable[DecodeSample]) -> DecodeLatencyPredictor:
    """Both stages by least squares: stage 1 on the solo iterations, stage 2 on the
    co-located ones (their latency over the stage-1 prediction at their share). Without
    co-located iterations the factor stays 1 (``b1 = 1, k1 = 0``)."""
    samples = list(samples)
    solo = [s for s in samples if s.solo]
    colo = [s for s in samples if not s.solo]
    if len(solo) < 3:
        raise ValueError(f"fit: need at least 3 solo decode iterations, got {len(solo)}")
    x = np.array([[s.bs, 1.0, s.bs * s.seqlen] for s in solo])
    y = np.array([s.latency_s for s in solo])
    if np.linalg.matrix_rank(x) < 3:
        raise ValueError("fit: the solo iterations need at least two batch sizes and two context lengths")
    b0, c0, k0 = scaled_nnls(x, y, weights=1.0 / np.maximum(y, 1e-12))
    stage1 = DecodeLatencyPredictor(float(b0), float(c0), float(k0))
    if len(colo) < 2:
        return stage1
    x2 = np.array([[s.share_inference, s.share_finetune] for s in colo])
    y2 = np.array([s.latency_s * s.share_inference / stage1.solo(s.bs, s.seqlen) for s in colo])
    b1, k1 = np.linalg.lstsq(x2, y2, rcond=None)[0]
    return DecodeLatencyPredictor(stage1.b0, stage1.c0, stage1.k0, float(b1), float(k1))


def mape(predictor: DecodeLatencyPredictor, samples: Iterable[DecodeSample]) -> float:
    """Mean absolute percentage error of ``predictor`` on ``samples`` (held-out ones)."""
    errors = [abs(predictor.predict(s) - s.latency_s) / s.latency_s for s in samples if s.latency_s > 0]
    if not errors:
        raise ValueError("mape: no samples with a positive latency")
    return float(np.mean(errors))
