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

**Batch-aware planning** (``batching``, raycolo's extension; docs/online.md): Algorithm 1
plans every inference task as a forward of its own, but the node (Algorithm 3) runs it in
a padded batch that waits up to T_w to close and costs one forward of ΣC queries at the
batch's longest ℓ. With a :class:`~raycolo.online.scheduling.batch_rule.BatchRule`, each
trace also holds its open planned batch (:class:`PlannedBatch`): an inference task that
reaches a node before that batch closes joins it (the batch is planned again from the
path before it, at the cost of the bigger batch, and the task's Π is what that adds to the
batch's idleness); otherwise it opens a new batch that starts no earlier than it closes. A
training task closes the open batch, as on the node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from raycolo.online.scheduling.batch_rule import BatchRule


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
class PlannedBatch:
    """A node's open inference batch as planned: one path shared by its tasks."""

    path: TaskPath
    base: Optional[list]     # the stages of the path planned before the batch (None: idle_since)
    close_s: float           # when the node's T_w closes it
    queries: int             # ΣC
    length: int              # the longest ℓ (the prefill is padded to it)
    idle: float              # the Π its plan left so far
    closed: bool = False

    def joinable(self, at: float) -> bool:
        """A task reaching the node at ``at`` joins this batch."""
        return not self.closed and at < self.close_s and not self.path.stages[0].executed_f


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
    batch: Optional[PlannedBatch] = None    # batch-aware planning: the open batch

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
    # batch-aware planning: the batch the task would be in
    batching: Optional[BatchRule] = None
    joined: Optional[PlannedBatch] = None     # the open batch it joins (None: it opens one)
    base: Optional[list] = None               # the stages planned before its batch
    close_s: float = 0.0
    queries: int = 0
    longest: int = 0

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
                     idle_cap: float = float("inf"), forward: Optional[float] = None,
                     batching: Optional[BatchRule] = None) -> PlanResult:
    """Algorithm 1, line by line (line numbers in comments refer to the paper).

    ``idle_cap`` bounds each stage's gap: a node idle for longer than that counts as
    simply idle, so a node left unused early does not look ever worse as time passes.
    Q_temp is walked in place (an index into the node's training queue), not copied:
    a decision costs O(S) plus the backwards it actually passes. ``forward``: the
    estimator's forward latency for (batch, length), where the caller has it already
    (one estimator for every node it plans). ``batching``: plan an inference task in the
    batch it will run in (the module docstring)."""
    last = trace.last
    prev = last.stages if last is not None else None                     # task_prev's path
    at = arrival_s if arrival_s > now else now
    joined, queries, longest, close, idle = None, batch, length, at, 0.0
    if batching is not None and not is_train:
        open_batch = trace.batch
        if open_batch is not None and open_batch.joinable(at):
            joined, prev, idle = open_batch, open_batch.base, -open_batch.idle
            queries, longest = open_batch.queries + batch, max(open_batch.length, length)
            close = at if batching.full(queries) else open_batch.close_s
            forward = None
        else:
            close = at if batching.full(batch) else batching.closes_at(at)
    if forward is None:
        forward = estimator.forward_s(queries, longest)
    idle_since = trace.idle_since
    pending = trace.train
    waiting = len(pending)
    head = 0                                                              # Q_temp <- Q_train
    spans = []
    end = close
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
    # line 20 (positional, in PlanResult's field order: built once per node per decision)
    return PlanResult(idle, end - arrival_s, spans, (task_id, is_train, arrival_s, length, batch), trace, estimator,
                      None, batching, joined, prev, close, queries, longest)


def response_upper_bound(trace: NodeTrace, arrival_s: float, length: int, estimator: LatencyEstimator,
                         batching: BatchRule) -> Optional[float]:
    """An upper bound of R of a one-query inference task arriving at ``arrival_s`` that
    opens a batch on ``trace`` (:func:`compute_idleness` with ``batching``), without walking
    the training queue; None where it would join the open batch. In Algorithm 1 a stage's
    forward starts at the later of the previous stage's end and the last forward there, and
    the far-dependency walk moves it only to the end of a pending backward on that stage
    (lines 13-14), so it starts no later than the latest of the three."""
    if trace.batch is not None and trace.batch.joinable(arrival_s):
        return None
    forward = estimator.forward_s(1, length)
    end = arrival_s if batching.full(1) else batching.closes_at(arrival_s)
    for s in range(trace.stages):
        start = trace.prev_end_f(s)
        start = end if end > start else start
        for path in trace.train:
            end_b = path.stages[s].end_b
            if path.stages[s].start_b is not None and end_b > start:
                start = end_b
        end = start + forward
    return end - arrival_s


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


def commit_plan(trace: NodeTrace, plan: PlanResult, now: float = float("-inf")) -> TaskPath:
    """Record the plan of an allocated task (:func:`compute_idleness`'s ``plan`` for its
    node) and return its path: a task that joins the open batch shares the batch's path,
    planned again; one that opens a batch starts a new open batch; a training task closes
    the open one (Algorithm 3, line 8)."""
    task_id, is_train, arrival_s, length, batch = plan.task
    if plan.batching is None or is_train:
        if is_train and trace.batch is not None:
            trace.batch.closed = True
        commit(trace, plan.path, now)
        return plan.path
    joined = plan.joined
    if joined is None:
        path = plan.path
        commit(trace, path, now)
        joined = trace.batch = PlannedBatch(path, plan.base, plan.close_s, plan.queries, plan.longest, plan.idle)
    else:
        for st, (start, end) in zip(joined.path.stages, plan.spans):
            st.start_f, st.end_f = start, end
        joined.close_s, joined.queries, joined.length = plan.close_s, plan.queries, plan.longest
        joined.idle += plan.idle
        trace.add_length(length)
        trace.prune(now)
    joined.closed = plan.batching.full(joined.queries)
    return joined.path


def with_path(trace: NodeTrace, path: TaskPath) -> NodeTrace:
    """A view of ``trace`` with ``path`` committed last (the trace itself is unchanged):
    what eq. 4 plans the next inference task on."""
    return NodeTrace(trace.stages, trace.idle_since, trace.train + [path] if path.is_train else trace.train,
                     [path])


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
