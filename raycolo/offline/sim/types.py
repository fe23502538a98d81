"""Inputs and outputs shared by the fast and the reference simulator."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ReplicaWorkload:
    """Requests for one replica, in FCFS order (index order breaks ready-time ties).

    ``prompt_len`` is what a (re-)admission prefills: input plus tokens generated
    before a preemption. ``ready`` is seconds after the replica starts (``inf``: not ready
    unless a predecessor activates it). ``successor[i]`` becomes ready the moment ``i``
    finishes (the chain-summary self-loop). ``running`` lists requests that already hold
    KV (a replica continuing from the previous stage): ``(index, stored_tokens)``.
    """

    prompt_len: np.ndarray
    remaining: np.ndarray
    ready: np.ndarray
    successor: np.ndarray | None = None
    running: list[tuple[int, int]] = field(default_factory=list)
    waiting_first: list[int] = field(default_factory=list)  # preempted requests, queue head
    # False where the prompt was already computed once (re-prefill after a preemption or a
    # reload): that recomputation is work, but not useful work.
    fresh: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_len = np.asarray(self.prompt_len, dtype=np.int64)
        self.remaining = np.asarray(self.remaining, dtype=np.int64)
        self.ready = np.asarray(self.ready, dtype=np.float64)
        n = len(self.prompt_len)
        if self.successor is None:
            self.successor = np.full(n, -1, dtype=np.int64)
        if self.fresh is None:
            self.fresh = np.ones(n, dtype=bool)
        if not (len(self.remaining) == len(self.ready) == len(self.successor) == n):
            raise ValueError("workload arrays must have equal lengths")
        if n and self.remaining.min() < 1:
            raise ValueError("every request must have at least one token left to generate")

    def __len__(self) -> int:
        return len(self.prompt_len)


@dataclass
class SimResult:
    """What a simulation produced.

    ``finish`` holds each request's finish time (``inf``: not finished by the stop).
    ``curve_t``/``curve_flops`` are the cumulative FLOPs at event boundaries; linear
    interpolation between them is exact within a prefill and close within a decode run.
    ``curve_useful`` counts only useful work (new tokens and first-time prompts, at the
    model's per-token weight FLOPs), so recomputation after a preemption earns nothing.
    When the run was stopped early, ``running``/``waiting`` describe the queues at the stop
    and ``generated`` the tokens each request produced in this run.
    """

    finish: np.ndarray
    end_time: float
    generated: np.ndarray
    curve_t: np.ndarray
    curve_flops: np.ndarray
    curve_useful: np.ndarray
    running: list[tuple[int, int]]
    waiting: list[int]
    iterations: int
    prefills: int
    preemptions: int
    stopped: bool

    @property
    def total_flops(self) -> float:
        return float(self.curve_flops[-1]) if len(self.curve_flops) else 0.0

    def useful_by(self, t: float) -> float:
        return float(np.interp(t, self.curve_t, self.curve_useful))

    @property
    def total_useful(self) -> float:
        return float(self.curve_useful[-1])
