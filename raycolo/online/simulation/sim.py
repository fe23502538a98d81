"""A discrete-event simulator of a cluster of pipeline nodes serving and training.

The scheduling is not here: :class:`~raycolo.online.scheduling.cluster.Cluster` (the policy, the
cluster scheduler and one :class:`~raycolo.online.scheduling.node.NodeScheduler` per node, the same
objects the live runtime drives) decides what runs where and when. This module is only
what a simulation adds to them:

* an event heap and a :class:`SimClock` that jumps from event to event;
* op durations from the node's :class:`NodeProfile`: a prefill is η_F·ΣC·(max ℓ)², a
  decode step ``decode_step_s`` at the batch's mean context, a training forward/backward
  η·C·ℓ², a weight sync the stage's weights over ``sync_bandwidth``; an offloaded forward
  or a backward reloading offloaded activations adds the transfer over
  ``offload_bandwidth``, an overrun forward is ``overrun_slowdown`` times slower;
* when a request ends: after its trace's ``decode_tokens`` (a live engine stops at EOS);
* the cost of a policy's utilization query (``luf_query_s``) before its task arrives;
* the metrics of the run (:class:`~raycolo.online.metrics.OnlineResult`).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Optional


from raycolo.online.simulation.clock import SimClock
from raycolo.online.scheduling.cluster import Cluster, ClusterStep
from raycolo.online.metrics import OnlineResult
from raycolo.online.scheduling.node_types import FORWARD_KINDS, Op, OpKind, Timer
from raycolo.online.scheduling.node_events import (Dispatched, NodeEvent, TimerFired, action_key, apply, check_in_step,
                                        op_done_event)
from raycolo.online.lemix_params import LemixParams
from raycolo.online.scheduling.scheduler import OnlinePolicy
from raycolo.online.profiles import NodeProfile
from raycolo.online.scheduling.scheduler import Decision
from raycolo.online.scheduling.stage_rules import expected_op_s
from raycolo.online.tasks import OnlineTask


def op_duration(op: Op, profile: NodeProfile, params: LemixParams) -> float:
    """Seconds ``op`` takes on its stage according to ``profile``."""
    if op.kind == OpKind.SYNC:
        seconds = profile.weight_bytes_per_stage / params.sync_bandwidth
    else:
        seconds = expected_op_s(op, profile)
    if op.kind in FORWARD_KINDS:
        if op.offloaded:
            seconds += op.mem_bytes / params.offload_bandwidth
        elif op.overrun:
            seconds *= params.overrun_slowdown
    if op.reload:
        seconds += op.mem_bytes / params.offload_bandwidth
    return seconds


def query_cost_s(policy: OnlinePolicy, params: LemixParams) -> float:
    """What a decision costs before its task reaches its node, simulated: MIX-LUF's
    utilization query (Table III)."""
    return params.luf_query_s if policy.capabilities.queries_utilization else 0.0


def ends_with(op: Op) -> set[int]:
    """Requests whose token from ``op`` (a last-stage prefill or decode) is their last,
    by the trace's decode lengths."""
    return {r.task_id for r in op.tasks if r.generated + 1 >= r.task.decode_tokens}


class ClusterSimulator:
    """The simulated executor of a :class:`Cluster`."""

    def __init__(self, tasks: list[OnlineTask], profile: NodeProfile, nodes: int,
                 policy: OnlinePolicy, params: LemixParams, node_loops: bool = False):
        self.tasks = sorted(tasks, key=lambda t: (t.arrival_s, t.task_id))
        self.profile = profile
        self.params = params
        self.policy = policy
        self.cluster = Cluster(policy, profile, nodes, params)
        # node_loops: each node runs as its own loop and the cluster holds mirrors fed the
        # loops' events (node_events.py), as when the loops run on their nodes; every
        # step of a loop is checked against its mirror's
        self.loops = [self.cluster.new_node(n) for n in range(nodes)] if node_loops else None
        self.cluster.mirrored = node_loops
        self.clock = SimClock()
        self._events: list = []
        self._seq = itertools.count()
        self.query_delay_s = query_cost_s(policy, params)

    @property
    def now(self) -> float:
        return self.clock.now()

    def _at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> OnlineResult:
        last = self.tasks[-1] if self.tasks else None
        for task in self.tasks:
            self._at(task.arrival_s, self._arrive, task, task is last)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self.clock.advance_to(t)
            fn(*args)
        return self.cluster.result(self.tasks)

    # -- events ----------------------------------------------------------------------------
    def _arrive(self, task: OnlineTask, last: bool) -> None:
        self._apply(self.cluster.arrive(task, self.now, last))

    def _dispatch(self, decision: Decision) -> None:
        self._event(decision.node, Dispatched(decision.task, self.now))

    def _timer(self, timer: Timer) -> None:
        self._event(timer.node, TimerFired(timer.number, self.now))

    def _done(self, op: Op) -> None:
        last = op.stage == self.profile.stages - 1
        finished = ends_with(op) if last and op.kind in (OpKind.PREFILL, OpKind.DECODE) else ()
        self._event(op.node, op_done_event(op.stage, op.seq, self.now, finished))

    def _event(self, n: int, event: NodeEvent) -> None:
        """Node ``n`` takes ``event``: the cluster's node (or, with node loops, the node's
        loop, then its mirror from the loop's log) and the cluster's side of it."""
        if self.loops is None:
            self._apply(self.cluster.apply(n, event))
            return
        started = apply(self.loops[n], event).actions
        step = self.cluster.apply(n, event)
        check_in_step(n, event, [action_key(a) for a in started], step.actions)
        self._apply(step, started)

    def _apply(self, step: ClusterStep, actions: Optional[list] = None) -> None:
        for decision in step.decisions:
            self._at(decision.decided_s + self.query_delay_s, self._dispatch, decision)
        for action in step.actions if actions is None else actions:
            if isinstance(action, Timer):
                self._at(action.at_s, self._timer, action)
            else:
                self._at(self.now + op_duration(action, self.profile, self.params), self._done, action)
        for n, event in step.commands:     # node loops: what the cluster asked of them
            self._event(n, event)


def simulate(tasks: list[OnlineTask], profile: NodeProfile, nodes: int, policy: OnlinePolicy,
             params: Optional[LemixParams] = None) -> OnlineResult:
    """Run ``policy`` (an :class:`OnlinePolicy` object; ``raycolo.policies.make_online_policy``
    builds one by name) over ``tasks`` on ``nodes`` nodes of ``profile``."""
    return ClusterSimulator(tasks, profile, nodes, policy, params or LemixParams()).run()
