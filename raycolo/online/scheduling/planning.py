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

from dataclasses import dataclass, field
from typing import Optional, Protocol


class LatencyEstimator(Protocol):
    def forward_s(self, batch: int, length: int) -> float: ...
    def backward_s(self, batch: int, length: int) -> float: ...


@dataclass(slots=True)
class StagePath:
    start_f: float
    end_f: float
    start_b: Optional[float] = None
    end_b: Optional[float] = None
    executed_f: bool = False
    executed_b: bool = False


@dataclass(slots=True)
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


@dataclass(slots=True)
class NodeTrace:
    """A node's planned paths: ``train`` holds training tasks whose backward is pending,
    ``order`` every task in allocation order (the last is Algorithm 1's task_prev)."""

    stages: int
    idle_since: float = 0.0                 # before any task, the node is idle from here
    train: list = field(default_factory=list)   # Q_train: pending backwards, in order
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
        if self.order:
            for st in self.order[-1].stages:
                if st.end_f > end:
                    end = st.end_f
        for path in self.train:
            for st in path.stages:
                if st.end_b is not None and st.end_b > end:
                    end = st.end_b
        return end

    def prune(self, now: float = float("-inf"), keep_last: int = 1) -> None:
        """Drop finished paths (Algorithm 1, lines 17-18): training tasks whose backward
        ran on every stage or was planned to end before ``now`` (nothing planned from
        now on can meet it), and all but the last forward path (only task_prev is read)."""
        done = 0
        while done < len(self.train) and (self.train[done].backward_done
                                          or self.train[done].stages[0].end_b <= now):
            done += 1
        if done:
            del self.train[:done]
        if len(self.order) > keep_last:
            del self.order[:-keep_last]


@dataclass(slots=True)
class PlanResult:
    """Π and R of a candidate node; the path is built only for the node that wins
    (allocation scores every node, so this keeps a decision cheap)."""

    idle: float        # Π
    response: float    # R
    spans: list        # planned (start_f, end_f) per stage
    task: tuple        # (task_id, is_train, arrival_s, length, batch)
    trace: "NodeTrace"
    estimator: object
    _path: Optional[TaskPath] = None

    @property
    def path(self) -> TaskPath:
        if self._path is None:
            task_id, is_train, arrival_s, length, batch = self.task
            self._path = TaskPath(task_id, is_train, arrival_s, length, batch,
                                  [StagePath(a, b) for a, b in self.spans])
            if is_train:
                plan_backward(self._path, self.trace, self.estimator)
        return self._path

    def end_f(self, s: int) -> float:
        return self.spans[s][1]


def compute_idleness(trace: NodeTrace, task_id: int, arrival_s: float, length: int, batch: int,
                     is_train: bool, estimator: LatencyEstimator, now: float,
                     idle_cap: float = float("inf"), forward: Optional[float] = None) -> PlanResult:
    """Algorithm 1, line by line (line numbers in comments refer to the paper).

    ``idle_cap`` bounds each stage's gap: a node idle for longer than that counts as
    simply idle, so a node left unused early does not look ever worse as time passes.
    Q_temp is walked in place (an index into the node's training queue), not copied:
    a decision costs O(S) plus the backwards it actually passes. ``forward``: the
    estimator's forward latency for (batch, length), where the caller has it already
    (one estimator for every node it plans)."""
    if forward is None:
        forward = estimator.forward_s(batch, length)
    last = trace.last
    prev = last.stages if last is not None else None                     # task_prev's path
    idle_since = trace.idle_since
    pending = trace.train
    waiting = len(pending)
    head = 0                                                              # Q_temp <- Q_train
    idle = 0.0
    spans = []
    end = arrival_s if arrival_s > now else now
    for s in range(trace.stages):
        prev_end = prev[s].end_f if prev is not None else idle_since
        start = end if end > prev_end else prev_end                       # line 5
        end = start + forward                                             # line 6
        offset = 0.0
        while head < waiting:                                             # line 8
            st = pending[head].stages[s]                                  # line 9
            if st.start_b is None or end <= st.start_b:                   # line 10
                break                                                     # lines 11-12
            head += 1
            if st.end_b > start:
                start = st.end_b                                          # line 13
                end = start + forward                                     # line 14
            if prev_end <= st.start_b:                                    # line 15
                train = pending[head - 1]
                offset += estimator.backward_s(train.batch, train.length)  # line 16
        gap = start - prev_end
        idle += (gap if gap < idle_cap else idle_cap) - offset            # line 19
        spans.append((start, end))
    return PlanResult(idle, end - arrival_s, spans,                      # line 20
                      (task_id, is_train, arrival_s, length, batch), trace, estimator)


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


def commit(trace: NodeTrace, path: TaskPath, now: float = float("-inf")) -> None:
    """Record an allocated task's plan in its node's trace queues."""
    trace.order.append(path)
    if path.is_train:
        trace.train.append(path)
    trace.add_length(path.length)
    trace.prune(now)


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
