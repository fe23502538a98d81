"""Online tasks for co-located serving and retraining (LeMix §VI-A): what arrives, and when.

A task is one query of ``length`` tokens (ℓ) in a batch of ``batch`` (C). Inference tasks
run a forward pass (prefill) through the node's pipeline and then ``decode_tokens``
decode steps; training tasks run a forward and a backward pass (alignment fine-tuning on
the same preference data that is served).

Two sources of tasks:

* :func:`poisson_workload` — the paper's synthetic workloads: a Poisson process (exponential
  inter-arrival times with mean 1/rate) where each task is training with probability
  ``train_rate`` and query lengths follow one of :data:`LENGTH_DISTRIBUTIONS`.
* :func:`load_trace` — a CSV trace (format in docs/online-workloads.md).

Every random draw goes through :func:`raycolo.rng.seeded_rng` with its own
label, so the same seed always gives the same workload, and changing one knob (say the
training rate) leaves the other draws (arrivals, lengths) unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

import numpy as np

from pydantic import Field

from raycolo.bounds import (MAX_RATE, MAX_TOKENS, Fraction, Requests, Strict, Tokens, checked,
                            field_annotation, field_bounds)
from raycolo.rng import seeded_rng
from raycolo.text_enum import TextEnum
from raycolo.errors import ConfigError
from raycolo.lengths import LengthDistribution
from raycolo.paths import check_input


class TaskKind(TextEnum):
    """An online task's kind (a trace's ``kind`` column)."""

    INFERENCE = "inference"
    TRAIN = "train"


TASK_KINDS = tuple(TaskKind)


@dataclass
class OnlineTask:
    """One arriving task: a query of ``length`` tokens in a batch of ``batch``."""

    task_id: int
    kind: TaskKind
    arrival_s: float
    length: int  # query length ℓ in tokens
    batch: int = 1  # C
    # Inference only (0 for training): the tokens the request will generate, counting the
    # prefill's first. A simulator knows it from the trace; a live executor does not.
    decode_tokens: int = 0
    # Inference only: the request's token limit, which is all a scheduler may plan with
    # (KV is reserved for length + max_tokens). None: decode_tokens (a trace without it).
    max_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.task_id}: kind must be 'inference' or 'train', "
                             f"got {self.kind!r}")
        self.kind = TaskKind(self.kind)
        if self.max_tokens is not None and self.decode_tokens > self.max_tokens:
            raise ValueError(f"task {self.task_id}: decode_tokens {self.decode_tokens} exceeds "
                             f"max_tokens {self.max_tokens}")

    @property
    def token_budget(self) -> int:
        """Tokens the request may generate at most (its ``max_tokens``)."""
        return self.decode_tokens if self.max_tokens is None else self.max_tokens

    @property
    def is_train(self) -> bool:
        return self.kind == TaskKind.TRAIN


# SYNTHETIC stand-ins for the query lengths of the paper's two preference datasets
# (LeMix Fig. 2). Only the shape is reproduced, not the data: HH-RLHF queries are shorter
# and less variable, SHP queries longer and more variable. The variance matters because
# it drives the far-dependency idleness that LeMix targets (§II-C, Fig. 5a).
LENGTH_DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "hh-rlhf": LengthDistribution(median=96, sigma=0.6, min=8, max=1024),
    "shp": LengthDistribution(median=160, sigma=0.9, min=8, max=2048),
}

# SYNTHETIC output lengths of inference tasks (tokens decoded after the prefill).
DECODE_DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "default": LengthDistribution(median=64, sigma=0.7, min=1, max=512),
}


# max_tokens of a synthetic inference request: the decode distribution's cap, so that no
# sampled request is cut short and the scheduler reserves what a client asking for up to
# that many tokens makes a real engine reserve.
DEFAULT_MAX_TOKENS = DECODE_DISTRIBUTIONS["default"].max


def get_length_distribution(name: str) -> LengthDistribution:
    try:
        return LENGTH_DISTRIBUTIONS[name]
    except KeyError:
        choices = ", ".join(LENGTH_DISTRIBUTIONS)
        raise ConfigError(f"--lengths: unknown distribution '{name}' (choose {choices})") from None


def _check_train_rate(train_rate: float) -> None:
    _check("--train-rate", Fraction, train_rate)


def _check(flag: str, annotation, value):
    """``value`` held to its declared bounds (raycolo/bounds.py), as the flag's error."""
    try:
        return checked(flag, annotation, value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


MAX_TASK_BATCH = 4096         # queries per task
MAX_TRACE_SPAN_S = 1e8        # a trace's timestamps (about three years of seconds)


def _check_count(flag: str, value) -> int:
    return _check(flag, Requests, value)


def _train_flags(count: int, train_rate: float, seed: int) -> np.ndarray:
    # One independent draw per task (not an exact share), as a Bernoulli mix of arrivals.
    return seeded_rng(seed, "online", "kind").random(count) < train_rate


def _decode_lengths(count: int, seed: int) -> np.ndarray:
    # Drawn for every task, used by the inference ones: a task's decode length then does not
    # depend on which of the other tasks happen to be training.
    return DECODE_DISTRIBUTIONS["default"].sample(count, seeded_rng(seed, "online", "decode"))


def poisson_workload(rate: float, train_rate: float, tasks: int, lengths: str = "hh-rlhf",
                     seed: int = 0, batch: int = 1, train_batch: Optional[int] = None) -> list[OnlineTask]:
    """The paper's synthetic workload: Poisson arrivals at ``rate`` tasks/s (§VI-A).

    The process starts at t = 0, so the first task arrives after one exponential gap.
    Each task is training with probability ``train_rate``; inference tasks get decode
    lengths from ``DECODE_DISTRIBUTIONS["default"]``. Task ids follow arrival order.
    Tasks are batches of ``batch`` queries; training tasks of ``train_batch`` (default:
    ``batch``), e.g. the live runtime's ``lora.micro_batch``.
    """
    _check("--rate", field_annotation(Arrivals, "rate"), rate)
    _check_train_rate(train_rate)
    count = _check_count("--tasks", tasks)
    _check_count("--batch", batch)
    get_length_distribution(lengths)
    gaps = seeded_rng(seed, "online", "arrivals").exponential(1.0 / rate, count)
    return _workload(np.cumsum(gaps), train_rate, lengths, seed, batch, train_batch)


def bursty_workload(rate: float, train_rate: float, tasks: int, lengths: str = "hh-rlhf",
                    seed: int = 0, batch: int = 1, burst_share: float = 0.8,
                    sigma: float = 1.0, train_batch: Optional[int] = None) -> list[OnlineTask]:
    """Bursty arrivals at a mean of ``rate`` tasks/s, like SIRIUS's generated traces
    (SIRIUS §6): inter-arrival gaps from a mixture of two LogNormals, a share
    ``burst_share`` of short gaps (a fifth of the mean gap on average) inside bursts and
    long gaps between them, each LogNormal with shape ``sigma``, scaled so that the mean
    gap is ``1 / rate``. Kinds, lengths and decode lengths as :func:`poisson_workload`."""
    _check("--rate", field_annotation(Arrivals, "rate"), rate)
    if not 0 < burst_share < 1 or not 0 < sigma < 10:
        raise ConfigError("bursty workload: burst_share must be in (0, 1) and sigma in (0, 10)")
    count = _check_count("--tasks", tasks)
    rng = seeded_rng(seed, "online", "bursty-arrivals")
    short, long_ = 0.2 / rate, (1 - burst_share * 0.2) / (1 - burst_share) / rate
    means = np.where(rng.random(count) < burst_share, short, long_)
    gaps = rng.lognormal(np.log(means) - sigma ** 2 / 2, sigma)   # E[gap] = means
    return _workload(np.cumsum(gaps), train_rate, lengths, seed, batch, train_batch)


def _workload(arrivals: np.ndarray, train_rate: float, lengths: str, seed: int,
              batch: int, train_batch: Optional[int] = None) -> list[OnlineTask]:
    _check_train_rate(train_rate)
    batch = _check_count("--batch", batch)
    train_batch = batch if train_batch is None else _check_count("--train-batch", train_batch)
    count = len(arrivals)
    dist = get_length_distribution(lengths)
    query_lengths = dist.sample(count, seeded_rng(seed, "online", "lengths", lengths))
    is_train = _train_flags(count, train_rate, seed)
    decode = _decode_lengths(count, seed)
    return [OnlineTask(task_id=i, kind=TaskKind.TRAIN if is_train[i] else TaskKind.INFERENCE,
                       arrival_s=float(arrivals[i]), length=int(query_lengths[i]),
                       batch=train_batch if is_train[i] else batch,
                       decode_tokens=0 if is_train[i] else int(decode[i]),
                       max_tokens=None if is_train[i] else DEFAULT_MAX_TOKENS)
            for i in range(count)]


# --------------------------------------------------------------------------- traces

TRACE_REQUIRED = ("timestamp", "length")


def _first_bad_row(bad: np.ndarray) -> Optional[int]:
    """1-based data row of the first True in ``bad``, or None."""
    hits = np.flatnonzero(bad)
    return int(hits[0]) + 1 if len(hits) else None


class Arrivals(Strict):
    """Generated arrivals (``simulate-online``, ``sweep-online``, ``online run``)."""

    rate: float = Field(default=50.0, gt=0, le=MAX_RATE, description=(
        "The mean arrival rate in tasks per second: a Poisson process, whose inter-arrival times are "
        "exponential with mean 1/rate."))
    tasks: Requests = Field(default=1000, description=(
        "How many tasks arrive (the number to simulate or to replay)."))


class LiveReplay(Strict):
    """What ``online run`` adds to the arrivals it replays on a live deployment."""

    max_length: Tokens = Field(default=64, description="clip query lengths to this (tiny CPU models)")
    max_decode: Tokens = Field(default=16, description="clip decode lengths to this (tiny CPU models)")
    preference_share: float = Field(default=0.0, ge=0, le=1, description=(
        "fraction of training tasks that are preference pairs, trained with the DPO loss; >0 also reports "
        "held-out win rate and CLPD before and after"))


class TraceRow(Strict):
    """One row of a trace CSV: the bounds of each column (checked a column at a time)."""

    timestamp: float = Field(ge=-MAX_TRACE_SPAN_S, le=MAX_TRACE_SPAN_S, description=(
        "The task's arrival time in seconds. Rows are sorted by it (ties keep file order), then shifted so the "
        "first arrival is at 0."))
    length: Tokens = Field(description="The task's query length ℓ in tokens.")
    kind: Literal["inference", "train"] = Field(default="inference", description=(
        "Whether the task is served (inference) or trained on (train). Without a kind column each task is "
        "training with probability train_rate (default 0)."))
    batch: int = Field(default=1, ge=1, le=MAX_TASK_BATCH, description=(
        "The number of queries in the task, its batch size C."))
    decode_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS, description=(
        "Inference only: the tokens the request will generate, counting the prefill's first (the simulator ends "
        "the request there). An empty cell or a missing column is sampled from the default decode "
        "distribution; ignored for training tasks."))
    max_tokens: Tokens = Field(default=DEFAULT_MAX_TOKENS, description=(
        "Inference only: the request's token limit, all a scheduler may plan with (KV is reserved for length + "
        "max_tokens); at least decode_tokens. An empty cell takes the larger of this default and the row's "
        "decode_tokens."))


def _integer_column(frame, column: str, path: Path, required: bool) -> tuple[np.ndarray, np.ndarray]:
    """Whole numbers within :class:`TraceRow`'s bounds for ``column``; returns (values,
    present) with empty cells not present."""
    import pandas as pd

    lo, hi, _, _ = field_bounds(TraceRow, column)     # ge, le
    raw = frame[column]
    numbers = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float)
    empty = raw.isna().to_numpy() | (raw.astype(str).str.strip() == "").to_numpy()
    with np.errstate(invalid="ignore"):
        whole = np.isfinite(numbers) & (numbers == np.round(numbers))
        valid = whole & (numbers >= lo) & (numbers <= hi)
    bad = ~valid if required else ~valid & ~empty
    row = _first_bad_row(bad)
    if row is not None:
        value = numbers[row - 1]
        what = ("an integer" if not whole[row - 1] else f"at least {lo:.0f}" if value < lo else f"at most {hi:.0f}")
        raise ConfigError(f"{path}: row {row}: {column}: must be {what}, got {raw.iloc[row - 1]!r}")
    return np.where(valid, numbers, lo).astype(np.int64), valid


def load_trace(path, train_rate: Optional[float] = None, seed: int = 0,
               limit: Optional[int] = None) -> list[OnlineTask]:
    """Tasks from a CSV trace, sorted by timestamp and shifted so the first arrives at 0.

    Columns: ``timestamp`` (seconds) and ``length`` are required; ``kind``
    (inference|train), ``batch`` (default 1) and ``decode_tokens`` (default: sampled from
    ``DECODE_DISTRIBUTIONS["default"]``; ignored for training tasks) and ``max_tokens``
    (default: ``DEFAULT_MAX_TOKENS``, or the row's decode_tokens where that is larger; at
    least decode_tokens) are optional, and an empty optional cell takes the default. Other columns are ignored. Without a ``kind``
    column each task is training with probability ``train_rate`` (default 0); passing
    ``train_rate`` for a trace that has one is an error, since it would be silently unused.
    ``limit`` keeps the earliest tasks. Rows in errors are 1-based data rows of the file.
    """
    import pandas as pd

    path = Path(path)
    if train_rate is not None:
        _check_train_rate(train_rate)
    if limit is not None:
        limit = _check_count("limit", limit)
    check_input(path, "trace file")
    try:
        # Strings keep the cells as written, so errors can say which row is wrong.
        frame = pd.read_csv(path, dtype=str, skipinitialspace=True, keep_default_na=False)
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{path}: trace file is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: cannot read trace CSV: {exc}") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    for column in TRACE_REQUIRED:
        if column not in frame.columns:
            raise ConfigError(f"{path}: missing column '{column}'")
    if frame.empty:
        raise ConfigError(f"{path}: trace has no rows")
    has_kind = "kind" in frame.columns
    if has_kind and train_rate is not None:
        raise ConfigError(f"--train-rate: cannot be used with {path}, which has a 'kind' column")

    timestamps = pd.to_numeric(frame["timestamp"], errors="coerce").to_numpy(dtype=float)
    lo, hi, _, _ = field_bounds(TraceRow, "timestamp")
    with np.errstate(invalid="ignore"):
        row = _first_bad_row(~(np.isfinite(timestamps) & (timestamps >= lo) & (timestamps <= hi)))
    if row is not None:
        raise ConfigError(f"{path}: row {row}: timestamp: must be a number of seconds within ±{hi:g}")
    lengths, _ = _integer_column(frame, "length", path, required=True)
    if has_kind:
        kinds = frame["kind"].str.strip().str.lower().to_numpy(dtype=object)
        row = _first_bad_row(~np.isin(kinds, TASK_KINDS))
        if row is not None:
            raise ConfigError(f"{path}: row {row}: kind must be 'inference' or 'train'")
        is_train = kinds == TaskKind.TRAIN.value
    if "batch" in frame.columns:
        batches, present = _integer_column(frame, "batch", path, required=False)
        batches = np.where(present, batches, 1)
    else:
        batches = np.ones(len(frame), dtype=np.int64)
    if "decode_tokens" in frame.columns:
        given_decode, decode_present = _integer_column(frame, "decode_tokens", path, required=False)
    else:
        given_decode = np.zeros(len(frame), dtype=np.int64)
        decode_present = np.zeros(len(frame), dtype=bool)

    if "max_tokens" in frame.columns:
        given_max, max_present = _integer_column(frame, "max_tokens", path, required=False)
    else:
        given_max = np.zeros(len(frame), dtype=np.int64)
        max_present = np.zeros(len(frame), dtype=bool)

    # Stable sort: tasks with equal timestamps keep their file order.
    order = np.argsort(timestamps, kind="stable")
    if limit is not None:
        order = order[:limit]
    count = len(order)
    arrivals = timestamps[order] - timestamps[order[0]]
    # Random draws happen in arrival order, after the limit, like poisson_workload's.
    if not has_kind:
        is_train = np.zeros(len(frame), dtype=bool)
        is_train[order] = _train_flags(count, train_rate or 0.0, seed)
    sampled_decode = np.zeros(len(frame), dtype=np.int64)
    sampled_decode[order] = _decode_lengths(count, seed)
    decode = np.where(decode_present, given_decode, sampled_decode)
    max_tokens = np.where(max_present, given_max, np.maximum(decode, DEFAULT_MAX_TOKENS))
    row = _first_bad_row(max_present & (given_max < decode) & ~is_train)
    if row is not None:
        raise ConfigError(f"{path}: row {row}: max_tokens must be at least decode_tokens")

    tasks = []
    for task_id, (src, arrival) in enumerate(zip(order, arrivals)):
        train = bool(is_train[src])
        tasks.append(OnlineTask(task_id=task_id, kind=TaskKind.TRAIN if train else TaskKind.INFERENCE,
                                arrival_s=float(arrival), length=int(lengths[src]),
                                batch=int(batches[src]),
                                decode_tokens=0 if train else int(decode[src]),
                                max_tokens=None if train else int(max_tokens[src])))
    return tasks


def workload_summary(tasks: Sequence[OnlineTask]) -> dict:
    """Counts per kind, query-length mean/std (tokens) and the arrival span (seconds)."""
    lengths = np.array([t.length for t in tasks], dtype=float)
    arrivals = np.array([t.arrival_s for t in tasks], dtype=float)
    train = sum(t.is_train for t in tasks)
    duration = float(arrivals.max() - arrivals.min()) if len(tasks) else 0.0
    return {
        "tasks": len(tasks),
        "inference": len(tasks) - train,
        "train": train,
        "train_fraction": train / len(tasks) if tasks else 0.0,
        "mean_length": float(lengths.mean()) if len(tasks) else 0.0,
        "std_length": float(lengths.std()) if len(tasks) else 0.0,
        "duration_s": duration,
        "rate_per_s": (len(tasks) - 1) / duration if duration > 0 else 0.0,
    }
