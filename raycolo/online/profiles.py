"""Node profiles for co-located serving and training (LeMix): per-stage latency and memory.

A node has ``stages`` GPUs running one model split into equal pipeline stages (§II-C).
LeMix predicts a stage's forward and backward latency as η_F·C·ℓ² and η_B·C·ℓ² for a task
of C queries of ℓ tokens (Algorithm 1, lines 6 and 16): the attention term dominates the
variation between tasks, so one coefficient per pass is enough for scheduling.

Presets come from the paper's Table II (size, layers, hidden, forward/backward latency) on
its testbeds (§VI-A): GPT models on RTX 6000 Ada 48 GB, Llama models on A100 80 GB.
Interpretation (the paper does not state it): a Table II latency is the whole-model forward
(backward) of one task with C = 1 at the reference length ℓ_ref = 256, so

    η_F = forward_latency / stages / ℓ_ref²        η_B = backward_latency / stages / ℓ_ref²

and the Table II figures stay the SLO base (TTFT deadline = 5 × forward latency, §VI-A).
Memory sizes ("GB" in the paper and on the GPU) are GiB; bandwidths are decimal (bytes/s).
:func:`fit_profile` replaces the η's with least-squares fits to measured stage latencies.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycolo.batching.blocks import DEFAULT_BLOCK_SIZE
from raycolo.errors import ConfigError
from raycolo.kv_bytes import kv_bytes_per_token

GIB = 2**30
REFERENCE_LENGTH = 256
DTYPE_BYTES = 2  # fp16/bf16 weights and KV cache
# Korthikanti et al. (2022): a transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes of
# activations for its backward without recomputation. The 5·a·s²·b term is the attention
# score matrix, which FlashAttention-style kernels do not store, so only 34 bytes per token
# per hidden unit remain.
ACTIVATION_BYTES_PER_HIDDEN = 34


class NodeProfile(BaseModel):
    """One node: ``stages`` GPUs, one model in equal stages. Per-stage figures unless noted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    stages: int = Field(gt=0)
    eta_f: float = Field(gt=0)  # forward seconds per C·ℓ² per stage
    eta_b: float = Field(gt=0)  # backward seconds per C·ℓ² per stage
    decode_floor_s: float = Field(ge=0)  # reading the stage's weights once per decode step
    kv_bytes_per_token: float = Field(ge=0)
    activation_bytes_per_token: float = Field(ge=0)  # held from a training forward to its backward
    weight_bytes_per_stage: float = Field(ge=0)
    gpu_memory_bytes: float = Field(gt=0)
    forward_latency_s: float = Field(gt=0)  # whole model, C = 1, ℓ_ref: the SLO base
    backward_latency_s: float = Field(gt=0)  # whole model, C = 1, ℓ_ref
    reference_length: int = Field(gt=0)
    # A fixed cost every op pays on a stage whatever its size (dispatch, actor hops, kernel
    # launches): 0 in the paper's model and its presets; fitted from a live executor's ops.
    op_overhead_s: float = Field(default=0.0, ge=0)
    # Each stage's paged KV pool (a live deployment's stage.kv_cache_tokens / block_size): the
    # scheduler reserves a request's blocks for its prompt plus max_tokens on every stage and
    # starts no prefill they do not fit. None: no pool (the simulator's stages: bytes only).
    kv_blocks: Optional[int] = Field(default=None, gt=0)
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, gt=0)

    @model_validator(mode="after")
    def _weights_fit(self) -> "NodeProfile":
        if self.weight_bytes_per_stage >= self.gpu_memory_bytes:
            raise ValueError("weight_bytes_per_stage must be below gpu_memory_bytes")
        return self

    def forward_s(self, batch, length):
        """One stage's forward (prefill) of C queries of ℓ tokens."""
        return self.op_overhead_s + self.eta_f * batch * length**2

    def backward_s(self, batch, length):
        return self.op_overhead_s + self.eta_b * batch * length**2

    def decode_step_s(self, batch, context):
        """One stage's decode step with ``context`` tokens cached.

        The ℓ² model's increment for one more token is η_F·C·((ℓ+1)² − ℓ²); a decode step is
        memory-bound at small batch, so it never beats reading the stage's weights once.
        """
        return self.op_overhead_s + np.maximum(self.decode_floor_s, self.eta_f * batch * (2 * context + 1))

    def inference_bytes(self, batch, length):
        """KV cache of C sequences of ℓ tokens on one stage."""
        return self.kv_bytes_per_token * batch * length

    def train_bytes(self, batch, length):
        """Activations plus KV of a training task between its forward and backward."""
        return (self.activation_bytes_per_token + self.kv_bytes_per_token) * batch * length

    @property
    def free_bytes(self) -> float:
        """GPU memory left for KV cache and activations after the stage's weights.

        Only the weights are counted: fine-tuning is LoRA-style, so adapter weights, their
        gradients and optimizer state are negligible next to the frozen base weights.
        """
        return self.gpu_memory_bytes - self.weight_bytes_per_stage


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s


@dataclass(frozen=True)
class ModelPreset:
    """One row of LeMix Table II plus the testbed GPU it was measured on."""

    name: str
    weight_bytes: float
    layers: int
    hidden: int
    kv_dim: int  # width of K (= of V) per layer: kv_heads × head_dim
    forward_latency_s: float
    backward_latency_s: float
    gpu: GpuSpec


RTX_6000_ADA = GpuSpec("RTX 6000 Ada 48GB", 48 * GIB, 960e9)
A100_80GB = GpuSpec("A100 80GB", 80 * GIB, 2.0e12)

PRESETS: dict[str, ModelPreset] = {p.name: p for p in [
    # GPT: multi-head attention, so K/V are as wide as the hidden state.
    ModelPreset("gpt-400m", 1.0 * GIB, 12, 768, 768, 0.03, 0.04, RTX_6000_ADA),
    ModelPreset("gpt-1.4b", 2.3 * GIB, 24, 1024, 1024, 0.08, 0.09, RTX_6000_ADA),
    ModelPreset("gpt-2.5b", 4.5 * GIB, 36, 1280, 1280, 0.12, 0.14, RTX_6000_ADA),
    # Llama-8B and -70B use grouped-query attention (8 KV heads of 128); Llama-13B does not.
    ModelPreset("llama-8b", 13 * GIB, 32, 4096, 1024, 0.11, 0.15, A100_80GB),
    ModelPreset("llama-13b", 26 * GIB, 40, 5120, 5120, 0.24, 0.36, A100_80GB),
    ModelPreset("llama-70b", 132 * GIB, 80, 8192, 1024, 0.73, 1.05, A100_80GB),
]}


def profile_names() -> list[str]:
    return list(PRESETS)


def preset(name: str, stages: int = 2) -> NodeProfile:
    """The profile of model ``name`` split over ``stages`` GPUs of its testbed."""
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown model '{name}' (choose {', '.join(PRESETS)})")
    spec = PRESETS[name]
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ConfigError(f"--stages: must be a positive integer, got {stages}")
    if stages > spec.layers:
        raise ConfigError(f"--stages: {name} has only {spec.layers} layers, got {stages}")
    weights = spec.weight_bytes / stages
    if weights >= spec.gpu.memory_bytes:
        needed = int(spec.weight_bytes // spec.gpu.memory_bytes) + 1
        raise ConfigError(
            f"--stages: {name} ({spec.weight_bytes / GIB:g} GB) does not fit on {stages} "
            f"{spec.gpu.name} GPU(s); use at least {needed} stages")
    # Average layers per stage: an uneven split (80 layers over 3 stages) is treated as equal.
    layers = spec.layers / stages
    ref2 = REFERENCE_LENGTH**2
    return NodeProfile(
        name=name,
        stages=stages,
        eta_f=spec.forward_latency_s / stages / ref2,
        eta_b=spec.backward_latency_s / stages / ref2,
        decode_floor_s=weights / spec.gpu.bandwidth,
        kv_bytes_per_token=kv_bytes_per_token(layers, 1, spec.kv_dim, DTYPE_BYTES),   # kv_dim: kv_heads × head_dim
        activation_bytes_per_token=ACTIVATION_BYTES_PER_HIDDEN * spec.hidden * layers,
        weight_bytes_per_stage=weights,
        gpu_memory_bytes=spec.gpu.memory_bytes,
        forward_latency_s=spec.forward_latency_s,
        backward_latency_s=spec.backward_latency_s,
        reference_length=REFERENCE_LENGTH,
    )


# --------------------------------------------------------------------------- fitting

SAMPLE_FIELDS = ("batch", "length", "forward_s", "backward_s")
Samples = Union[np.ndarray, Iterable[Union[Mapping[str, float], Iterable[float]]]]


class ProfileFit(NamedTuple):
    eta_f: float
    eta_b: float
    r2_f: float
    r2_b: float
    overhead_s: float = 0.0     # the fixed cost per op, with ``intercept``


def _sample_matrix(samples: Samples) -> np.ndarray:
    """An (n, 4) float array of (batch, length, forward_s, backward_s) rows."""
    rows = samples if isinstance(samples, np.ndarray) else list(samples)
    if len(rows) == 0:
        raise ConfigError("profile fit: no samples")
    if not isinstance(rows, np.ndarray) and isinstance(rows[0], Mapping):
        table = []
        for i, row in enumerate(rows, 1):
            missing = [f for f in SAMPLE_FIELDS if f not in row]
            if missing:
                raise ConfigError(f"profile fit: sample {i}: missing '{missing[0]}'")
            table.append([row[f] for f in SAMPLE_FIELDS])
        rows = table
    try:
        data = np.asarray(rows, dtype=float)
    except (TypeError, ValueError):
        raise ConfigError("profile fit: samples must be numbers "
                          "(batch, length, forward_s, backward_s)") from None
    if data.ndim != 2 or data.shape[1] != 4:
        raise ConfigError(f"profile fit: samples must have 4 columns "
                          f"(batch, length, forward_s, backward_s), got shape {data.shape}")
    bad = np.flatnonzero(~(np.isfinite(data) & (data > 0)).all(axis=1))
    if len(bad):
        raise ConfigError(f"profile fit: sample {bad[0] + 1}: values must be positive")
    return data


def _r2(y: np.ndarray, predicted: np.ndarray) -> float:
    """Centred R² (can go negative): how much of the spread the model explains; the
    uncentred version of a no-intercept fit is near 1 for almost any data."""
    ss_res = float(np.sum((y - predicted) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0:
        return 1.0 if ss_res <= 1e-12 * float(np.dot(y, y)) else 0.0
    return 1.0 - ss_res / ss_tot


def _fit_through_origin(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Slope of y = η·x by least squares, and the R² of that line."""
    eta = float(np.dot(x, y) / np.dot(x, x))
    return eta, _r2(y, eta * x)


def _fit_shared_intercept(xf: np.ndarray, forward: np.ndarray, xb: np.ndarray, backward: np.ndarray):
    """(a, η_F, η_B) of forward = a + η_F·x and backward = a + η_B·x by least squares,
    one fixed cost a for both passes; None unless all three come out positive."""
    nf, nb = len(xf), len(xb)
    design = np.zeros((nf + nb, 3))
    design[:, 0] = 1.0
    design[:nf, 1] = xf
    design[nf:, 2] = xb
    coef, *_ = np.linalg.lstsq(design, np.concatenate([forward, backward]), rcond=None)
    return tuple(float(c) for c in coef) if (coef > 0).all() else None


def fit_coefficients(samples: Samples, intercept: bool = False,
                     prefills: Optional[Sequence[tuple[int, int, float]]] = None) -> ProfileFit:
    """η_F, η_B (per stage) and their R² from measured stage latencies.

    ``samples``: dicts with keys batch, length, forward_s, backward_s, or an (n, 4) array
    of those columns; seconds are one stage's forward and backward of that task. With
    ``intercept``, a fixed cost per op shared by both passes is fitted too (kept only if it
    and both η's come out positive; else the fit goes through the origin), and
    ``prefills`` (batch, length, seconds of one stage's prefill forward) join the
    forward rows: their small C·ℓ² is what pins the fixed cost down.
    """
    data = _sample_matrix(samples)
    x = data[:, 0] * data[:, 1] ** 2  # C·ℓ²
    if intercept and len(x) >= 3:
        pre = np.asarray(prefills if prefills else np.zeros((0, 3)), dtype=float).reshape(-1, 3)
        xf = np.concatenate([x, pre[:, 0] * pre[:, 1] ** 2])
        yf = np.concatenate([data[:, 2], pre[:, 2]])
        coef = _fit_shared_intercept(xf, yf, x, data[:, 3])
        if coef is not None:
            a, eta_f, eta_b = coef
            return ProfileFit(eta_f, eta_b, _r2(yf, a + eta_f * xf), _r2(data[:, 3], a + eta_b * x), a)
    eta_f, r2_f = _fit_through_origin(x, data[:, 2])
    eta_b, r2_b = _fit_through_origin(x, data[:, 3])
    return ProfileFit(eta_f, eta_b, r2_f, r2_b)


def fit_profile(samples: Samples, base: NodeProfile, intercept: bool = False,
                decode_s: Optional[Sequence[float]] = None,
                prefills: Optional[Sequence[tuple[int, int, float]]] = None) -> NodeProfile:
    """``base`` with η_F and η_B fitted to ``samples`` (and with ``intercept`` the fixed
    cost per op; with ``decode_s``, observed stage decode-step seconds, the decode floor
    becomes their median less that cost); everything else, the SLO base (Table II
    latencies) included, is kept."""
    fit = fit_coefficients(samples, intercept, prefills)
    update = {"eta_f": fit.eta_f, "eta_b": fit.eta_b}
    if intercept:
        update["op_overhead_s"] = fit.overhead_s
    if decode_s:
        update["decode_floor_s"] = max(0.0, float(np.median(decode_s)) - fit.overhead_s)
    # model_validate rather than model_copy(update=...): the copy would skip validation.
    return NodeProfile.model_validate({**base.model_dump(), **update})


DECODE_WINDOW = 4096


class ProfileLearner:
    """η_F, η_B and a fixed cost per op fitted from observed ops, for planning (Algorithm 1).

    Every training task's stage forwards and backwards, as the executor timed them, make
    one sample (batch, length, mean stage forward, mean stage backward); η_F, η_B and one
    fixed cost per op shared by both passes are fitted to them (LeMix's η·C·ℓ² plus the
    per-op cost a live executor pays for dispatch and actor hops, which η alone cannot
    carry on a small model; the simulator's own ops have none, though memory slowdowns
    can make it find one). The last ``DECODE_WINDOW`` decode steps set the decode floor
    (their median less the fixed cost), and the last prefills join the forward rows (a
    prefill is timed as the simulator costs it: C queries at the batch's longest ℓ).
    ``op_cost=False``: η alone from training tasks, as in the paper. Until ``warmup``
    samples are in, plans use ``prior`` (a preset, or a profile saved earlier); then the
    fit is refreshed each time the sample count doubles (``warmup``, 2·``warmup``, ...),
    so early noise is averaged out without refitting on every task.
    """

    def __init__(self, prior: NodeProfile, warmup: int, op_cost: bool = True):
        self.prior = prior
        self.warmup = warmup
        self.op_cost = op_cost
        self.current = prior
        self.samples: list[tuple[int, int, float, float]] = []
        self.decode_s: deque = deque(maxlen=DECODE_WINDOW)   # stage decode steps, as timed
        self.prefills: deque = deque(maxlen=DECODE_WINDOW)   # (batch, length, seconds) per stage
        self._open: dict[int, dict] = {}
        self._next_fit = warmup

    def observe(self, task_id: int, batch: int, length: int, kind: str, seconds: float) -> None:
        """One stage's training forward (``kind`` "forward") or backward, ``seconds`` long."""
        entry = self._open.setdefault(task_id, {"batch": batch, "length": length,
                                                "forward": [], "backward": []})
        entry[kind].append(seconds)

    def observe_prefill(self, batch: int, length: int, seconds: float) -> None:
        """One stage's prefill of ``batch`` queries, the longest of ``length`` tokens."""
        self.prefills.append((batch, length, seconds))

    def observe_decode(self, seconds: float) -> None:
        """One stage's decode step, ``seconds`` long."""
        self.decode_s.append(seconds)

    def task_done(self, task_id: int) -> bool:
        """The task's backward reached stage 0; True when this refitted the profile."""
        entry = self._open.pop(task_id, None)
        if entry is None or not entry["forward"] or not entry["backward"]:
            return False
        forward = float(np.mean(entry["forward"]))
        backward = float(np.mean(entry["backward"]))
        if forward <= 0 or backward <= 0:
            return False
        self.samples.append((entry["batch"], entry["length"], forward, backward))
        if len(self.samples) < self._next_fit:
            return False
        self._next_fit *= 2
        self.current = fit_profile(self.samples, self.prior, intercept=self.op_cost,
                                   decode_s=list(self.decode_s) if self.op_cost else None,
                                   prefills=list(self.prefills) if self.op_cost else None)
        return True
