"""The cluster-level online scheduler: a registered policy plus LeMix's shared state.

:class:`OnlineScheduler` owns the global queue (deferred training tasks), the per-node
trace queues and the arrival statistics eq. 4 needs. An executor, simulated
(:mod:`raycolo.online.simulation.sim`) or live, reaches it through
:class:`~raycolo.online.scheduling.cluster.Cluster`, which fixes the order of the calls:
:meth:`submit` on every arrival, :meth:`observe` with every executed forward/backward
(calibration), :meth:`node_idle`, then :meth:`retry`. Time
comes from the executor's clock: the scheduler never reads a wall clock itself.

The online policy interface: what a policy decides, and what it asks of the executor.

A policy allocates every arriving task to a node (:meth:`OnlinePolicy.allocate`). What
else it needs from the world is declared, typed, in :class:`PolicyCapabilities`, instead
of being discovered with ``getattr``/``hasattr`` on the policy object:

* ``prioritize``: it may hold a training task back (``allocate`` returns None, eq. 4);
  the scheduler keeps it in the global queue and retries it as nodes finish work;
* ``memory_aware``: node schedulers run Algorithm 2 (wait, then offload) before a forward
  that would pass the stage's memory threshold; without it a forward runs anyway;
* ``queries_utilization``: every decision reads the nodes' GPU utilization. The query is
  the executor's cost, not the scheduler's: a simulator charges ``luf_query_s`` before
  the task reaches its node; a live executor pays whatever the real query takes;
* ``dedicated_nodes``: nodes are split into training and serving groups
  (:meth:`OnlinePolicy.groups`), and training weights are synced to the serving nodes
  every ``sync_every`` training tasks (SEPARATE).

Plans use :meth:`OnlinePolicy.estimator`: by default the node profile the executor
fitted from observed op times; a policy may plan with something else (``lemix-noprofile``
plans with length-blind latencies).

The policies import this module, and name lookup (``raycolo.online.policies``'s
``make_online_policy``) is the CLI's business.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from raycolo.online.scheduling.node_index import NodeIndex
from raycolo.online.lemix_params import LemixParams
from raycolo.online.scheduling.planning import NodeTrace, TaskPath, calibrate
from raycolo.online.profiles import NodeProfile
from raycolo.online.tasks import OnlineTask

EWMA_WEIGHT = 0.1  # arrival statistics for eq. 4's predicted next inference task
RECENT_DECISIONS = 10_000   # decision times kept for percentiles (a service runs for ever)
PLAN_ERRORS = 256           # the latest first-token plan errors eq. 4's margin is taken from
MIN_PLAN_ERRORS = 16        # fewer than this: no margin yet

if TYPE_CHECKING:  # pragma: no cover
    from raycolo.online.scheduling.planning import LatencyEstimator
    from raycolo.online.scheduling.stage_rules import StageRule


@dataclass(frozen=True)
class PolicyCapabilities:
    prioritize: bool = False
    memory_aware: bool = False
    queries_utilization: bool = False
    dedicated_nodes: bool = False


class OnlinePolicy(ABC):
    """Base of every online allocation policy (LeMix, its ablations, the baselines)."""

    name: str = "policy"
    capabilities: PolicyCapabilities = PolicyCapabilities()

    @abstractmethod
    def allocate(self, task: "OnlineTask", scheduler: OnlineScheduler, now: float) -> Optional[int]:
        """A node index, or None to hold a training task back (needs ``prioritize``)."""

    def groups(self, nodes: int) -> Optional[tuple[list[int], list[int]]]:
        """(training nodes, serving nodes) for ``dedicated_nodes`` policies; else None."""
        return None

    def stage_rule(self, profile: "NodeProfile", params) -> "Optional[StageRule]":
        """What each stage runs next on a node (raycolo.online.scheduling.stage_rules); None: the
        oldest ready op (LeMix's node logic). Called once per node: a rule may keep state."""
        return None

    def estimator(self, profile: "NodeProfile") -> "LatencyEstimator":
        """What this policy plans with, given the node profile fitted so far."""
        return profile


@dataclass
class Decision:
    task: OnlineTask
    node: int
    path: Optional[TaskPath]
    decided_s: float             # the scheduler's time of the decision (any query cost is the executor's)
    decision_us: float


@dataclass
class OnlineScheduler:
    policy: OnlinePolicy
    profiles: list[NodeProfile]           # what nodes really are (the executor's truth)
    estimators: list[object]              # what planning believes (profiles, or not)
    params: LemixParams
    utilization: Callable[[int], float] = lambda n: 0.0  # executor's busy fraction (LUF)
    traces: list[NodeTrace] = field(init=False)
    deferred: list[OnlineTask] = field(default_factory=list)
    paths: dict[int, TaskPath] = field(default_factory=dict)
    last_arrival_s: float = 0.0
    inference_gap_s: Optional[float] = None
    inference_length: Optional[float] = None
    last_inference_s: Optional[float] = None
    arrivals_done: bool = False
    decisions: int = 0
    decision_us_total: float = 0.0
    decision_us: deque = field(default_factory=lambda: deque(maxlen=RECENT_DECISIONS))   # the latest, for percentiles
    pending_path: Optional[TaskPath] = None  # set by a policy that planned the task
    interarrival: float = 0.0                 # Δa of the task being decided (eq. 1)
    down: set = field(default_factory=set)    # nodes gone for good: nothing is placed there
    restarting: set = field(default_factory=set)  # nodes whose executor is coming back: avoided meanwhile

    def __post_init__(self) -> None:
        self.planned_first_token: dict[int, float] = {}    # inference task id -> planned last-stage end
        self.plan_errors: deque = deque(maxlen=PLAN_ERRORS)  # executed minus planned, seconds
        self._sorted_errors: list[float] = []                 # the same, sorted (quantiles in O(1))
        self.traces = [NodeTrace(p.stages) for p in self.profiles]
        self.index = NodeIndex(len(self.profiles))    # the traces in LeMix's orders
        self.trace_version = [0] * len(self.profiles)   # bumped whenever a node's trace may change
        self.path_nodes: dict[int, int] = {}            # task id -> node of its planned path
        self.lateness = [(0.0, 0.0)] * len(self.profiles)  # node -> (its latest op's end minus plan, when)
        self._uniform: tuple = (None, False)            # (estimators list, all the same object)
        # every node has the same profile object (one batching rule for all); profiles never change
        self.uniform_profile = all(p is self.profiles[0] for p in self.profiles)
        self._every_node = tuple(range(len(self.profiles)))

    @property
    def nodes(self) -> int:
        return len(self.profiles)

    @property
    def stages(self) -> int:
        return self.profiles[0].stages

    @property
    def placeable(self) -> Sequence[int]:
        """The nodes new work may go to: those neither down nor restarting; while every
        node left is restarting, those (the work waits for them)."""
        if not self.down and not self.restarting:
            return self._every_node
        live = [m for m in range(self.nodes) if m not in self.down]
        return [m for m in live if m not in self.restarting] or live

    def preferred(self, m: int) -> bool:
        """Node ``m`` is neither down nor restarting (O(1); :attr:`placeable` lists them)."""
        return m not in self.down and m not in self.restarting

    def is_placeable(self, m: int) -> bool:
        """``m in self.placeable`` without listing every node."""
        if m in self.down:
            return False
        return m not in self.restarting or len(self.restarting) >= self.nodes - len(self.down)

    @property
    def uniform_estimator(self) -> bool:
        """Every node plans with the same estimator (the cluster sets them all at once)."""
        if self._uniform[0] is not self.estimators:
            first = self.estimators[0]
            self._uniform = (self.estimators, all(e is first for e in self.estimators))
        return self._uniform[1]

    # -- arrivals ------------------------------------------------------------------------
    def submit(self, task: OnlineTask, now: float) -> Optional[Decision]:
        interarrival = task.arrival_s - self.last_arrival_s
        decision = self._decide(task, now, interarrival)
        self.last_arrival_s = task.arrival_s
        if not task.is_train:
            if self.last_inference_s is not None:
                gap = task.arrival_s - self.last_inference_s
                self.inference_gap_s = gap if self.inference_gap_s is None else (
                    (1 - EWMA_WEIGHT) * self.inference_gap_s + EWMA_WEIGHT * gap)
            self.inference_length = task.length if self.inference_length is None else (
                (1 - EWMA_WEIGHT) * self.inference_length + EWMA_WEIGHT * task.length)
            self.last_inference_s = task.arrival_s
        if decision is None:
            self.deferred.append(task)
        return decision

    def resubmit(self, task: OnlineTask, now: float) -> Optional[Decision]:
        """Place again a task whose node lost it (not an arrival: the arrival statistics
        stay as they are); a training task may be deferred as usual."""
        decision = self._decide(task, now, interarrival=0.0)
        if decision is None:
            self.deferred.append(task)
        return decision

    def retry(self, now: float, limit: int = 1) -> list[Decision]:
        """Deferred training tasks, oldest first, until one is still held back; at most
        ``limit`` per call. Executors call this on every completion, so a backlog drains
        at the pace nodes free up and each release is planned on calibrated traces,
        rather than landing all at once on plans nothing has corrected yet."""
        out = []
        while self.deferred and len(out) < limit:
            task = self.deferred[0]
            decision = self._decide(task, now, interarrival=0.0)
            if decision is None:
                break
            self.deferred.pop(0)
            out.append(decision)
        return out

    def _decide(self, task: OnlineTask, now: float, interarrival: float) -> Optional[Decision]:
        started = time.perf_counter()
        self.interarrival = interarrival
        self.pending_path = None
        node = chosen = self.policy.allocate(task, self, now)
        if node is not None and not self.is_placeable(node):
            # The policy did not look at availability: its share of work goes to the next
            # node that can take it (a plan it made for the node it chose is void).
            node = min(self.placeable, key=lambda m: (m - node) % self.nodes)
            self.pending_path = None
        spent = (time.perf_counter() - started) * 1e6
        self.decisions += 1
        self.decision_us_total += spent
        self.decision_us.append(spent)
        if node is None:
            return None
        self.touch(node)
        if chosen != node:
            self.touch(chosen)             # the policy may have planned there
        path = self.pending_path
        if path is not None:
            self.paths[task.task_id] = path
            self.path_nodes[task.task_id] = node
            if not task.is_train:
                self.planned_first_token[task.task_id] = path.end_f(len(path.stages) - 1)
        return Decision(task, node, path, now, spent)

    # -- eq. 4's view of the next inference task ------------------------------------------
    def next_inference(self, now: float) -> Optional[tuple[float, int]]:
        """(predicted arrival, length) of the next inference task, from the arrival
        statistics; None once no more tasks will arrive or none has been seen."""
        if self.arrivals_done or self.inference_length is None:
            return None
        gap = self.inference_gap_s if self.inference_gap_s is not None else 0.0
        last = self.last_inference_s if self.last_inference_s is not None else now
        return max(now, last + gap), int(round(self.inference_length))

    # -- execution feedback ----------------------------------------------------------------
    def observe(self, task_id: int, stage: int, kind: str, start: float, end: float) -> None:
        path = self.paths.get(task_id)
        if path is None:
            return
        if kind == "forward" and stage == len(path.stages) - 1:
            planned = self.planned_first_token.pop(task_id, None)
            if planned is not None:
                self.record_plan_error(end - planned)
        st = path.stages[stage]
        planned_end = st.end_f if kind == "forward" else st.end_b
        if planned_end is not None:
            self.lateness[self.path_nodes[task_id]] = (end - planned_end, end)
        calibrate(path, stage, kind, start, end)
        self.touch(self.path_nodes[task_id])
        if (kind == "backward" and stage == 0) or (kind == "forward" and stage == len(path.stages) - 1
                                                   and not path.is_train):
            self.paths.pop(task_id, None)
            self.path_nodes.pop(task_id, None)

    def node_reset(self, node: int, task_ids, now: float) -> None:
        """Node ``node`` lost its work (``task_ids``): its planned paths are void and it
        is idle from ``now``; what it learnt of allocated lengths stays."""
        old = self.traces[node]
        trace = NodeTrace(old.stages, idle_since=now)
        trace.count, trace.length_mean, trace.length_m2 = old.count, old.length_mean, old.length_m2
        self.traces[node] = trace
        self.lateness[node] = (0.0, now)
        self.touch(node)
        for task_id in task_ids:
            self.paths.pop(task_id, None)
            self.path_nodes.pop(task_id, None)
            self.planned_first_token.pop(task_id, None)

    def touch(self, node: int) -> None:
        """Node ``node``'s trace may have changed: the node index re-keys it and what a
        policy cached of it (its ``trace_version``) is stale."""
        self.index.touch(node)
        self.trace_version[node] += 1

    def record_plan_error(self, seconds: float) -> None:
        """An inference task's first token came ``seconds`` after its plan (early: < 0)."""
        if len(self.plan_errors) == self.plan_errors.maxlen:
            del self._sorted_errors[bisect_left(self._sorted_errors, self.plan_errors[0])]
        self.plan_errors.append(seconds)
        insort(self._sorted_errors, seconds)

    def plan_margin(self, quantile: Optional[float]) -> float:
        """How much later than planned first tokens came out: the ``quantile`` of the latest
        executed-minus-planned last-stage prefill ends (at least 0; 0 without a quantile or
        with fewer than MIN_PLAN_ERRORS of them). Eq. 4 takes it off the threshold."""
        errors = self._sorted_errors
        if quantile is None or len(errors) < MIN_PLAN_ERRORS:
            return 0.0
        return max(0.0, errors[int(quantile * (len(errors) - 1))])

    def backlog(self, node: int, now: float) -> float:
        """Work on ``node`` that its plans do not see, in seconds: how late its latest op
        ended against its plan, drained at one second per second since (at least 0)."""
        late, at = self.lateness[node]
        if late <= 0.0:
            return 0.0
        late -= now - at if now > at else 0.0
        return late if late > 0.0 else 0.0

    def node_idle(self, node: int, now: float) -> None:
        """The executor found the node with nothing to do: idleness starts now."""
        trace = self.traces[node]
        if trace.last is None or trace.busy_until() <= now:
            trace.idle_since = max(trace.idle_since, now)
            self.touch(node)

    @property
    def mean_decision_us(self) -> float:
        return self.decision_us_total / self.decisions if self.decisions else 0.0
