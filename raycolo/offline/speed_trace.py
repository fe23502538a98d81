"""The machine's speed through a profile, and the profile's iterations at one speed.

A shared CPU does not run at one speed: on the 2-core VM raycolo is developed on, the
same batch of the same model takes 10-20 % longer in some minutes than in others, with
nothing else running (docs/benchmarks.md, "Cost model against measured run times"). A
profile's sweep takes a minute or two, so without care some of its shapes are timed in
slow minutes and others in fast ones, and the fit reads the machine's minutes as the
model's shape. ``raycolo profile`` therefore

* times a fixed reference batch between the sweep's runs (:class:`SpeedTrace`, one mark
  after each run and one before the first);
* sweeps its shapes in several rounds, each in its own seeded order, so a slow minute
  falls on a few points of one round rather than on one region of the shapes;
* rescales each run's iterations by the trace's median over the machine's local speed
  around the run (:meth:`SpeedTrace.factor`, :func:`at_median_speed`): every iteration
  is expressed at the machine's median speed over the profile, which ``.fit.json``
  records as ``reference_s`` (with ``reference_spread``, the marks' 90th over 10th
  percentile: how much the machine moved while it was profiled).

On the 2-core VM (2026-11-29, ``tiny-llama-m``, a 3-round sweep with a mark around every
point), a point's mean decode iteration over its median across rounds spread (10th to
90th percentile) 0.92-1.06 raw, 0.96-1.05 scaled by the two marks next to it and
0.94-1.05 scaled by the windowed speed that is used (:meth:`SpeedTrace.local`); a point
and the marks next to it moved together (correlation 0.71).

Pure: the runs are callables; this module needs no engine.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

TRACE_EDGE = 3    # marks at each end whose median is the trace's start (and end) speed
TRACE_WINDOW = 4  # a mark's speed is the median of the marks this many either side of it


@dataclass
class SpeedTrace:
    """Seconds of one run of a fixed reference batch, timed by ``time_once`` at each
    :meth:`mark`."""

    time_once: Callable[[], float]
    marks: list[float] = field(default_factory=list)

    def mark(self) -> int:
        """Time the reference once more; returns the new mark's index."""
        self.marks.append(float(self.time_once()))
        return len(self.marks) - 1

    def median(self) -> float:
        return statistics.median(self.marks)

    def start(self) -> float:
        return statistics.median(self.marks[:TRACE_EDGE])

    def end(self) -> float:
        return statistics.median(self.marks[-TRACE_EDGE:])

    def local(self, i: int) -> float:
        """The machine's speed around mark ``i``: the median of the marks up to
        ``TRACE_WINDOW`` either side of it. One mark is one short run, as likely to catch a
        burst of a few hundred milliseconds as the minute's speed; scaling a run by it would
        scale the runs next to a burst down (on the VM, by 1.7 % on average over a profile
        of ``tiny-llama-s``, against 0.5 % with the window)."""
        return statistics.median(self.marks[max(0, i - TRACE_WINDOW):i + TRACE_WINDOW + 1])

    def factor(self, before: int, after: int) -> float:
        """What a run between marks ``before`` and ``after`` is multiplied by to be at the
        trace's median speed."""
        return self.median() / ((self.local(before) + self.local(after)) / 2)

    def summary(self) -> dict:
        """``.fit.json``'s record of the machine over the profile."""
        return {"reference_s": self.median(), "reference_start_s": self.start(), "reference_end_s": self.end(),
                "machine_drift": self.end() / self.start(), "reference_marks": len(self.marks),
                "reference_spread": float(np.quantile(self.marks, 0.9) / np.quantile(self.marks, 0.1))}


@dataclass
class TracedRun:
    """The iteration records of one run and the trace's marks just before and after it."""

    records: list
    before: int
    after: int


def traced(trace: SpeedTrace, run: Callable[[], tuple[T, list]], runs: list[TracedRun]) -> T:
    """Do ``run`` (returning its result and its iteration records), mark the trace after it,
    and add the records to ``runs``. The trace must have a mark before the run."""
    if not trace.marks:
        raise ValueError("mark the trace once before the first traced run")
    before = len(trace.marks) - 1
    result, records = run()
    runs.append(TracedRun(list(records), before, trace.mark()))
    return result


def at_median_speed(runs: Sequence[TracedRun], trace: SpeedTrace) -> list:
    """Every run's iteration records, their ``seconds`` scaled by the run's
    :meth:`SpeedTrace.factor` (records are dataclasses with a ``seconds`` field)."""
    out = []
    for run in runs:
        factor = trace.factor(run.before, run.after)
        out += [replace(r, seconds=r.seconds * factor) for r in run.records]
    return out


def round_orders(points: Sequence[T], rounds: int, shuffle: Callable[[list], None]) -> list[T]:
    """The sweep's points over ``rounds`` rounds: each round all of them, in the order
    ``shuffle`` (a seeded in-place shuffle) leaves them; one round keeps the given order."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if rounds == 1:
        return list(points)
    out = []
    for _ in range(rounds):
        order = list(points)
        shuffle(order)
        out += order
    return out

