"""Non-negative least squares, numpy only: the cost model's fit, Harli's decode predictor and
the sampler's line share it. Latencies are sums of non-negative costs, so every fitted
coefficient here is a cost and may not go below zero."""
from __future__ import annotations

from typing import Optional

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """Lawson-Hanson non-negative least squares: ``argmin ||a x - b||`` over ``x >= 0``."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 1e-10 * max(1.0, np.abs(w).max(initial=0.0))
    for _ in range(max_iter):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
        w = a.T @ (b - a @ x)
    return x


def scaled_nnls(x: np.ndarray, y: np.ndarray, weights: Optional[np.ndarray] = None) -> np.ndarray:
    """:func:`nnls` with each column scaled to a maximum of 1 (features in seconds, TFLOPs and
    tokens differ by many orders of magnitude) and each row multiplied by ``weights``
    (``1 / y`` fits relative errors, the measure a MAPE reports)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if weights is not None:
        x = x * weights[:, None]
        y = y * weights
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    return nnls(x / scale, y) / scale
