"""Per-iteration latency model (SamuLLM §4.1, Eq. 5) and model load times.

One iteration's latency is the sum of three linear parts:

* model computation: ``a[b] + c[b] * TFLOPs`` where ``b`` is the bucket of the number
  of requests in the iteration (the paper fits one line per request count);
* input preparation: ``p0 + p1 * tokens`` with ``tokens`` the total context length the
  iteration touches (prompt tokens for prefill, attended tokens for decode);
* sampling: ``s0 + s1 * n`` for ``n`` sequences, plus ``f0 + f1 * n`` in a decode
  iteration whose rows go through the full sampler (temperature, penalties: a node that
  is not plain greedy), which costs far more than the plain argmax.

FLOPs are per GPU: ``(2 * W * tokens + attention) / tp`` with ``W`` the weights one token
multiplies through. Coefficients are stored per (model, tp) in a :class:`LatencyProfile`.
Until measured profiles exist, :func:`default_profile` derives them from the roofline of
the target GPU (see docs/costmodel.md); every default is written down there.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycolo.catalog import ModelSpec
from raycolo.errors import ConfigError
from raycolo.hardware import ClusterSpec

DEFAULT_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]

# Fractions of peak the roofline defaults assume (documented in docs/costmodel.md).
ACHIEVED_BANDWIDTH = 0.8
ACHIEVED_MFU = 0.5
ENGINE_STARTUP_S = 8.0        # process + CUDA context + engine init, as vLLM reports on A100
TP_GROUP_SETUP_S = 3.0        # NCCL communicator creation for tp > 1
ALLREDUCE_LATENCY_S = 8e-6    # one small NVLink all-reduce, two per layer per iteration
STEP_OVERHEAD_S = 1.5e-3      # scheduler + input tensors per iteration (CPU side)
SAMPLE_OVERHEAD_S = 3e-4
SAMPLE_PER_SEQ_S = 5e-6


def profile_file(directory, model: str, tp: int) -> Path:
    """Where ``raycolo profile`` writes ``model``'s profile at ``tp`` in ``directory``."""
    return Path(directory) / f"{model}.tp{tp}.json"


def fit_file(directory, model: str, tp: int) -> Path:
    """The fit statistics written beside :func:`profile_file`."""
    return Path(directory) / f"{model}.tp{tp}.fit.json"


class LatencyProfile(BaseModel):
    """Fitted or derived coefficients for one (model, tp)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tp: int = Field(gt=0)
    source: str = "default"  # "default" (roofline-derived) or "measured"
    # What a measured profile timed: the engine (ENGINE_NAMES) and where and when
    # (raycolo profile writes "<device> (<machine>), <date>"). Empty in roofline defaults.
    engine: str = ""
    measured_on: str = ""
    buckets: list[int] = Field(default_factory=lambda: list(DEFAULT_BUCKETS))
    compute_intercept_s: list[float]
    compute_s_per_tflop: list[float]
    prepare_intercept_s: float
    prepare_s_per_token: float
    sample_intercept_s: float
    sample_s_per_seq: float
    load_s: float = Field(ge=0)
    # Optional separate prefill coefficients (same meaning, prefill iterations only). Left
    # empty, prefill shares the decode ones as in the paper; fitted profiles of small models
    # on CPUs need them, because there a prompt token costs far more than an attended one.
    prefill_intercept_s: Optional[list[float]] = None
    prefill_s_per_tflop: Optional[list[float]] = None
    prefill_s_per_token: Optional[float] = None
    prefill_s_per_seq: Optional[float] = None
    # The full sampler's extra cost in a decode iteration (timed on the engine by raycolo
    # profile, profiler.time_full_sampler; 0 in the roofline defaults, where the GPU
    # samples in microseconds).
    full_sampler_intercept_s: float = Field(default=0.0, ge=0)
    full_sampler_s_per_seq: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _check_lengths(self) -> "LatencyProfile":
        n = len(self.buckets)
        if n == 0 or sorted(self.buckets) != self.buckets:
            raise ValueError("buckets must be a non-empty increasing list")
        if len(self.compute_intercept_s) != n or len(self.compute_s_per_tflop) != n:
            raise ValueError("compute_* lists need one value per bucket")
        for name in ("prefill_intercept_s", "prefill_s_per_tflop"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} needs one value per bucket")
        return self

    def bucket_of(self, n: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(np.asarray(self.buckets), n, side="left")
        return np.minimum(idx, len(self.buckets) - 1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "LatencyProfile":
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: invalid latency profile: {str(exc).splitlines()[0]}") from None


ENGINE_NAMES = {"torch": "raycolo's torch engine", "vllm": "vLLM"}
ROOFLINE_NOTE = ("roofline defaults (docs/costmodel.md: weights and K/V at {bw:.0%} of the card's bandwidth, "
                 "matmuls at {mfu:.0%} of its peak), not checked against a run of this cluster")


def cost_source(profile: LatencyProfile, file: Optional[Path] = None) -> dict:
    """What a plan's costs of one (model, tp) came from, for plan tables, JSON and report.json."""
    if profile.source != "measured":
        return {"model": profile.model, "tp": profile.tp, "source": "default", "engine": None,
                "measured_on": None, "file": None,
                "note": ROOFLINE_NOTE.format(bw=ACHIEVED_BANDWIDTH, mfu=ACHIEVED_MFU)}
    engine = ENGINE_NAMES.get(profile.engine or "torch", profile.engine)
    return {"model": profile.model, "tp": profile.tp, "source": "measured", "engine": engine,
            "measured_on": profile.measured_on or None, "file": str(file) if file else None,
            "note": f"measured on {engine}" + (f", {profile.measured_on}" if profile.measured_on else "")}


def default_load_seconds(model: ModelSpec, cluster: ClusterSpec, tp: int) -> float:
    """Replicas load in parallel, each GPU reading its 1/tp shard."""
    shard = model.weight_bytes / tp
    return ENGINE_STARTUP_S + shard / cluster.load_bandwidth + (TP_GROUP_SETUP_S if tp > 1 else 0.0)


def default_profile(model: ModelSpec, cluster: ClusterSpec, tp: int) -> LatencyProfile:
    """Roofline-derived coefficients: weights stream once per iteration, FLOPs at ACHIEVED_MFU,
    attended KV bytes stream per token (folded into the per-token preparation term)."""
    bw = cluster.memory_bandwidth * ACHIEVED_BANDWIDTH
    weights_s = model.weight_bytes / tp / bw
    comm_s = 2 * model.layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0
    s_per_tflop = 1e12 / (cluster.peak_flops * ACHIEVED_MFU)
    kv_s_per_token = model.kv_bytes_per_token / tp / bw
    nb = len(DEFAULT_BUCKETS)
    return LatencyProfile(
        model=model.name, tp=tp, source="default",
        compute_intercept_s=[weights_s + comm_s] * nb,
        compute_s_per_tflop=[s_per_tflop] * nb,
        prepare_intercept_s=STEP_OVERHEAD_S,
        prepare_s_per_token=kv_s_per_token,
        sample_intercept_s=SAMPLE_OVERHEAD_S,
        sample_s_per_seq=SAMPLE_PER_SEQ_S,
        load_s=default_load_seconds(model, cluster, tp),
    )


class IterationLatency:
    """Latency and FLOPs of prefill and decode iterations for one (model, tp).

    Decode with ``n`` running sequences attending ``C`` tokens in total costs
    ``alpha[n] + beta[n] * C`` seconds and ``flops_n[n] + flops_c * C`` FLOPs; the
    simulators use these closed forms to skip over whole runs of decode iterations.
    ``compute_scale`` multiplies every iteration's seconds: the factor the runtime
    measures between the profile and the cluster it runs on (a slower machine, replicas
    sharing CPU cores). ``plain_sampling`` False adds the full sampler's cost to each
    decode iteration (a node that samples rather than takes the argmax).
    """

    def __init__(self, model: ModelSpec, profile: LatencyProfile, max_seqs: int = 1024,
                 compute_scale: float = 1.0, plain_sampling: bool = True):
        self.model = model
        self.profile = profile
        self.compute_scale = compute_scale
        tp = profile.tp
        self.weight_flops_per_token = 2.0 * model.matmul_params_per_token / tp
        self.decode_attn_flops_per_token = 4.0 * model.layers * model.hidden / tp
        self.prefill_attn_flops_per_sq = 2.0 * model.layers * model.hidden / tp
        n = np.arange(max_seqs + 1)
        b = profile.bucket_of(np.maximum(n, 1))
        a = np.asarray(profile.compute_intercept_s)[b]
        c = np.asarray(profile.compute_s_per_tflop)[b] / 1e12  # seconds per FLOP
        fixed = profile.prepare_intercept_s + profile.sample_intercept_s
        sampler = 0.0 if plain_sampling else profile.full_sampler_intercept_s + profile.full_sampler_s_per_seq * n
        # Decode: seconds = alpha[n] + beta[n] * C.
        self.alpha = (a + fixed + c * self.weight_flops_per_token * n
                      + profile.sample_s_per_seq * n + sampler).tolist()
        self.beta = (c * self.decode_attn_flops_per_token + profile.prepare_s_per_token).tolist()
        self.flops_n = (self.weight_flops_per_token * n).tolist()
        self.flops_c = self.decode_attn_flops_per_token
        # Prefill of m sequences: prefill_base[m] + prefill_c[m] * FLOPs + per_token * tokens.
        pa = a if profile.prefill_intercept_s is None else np.asarray(profile.prefill_intercept_s)[b]
        pc = c if profile.prefill_s_per_tflop is None else np.asarray(profile.prefill_s_per_tflop)[b] / 1e12
        per_seq = profile.sample_s_per_seq if profile.prefill_s_per_seq is None else profile.prefill_s_per_seq
        self.prefill_base = (pa + fixed + per_seq * n).tolist()
        self.prefill_c = pc.tolist()
        self.prefill_per_token = (profile.prepare_s_per_token if profile.prefill_s_per_token is None
                                  else profile.prefill_s_per_token)
        if compute_scale != 1.0:   # every iteration ``compute_scale`` times the profile's
            k = compute_scale
            self.alpha = [k * x for x in self.alpha]
            self.beta = [k * x for x in self.beta]
            self.prefill_base = [k * x for x in self.prefill_base]
            self.prefill_c = [k * x for x in self.prefill_c]
            self.prefill_per_token *= k

    def prefill_flops(self, tokens: int, sum_sq: int) -> float:
        return self.weight_flops_per_token * tokens + self.prefill_attn_flops_per_sq * sum_sq

    def prefill_seconds(self, seqs: int, tokens: int, sum_sq: int) -> float:
        return (self.prefill_base[seqs] + self.prefill_c[seqs] * self.prefill_flops(tokens, sum_sq)
                + self.prefill_per_token * tokens)

    def decode_seconds(self, n: int, attended: int) -> float:
        return self.alpha[n] + self.beta[n] * attended

    def decode_flops(self, n: int, attended: int) -> float:
        return self.flops_n[n] + self.flops_c * attended


def resolve_profile_dir(name: str) -> Path:
    """A profile directory, or the name of one shipped in raycolo/data/profiles."""
    from importlib import resources

    from raycolo.errors import ConfigError

    from raycolo.paths import is_dir

    path = Path(name)
    if is_dir(path):
        return path
    shipped = Path(str(resources.files("raycolo").joinpath("data", "profiles", name)))
    if is_dir(shipped):
        return shipped
    raise ConfigError(f"--profile: '{name}' is neither a directory nor a shipped profile")
