"""Execution planning (LeMix Algorithm 1): a new task's forward path on a node, the
idle time Π it leaves and its response time R, plus backward planning.

Each node keeps *trace queues* of planned paths: per stage, forward start/end and, for
training tasks, backward start/end. Planning a forward on stage ``s`` starts after the
task's own forward on ``s - 1`` and the previous task's forward on ``s`` (immediate
dependency). Pending training backwards on that stage are then walked in order (*far
dependency rescheduling*): if the forward ends before a backward begins, it runs in the
idle period before it; otherwise it is pushed after that backward. Backwards executed
between the previous and the new forward are not idleness, so their time is subtracted
from the gap that makes Π. Actual execution times calibrate the paths (Algorithm 2).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol


class LatencyEstimator(Protocol):
    def forward_s(self, batch: int, length: int) -> float: ...
    def backward_s(self, batch: int, length: int) -> float: ...


@dataclass
class StagePath:
    start_f: float
    end_f: float
    start_b: Optional[float] = None
    end_b: Optional[float] = None
    executed_f: bool = False
    executed_b: bool = False


@dataclass
class TaskPath:
    task_id: int
    is_train: bool
    arrival_s: float
    length: int
    batch: int
    stages: list[StagePath]

    def end_f(self, s: int) -> float:
        return self.stages[s].end_f

    @property
    def backward_done(self) -> bool:
        return all(st.executed_b for st in self.stages)


@dataclass
class NodeTrace:
    """A node's planned paths: ``train`` holds training tasks whose backward is pending,
    ``order`` every task in allocation order (the last is Algorithm 1's task_prev)."""

    stages: int
    idle_since: float = 0.0                 # before any task, the node is idle from here
    train: deque = field(default_factory=deque)
    order: list[TaskPath] = field(default_factory=list)
    # running mean and spread of allocated lengths (Welford), for eq. 2 in O(1)
    count: int = 0
    length_mean: float = 0.0
    length_m2: float = 0.0

    def add_length(self, length: int) -> None:
        self.count += 1
        delta = length - self.length_mean
        self.length_mean += delta / self.count
        self.length_m2 += delta * (length - self.length_mean)

    @property
    def length_std(self) -> float:
        return (self.length_m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 0.0

    @property
    def last(self) -> Optional[TaskPath]:
        return self.order[-1] if self.order else None

    def prev_end_f(self, s: int) -> float:
        return self.last.end_f(s) if self.last is not None else self.idle_since

    def busy_until(self) -> float:
        """When the last planned operation on any stage ends."""
        end = self.idle_since
        for path in self.order[-1:]:
            end = max(end, *(st.end_f for st in path.stages))
        for path in self.train:
            end = max(end, *(st.end_b or 0.0 for st in path.stages))
        return end

    def prune(self, keep_last: int = 1) -> None:
        """Drop finished paths: training tasks whose backward ran on every stage, and
        all but the last forward path (only task_prev is read)."""
        while self.train and self.train[0].backward_done:
            self.train.popleft()
        if len(self.order) > keep_last:
            del self.order[:-keep_last]


@dataclass
class PlanResult:
    idle: float        # Π
    response: float    # R
    path: TaskPath


def compute_idleness(trace: NodeTrace, task_id: int, arrival_s: float, length: int, batch: int,
                     is_train: bool, estimator: LatencyEstimator, now: float,
                     idle_cap: float = float("inf")) -> PlanResult:
    """Algorithm 1, line by line (line numbers in comments refer to the paper).

    ``idle_cap`` bounds each stage's gap: a node idle for longer than that counts as
    simply idle, so a node left unused early does not look ever worse as time passes."""
    S = trace.stages
    forward = estimator.forward_s(batch, length)
    idle = 0.0
    pending = deque(trace.train)  # Q_temp
    stages: list[StagePath] = []
    end_prev_stage = max(arrival_s, now)
    for s in range(S):
        start = max(end_prev_stage, trace.prev_end_f(s))                 # line 5
        end = start + forward                                             # line 6
        offset = 0.0
        while pending:                                                    # line 8
            train = pending.popleft()                                     # line 9
            st = train.stages[s]
            if st.start_b is None or end <= st.start_b:                   # line 10
                pending.appendleft(train)                                 # line 11
                break                                                     # line 12
            start = max(start, st.end_b)                                  # line 13
            end = start + forward                                         # line 14
            if trace.prev_end_f(s) <= st.start_b:                         # line 15
                offset += estimator.backward_s(train.batch, train.length)  # line 16
        idle += min(start - trace.prev_end_f(s), idle_cap) - offset      # line 19
        stages.append(StagePath(start, end))
        end_prev_stage = end
    path = TaskPath(task_id, is_train, arrival_s, length, batch, stages)
    if is_train:
        plan_backward(path, trace, estimator)
    return PlanResult(idle, stages[-1].end_f - arrival_s, path)           # line 20


def plan_backward(path: TaskPath, trace: NodeTrace, estimator: LatencyEstimator) -> None:
    """Backward path right after the forward path, stage S down to 1, each stage after
    the later of its own forward end and the next stage's backward end."""
    backward = estimator.backward_s(path.batch, path.length)
    after = path.stages[-1].end_f
    for s in reversed(range(len(path.stages))):
        st = path.stages[s]
        st.start_b = max(after, st.end_f)
        st.end_b = st.start_b + backward
        after = st.end_b


def commit(trace: NodeTrace, path: TaskPath) -> None:
    """Record an allocated task's plan in its node's trace queues."""
    trace.order.append(path)
    if path.is_train:
        trace.train.append(path)
    trace.add_length(path.length)
    trace.prune()


def calibrate(path: TaskPath, stage: int, kind: str, start: float, end: float) -> None:
    """Replace a planned interval with the executed one and shift what follows of this
    task's path by the same delay (Algorithm 2, lines 14 and 17)."""
    st = path.stages[stage]
    if kind == "forward":
        delay = end - st.end_f
        st.start_f, st.end_f, st.executed_f = start, end, True
        later = [(p, "f") for p in path.stages[stage + 1:]]
        later += [(p, "b") for p in path.stages] if path.is_train else []
    else:
        delay = end - (st.end_b or end)
        st.start_b, st.end_b, st.executed_b = start, end, True
        later = [(p, "b") for p in path.stages[:stage]]
    if abs(delay) < 1e-12:
        return
    for p, which in later:
        if which == "f" and not p.executed_f:
            p.start_f += delay
            p.end_f += delay
        elif which == "b" and not p.executed_b and p.start_b is not None:
            p.start_b += delay
            p.end_b += delay
