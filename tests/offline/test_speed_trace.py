"""The profile's speed trace (raycolo.offline.speed_trace), on hand-worked machines."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from raycolo.offline.speed_trace import (TRACE_WINDOW, SpeedTrace, TracedRun, at_median_speed, round_orders,
                                         traced)


@dataclass(frozen=True)
class Rec:
    shape: str
    seconds: float


def test_a_lone_slow_mark_does_not_rescale_the_runs_beside_it():
    marks = [1.0] * 9 + [3.0] + [1.0] * 9          # one reference run caught a burst
    trace = SpeedTrace(lambda: 0.0, marks=list(marks))
    assert trace.median() == 1.0
    assert trace.local(9) == 1.0 and trace.factor(9, 10) == 1.0
    assert trace.start() == trace.end() == 1.0 and trace.summary()["machine_drift"] == 1.0


def test_a_slow_stretch_is_rescaled_to_the_median_speed():
    # a machine 1.5x slower for the middle 11 marks of 31: the median is the fast speed,
    # and a run deep inside the slow stretch is scaled by 1 / 1.5
    marks = [1.0] * 10 + [1.5] * 11 + [1.0] * 10
    trace = SpeedTrace(lambda: 0.0, marks=marks)
    assert trace.median() == 1.0
    assert trace.factor(15, 16) == pytest.approx(1 / 1.5)
    assert trace.factor(0, 1) == 1.0
    # at the stretch's edge the window holds 4 slow marks of 9 (mark 9) and 5 (mark 10)
    assert trace.local(9) == 1.0 and trace.local(10) == 1.5
    assert trace.factor(9, 10) == pytest.approx(1 / 1.25)
    summary = trace.summary()
    assert summary["reference_s"] == 1.0 and summary["reference_marks"] == 31
    assert summary["reference_spread"] == pytest.approx(1.5)     # 90th percentile slow, 10th fast


def test_runs_of_one_shape_agree_once_rescaled():
    """A simulated machine: each run's true cost times the machine's speed factor at
    that moment, which is 1.4 through a slow stretch. Raw, the same shape measures 40 %
    apart depending on when it ran; at the median speed, the same."""
    speed = [1.0] * 30 + [1.4] * 20 + [1.0] * 30
    clock = iter(range(len(speed) + 1))
    cost = {"a": 0.010, "b": 0.030}
    ref = 0.050

    trace = SpeedTrace(lambda: ref * speed[min(next(clock), len(speed) - 1)])
    trace.mark()
    runs: list[TracedRun] = []
    shapes = round_orders(["a", "b"] * 20, 2, random.Random(0).shuffle)
    for i, shape in enumerate(shapes):
        factor = speed[min(i, len(speed) - 1)]
        result = traced(trace, lambda: (shape, [Rec(shape, cost[shape] * factor)]), runs)
        assert result == shape
    raw = {s: sorted(r.seconds for run in runs for r in run.records if r.shape == s) for s in cost}
    assert raw["a"][-1] / raw["a"][0] == pytest.approx(1.4)
    rescaled = at_median_speed(runs, trace)
    assert len(rescaled) == len(shapes)
    # every run away from the stretch's two edges is back at its true cost
    inside = [r for run, r in zip(runs, rescaled)
              if all(abs(m - e) > TRACE_WINDOW for m in (run.before, run.after) for e in (30, 50))]
    assert len(inside) > 50
    for r in inside:
        assert r.seconds == pytest.approx(cost[r.shape])


def test_round_orders():
    points = [(16, 1), (16, 8), (128, 1), (128, 8)]
    assert round_orders(points, 1, random.Random(0).shuffle) == points
    three = round_orders(points, 3, random.Random(0).shuffle)
    assert len(three) == 12
    for k in range(3):
        assert sorted(three[4 * k:4 * k + 4]) == sorted(points)      # each round: every point once
    assert three == round_orders(points, 3, random.Random(0).shuffle)  # seeded
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        round_orders(points, 0, random.Random(0).shuffle)


def test_a_traced_run_needs_a_mark_before_it():
    with pytest.raises(ValueError, match="mark the trace once"):
        traced(SpeedTrace(lambda: 1.0), lambda: (None, []), [])
