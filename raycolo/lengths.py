"""Length distributions: how many tokens (or chunks) a request has. One model and one
sampler for the application graphs (``input_tokens``, ``chunks``) and the online
workloads (the query and decode lengths of ``raycolo.online.tasks``)."""
from __future__ import annotations

import functools
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from raycolo.bounds import MAX_TOKENS, Strict, Tokens


class LengthDistribution(Strict):
    """A distribution of token (or chunk) counts, clipped to [min, max]."""

    distribution: Literal["lognormal", "uniform", "fixed"] = Field(default="lognormal", description=(
        "The distribution's shape: lognormal (give mean or median, and sigma), uniform (whole numbers from min "
        "to max, equally likely) or fixed (always value). Every draw is rounded to a whole number and clipped "
        "to [min, max]."))
    min: Tokens = Field(default=1, description="The smallest count a draw may take; draws below it are raised to it.")
    max: Tokens = Field(description="The largest count a draw may take; draws above it are lowered to it. Must be "
                                    "at least min.")
    mean: Optional[float] = Field(default=None, gt=0, le=MAX_TOKENS, description=(
        "lognormal only: the mean count, matched after clipping to [min, max]. Give exactly one of mean and "
        "median; it must lie within [min, max]."))
    median: Optional[float] = Field(default=None, gt=0, le=MAX_TOKENS, description=(
        "lognormal only: the median count, the exponential of the lognormal's location. Give exactly one of "
        "mean and median; it must lie within [min, max]."))
    sigma: float = Field(default=0.8, gt=0, le=10, description=(
        "lognormal only: the spread σ, the standard deviation of the count's logarithm; the bound of 10 is "
        "already a 22,000× spread (e^10)."))
    value: Optional[Tokens] = Field(default=None, description="fixed only (and required there): the count every "
                                                              "draw takes; it must lie within [min, max].")

    @model_validator(mode="after")
    def _check(self) -> "LengthDistribution":
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        if self.distribution == "lognormal" and (self.mean is None) == (self.median is None):
            raise ValueError("lognormal needs exactly one of 'mean' or 'median'")
        if self.distribution == "fixed" and self.value is None:
            raise ValueError("fixed needs 'value'")
        for key in ("mean", "median", "value"):
            v = getattr(self, key)
            if v is not None and not self.min <= v <= self.max:
                raise ValueError(f"{key} ({v}) must lie within [min, max] ([{self.min}, {self.max}])")
        return self

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` draws (:func:`sample_lengths`)."""
        return sample_lengths(self, count, rng)


@functools.lru_cache(maxsize=None)
def _standard_normal_sample() -> np.ndarray:
    return np.random.default_rng(20240501).standard_normal(20000)


def _lognormal_mu_for_mean(dist: LengthDistribution) -> float:
    """Location whose clipped lognormal has the requested mean (bisection)."""
    z = _standard_normal_sample()
    lo, hi = np.log(dist.min) - 5 * dist.sigma, np.log(dist.max) + 5 * dist.sigma
    for _ in range(60):
        mid = (lo + hi) / 2
        mean = np.clip(np.exp(mid + dist.sigma * z), dist.min, dist.max).mean()
        lo, hi = (mid, hi) if mean < dist.mean else (lo, mid)
    return (lo + hi) / 2


def sample_lengths(dist: LengthDistribution, count: int, rng: np.random.Generator) -> np.ndarray:
    if dist.distribution == "fixed":
        values = np.full(count, float(dist.value))
    elif dist.distribution == "uniform":
        values = rng.integers(dist.min, dist.max + 1, count).astype(float)
    else:
        mu = np.log(dist.median) if dist.median is not None else _lognormal_mu_for_mean(dist)
        values = np.exp(mu + dist.sigma * rng.standard_normal(count))
    return np.clip(np.rint(values), dist.min, dist.max).astype(np.int64)
