"""Time and execution behind small interfaces, so one scheduler drives both worlds.

The scheduler (:mod:`raycolo.online.scheduling.scheduler`) never reads a clock or runs work itself:
an :class:`Executor` asks it where each task goes, at the executor's :class:`Clock` time,
and reports back what ran and when. :class:`~raycolo.online.simulation.sim.ClusterSimulator` is
the simulated executor (a :class:`SimClock` that jumps from event to event); the Ray
runtime of a later issue is the real one (a :class:`WallClock`, actors doing the work).
"""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class SimClock:
    """Simulated seconds; the event loop moves it forward, never back."""

    def __init__(self, start: float = 0.0):
        self._t = start

    def now(self) -> float:
        return self._t

    def advance_to(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"simulated time cannot go back from {self._t} to {t}")
        self._t = t


class WallClock:
    """Seconds since the clock was made (monotonic)."""

    def __init__(self):
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start


class Executor(Protocol):
    """What runs the tasks the scheduler places."""

    clock: Clock

    def dispatch(self, decision) -> None:
        """Start the task of a :class:`~raycolo.online.scheduling.scheduler.Decision` on its node."""

    def utilization(self, node: int) -> float:
        """The node's GPU busy fraction so far (for utilization-driven policies)."""
