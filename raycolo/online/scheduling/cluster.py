"""The cluster's side of every event: one place, one order, no clock and no Ray.

:class:`Cluster` joins the cluster scheduler (:class:`OnlineScheduler`, which runs the
policy) and one :class:`NodeScheduler` per node. An executor, the simulator
(:mod:`raycolo.online.simulation.sim`) or the live controller, calls it on each event with its own
``now`` and carries out what comes back (:class:`ClusterStep`): tasks to send to nodes,
ops to start, timers to arm.

The order of the callbacks into the scheduler is fixed here and nowhere else:

1. ``submit``: an arriving task is allocated (or deferred);
2. ``observe``: a finished op's measured times calibrate the task's planned path and
   feed the profile learner (η refits replace the planning estimators);
3. ``node_idle``: a node the op left with nothing to do starts its idle time;
4. ``retry``: deferred training tasks are tried again, on plans that already hold 2 and 3.

(Arrivals run 1 then 4; op completions run 2, 3, 4.) Also here: counting training
tasks, the served weights' version per node (staleness), and SEPARATE's weight sync from
the training group to the serving nodes every ``sync_every`` training tasks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Collection, Optional

from raycolo.online.metrics import OnlineMetrics, OnlineResult
from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.node_types import NodeStep, Op, OpKind, Timer
from raycolo.online.scheduling.node_events import Dispatched, NodeEvent, OpDone, Synced, TimerFired, apply, op_done_event
from raycolo.online.lemix_params import LemixParams
from raycolo.online.scheduling.scheduler import OnlinePolicy
from raycolo.online.profiles import NodeProfile, ProfileLearner
from raycolo.online.scheduling.scheduler import Decision, OnlineScheduler
from raycolo.online.tasks import OnlineTask


@dataclass
class ClusterStep:
    """What the executor does next: send ``decisions``' tasks to their nodes (after any
    cost of deciding it pays), start the Ops and arm the Timers of ``actions`` in order."""

    decisions: list = field(default_factory=list)   # Decision
    actions: list = field(default_factory=list)     # Op | Timer
    failed: list = field(default_factory=list)      # OnlineTasks no node can run any more
    aborted: list = field(default_factory=list)     # (node, training task id): drop its activations
    commands: list = field(default_factory=list)    # (node, NodeEvent) for node loops (mirrored)


class Cluster:
    def __init__(self, policy: OnlinePolicy, profile: NodeProfile, nodes: int, params: LemixParams):
        self.policy = policy
        self.params = params
        self.profile = profile
        self.nodes = [self.new_node(n) for n in range(nodes)]
        # mirrored: each node runs as a loop of its own (live: in its first stage's
        # process) and self.nodes are its mirrors, fed the loop's log (apply); what the
        # cluster wants of a node goes to it as a command (ClusterStep.commands)
        self.mirrored = False
        self.learner = ProfileLearner(profile, params.profile_warmup, params.fit_op_cost)
        self.scheduler = OnlineScheduler(policy, [profile] * nodes, [policy.estimator(profile)] * nodes,
                                         params, utilization=self.utilization)
        self.metrics = OnlineMetrics()
        self.train_done = 0
        self.active = 0
        self.serving_nodes: Optional[list[int]] = None
        groups = policy.groups(nodes) if policy.capabilities.dedicated_nodes else None
        if groups is not None:
            train, serve = groups
            if set(serve) != set(train):
                self.serving_nodes = sorted(set(serve) - set(train))
        self._now = 0.0
        self._tasks: dict[int, OnlineTask] = {}
        self.resumed = 0     # tasks placed again after their node lost them
        # Mirrored: tasks sent to a node's loop (dispatch()) that its mirror has not taken yet;
        # a node lost meanwhile loses them with the rest of its work
        self.in_transit: dict[int, dict[int, OnlineTask]] = {}
        self.op_log: list[tuple] = []   # (start, end, node, stage, kind, task ids or version)
        self.op_log_dropped = 0          # entries forget() dropped from the front of op_log

    def forget(self, task_ids, keep_ops: int = 10_000) -> None:
        """A long-running service drops what it recorded of finished ``task_ids`` and all
        but the last ``keep_ops`` entries of the op log, so memory does not grow with every
        request served (its results then cover what is kept)."""
        for tid in task_ids:
            self._tasks.pop(tid, None)
        self.metrics.forget(task_ids)
        if len(self.op_log) > 2 * keep_ops:
            cut = len(self.op_log) - keep_ops
            del self.op_log[:cut]
            self.op_log_dropped += cut

    # -- events ----------------------------------------------------------------------------
    def arrive(self, task: OnlineTask, now: float, last: bool = False) -> ClusterStep:
        """A task arrives (``last``: no more will)."""
        self._now = now
        self._tasks[task.task_id] = task
        self.scheduler.arrivals_done = last
        out = ClusterStep()
        if self.all_down:
            self._fail(task, out)
            return out
        decision = self.scheduler.submit(task, now)
        if decision is not None:
            out.decisions.append(decision)
        self.metrics.deferred_max = max(self.metrics.deferred_max, len(self.scheduler.deferred))
        out.decisions.extend(self.scheduler.retry(now))
        return out

    def retry(self, now: float, end_of_arrivals: bool = False) -> ClusterStep:
        """Retry deferred training tasks without an event (a live executor's periodic
        tick). With ``end_of_arrivals`` no more tasks will come, so none is held back; as
        after a trace's last arrival, they leave one per event."""
        self._now = now
        if end_of_arrivals:
            self.scheduler.arrivals_done = True
        out = ClusterStep()
        out.decisions.extend(self.scheduler.retry(now))
        return out

    def new_node(self, n: int) -> NodeScheduler:
        """Node ``n``'s scheduler as this cluster builds it (its mirror, or its loop)."""
        return node_scheduler(self.policy, self.profile, self.params, n)

    def dispatch(self, decision: Decision, now: float) -> ClusterStep:
        """The decided task reaches its node. Mirrored, it is sent to the node's loop (a
        command) and is in transit until the loop's report brings the Dispatched event
        back (:meth:`apply`): a node lost meanwhile, whose loop may never have seen it,
        loses it with the rest of its work, and it is placed again."""
        self._now = now
        out = ClusterStep()
        if self.mirrored:
            self.in_transit.setdefault(decision.node, {})[decision.task.task_id] = decision.task
        self._command(decision.node, Dispatched(decision.task, now), out)
        return out

    def timer(self, timer: Timer, now: float) -> ClusterStep:
        return self.apply(timer.node, TimerFired(timer.number, now))

    def op_done(self, op: Op, now: float, finished: Collection[int] = (),
                loss: Optional[float] = None) -> ClusterStep:
        """``op`` ended; ``finished``: requests whose token from it was their last."""
        return self.apply(op.node, op_done_event(op.stage, op.seq, now, finished, loss))

    def apply(self, n: int, event: NodeEvent) -> ClusterStep:
        """Node ``n`` took ``event`` (node_events.py): the node's step, and the cluster's
        side of it. Mirrored, the node loop already carried out the step's ops and timers:
        the executor must not start them again."""
        now = self._now = event.now
        out = ClusterStep()
        if type(event) is Dispatched:
            self.in_transit.get(n, {}).pop(event.task.task_id, None)
        done = type(event) is OpDone
        if done:
            record_op(self.op_log, self.learner, self.nodes[n].stages[event.stage].busy, now)
        self._absorb(n, apply(self.nodes[n], event), out)   # (an op not running raises here)
        if done:
            out.decisions.extend(self.scheduler.retry(now))
        return out

    def _command(self, n: int, event: NodeEvent, out: ClusterStep) -> None:
        """The cluster wants ``event`` applied to node ``n``: at once, or (mirrored) by
        the node's loop, whose log brings it back to the mirror."""
        if self.mirrored:
            out.commands.append((n, event))
        else:
            self._absorb(n, apply(self.nodes[n], event), out)

    @property
    def all_down(self) -> bool:
        return len(self.scheduler.down) == len(self.nodes)

    def node_lost(self, n: int, now: float, restarting: bool = True) -> ClusterStep:
        """Node ``n``'s executor lost its state (a worker-group restart). Its unfinished
        work is placed again, under the same task ids: an inference request resumes from
        its prompt plus the tokens it already streamed (its KV is rebuilt by a prefill of
        both, for the tokens it has left), and a training task starts over. A SEPARATE
        serving node reloads the weights it served. :attr:`resumed` counts the tasks
        placed again (a deferred training task is placed by a later retry).

        With ``restarting`` the node is avoided until :meth:`node_back`: its work and new
        arrivals go to the other nodes (unless every node left is restarting too); without
        it the executor is back at once."""
        served = self.nodes[n].update_count
        out = ClusterStep()
        if restarting:
            self.scheduler.restarting.add(n)
        self._place_again(self._reset(n, now, out), now, out)
        if self.serving_nodes is not None and n in self.serving_nodes and served:
            self._command(n, Synced(served, now), out)
        return out

    def node_back(self, n: int, now: float) -> ClusterStep:
        """Node ``n``'s executor is back after :meth:`node_lost`: new work may go there
        again; it is idle from ``now`` (any plan made for it meanwhile is void)."""
        self._now = now
        out = ClusterStep()
        if n in self.scheduler.restarting and n not in self.scheduler.down:
            self.scheduler.restarting.discard(n)
            if self.nodes[n].queued_ops == 0 and not self.nodes[n].joining:
                self.scheduler.node_reset(n, [], now)
            out.decisions.extend(self.scheduler.retry(now))
        return out

    def node_down(self, n: int, now: float) -> ClusterStep:
        """Node ``n`` is gone for good (its worker group failed past its restarts): nothing
        is placed or synced there any more (a policy's choice of it goes to the next live
        node), and its unfinished work is placed again on the others. With no node left,
        that work and every later arrival fail (``failed``)."""
        self.scheduler.down.add(n)
        self.scheduler.restarting.discard(n)
        out = ClusterStep()
        lost = self._reset(n, now, out)
        if not self.all_down:
            self._place_again(lost, now, out)
            return out
        for task in [x if isinstance(x, OnlineTask) else x.task for x in lost] + self.scheduler.deferred:
            self._fail(task, out)
        self.scheduler.deferred = []
        return out

    def _reset(self, n: int, now: float, out: ClusterStep) -> list:
        """Reset node ``n`` (its plans too); returns its unfinished work, the tasks in
        transit to it included."""
        self._now = now
        step = self.nodes[n].reset(now)
        lost = step.lost + list(self.in_transit.pop(n, {}).values())
        self.scheduler.node_reset(n, [x.task_id for x in lost], now)
        self._absorb(n, step, out)
        return lost

    def _place_again(self, lost: list, now: float, out: ClusterStep) -> None:
        for x in lost:
            task = x if isinstance(x, OnlineTask) else resumed_task(x.task, x.generated)
            self._tasks[task.task_id] = task
            self.resumed += 1
            decision = self.scheduler.resubmit(task, now)
            if decision is not None:
                out.decisions.append(decision)

    def _fail(self, task: OnlineTask, out: ClusterStep) -> None:
        self._tasks.pop(task.task_id, None)
        self.metrics.failed[task.task_id] = task
        out.failed.append(task)

    # -- reading ---------------------------------------------------------------------------
    def utilization(self, n: int) -> float:
        """Busy fraction of node ``n``'s GPUs so far, counting ops in flight."""
        node = self.nodes[n]
        return node.busy_seconds(self._now) / (len(node.stages) * max(self._now, 1e-9))

    def result(self, tasks: list[OnlineTask]) -> OnlineResult:
        """Check that the run is over and conserved, and measure it."""
        if self.scheduler.deferred:
            raise RuntimeError(f"{len(self.scheduler.deferred)} training tasks were never placed")
        for node in self.nodes:
            node.check_released()
        return self.metrics.result(self.policy.name, tasks, self.nodes,
                                   self.params.slo_s(self.profile.forward_latency_s),
                                   self.train_done, self.scheduler.mean_decision_us)

    # -- internals -------------------------------------------------------------------------
    def _absorb(self, n: int, step: NodeStep, out: ClusterStep) -> None:
        node = self.nodes[n]
        now = self._now
        out.actions.extend(step.actions)
        out.aborted.extend((n, task_id) for task_id in step.aborted)
        if step.activated:
            self.active += 1
            self.metrics.active_change(now, +1)
        for task_id, stage, kind, start, end in step.observed:
            self.scheduler.observe(task_id, stage, kind, start, end)
            task = self._tasks.get(task_id)
            if task is not None and task.is_train and task_id not in node.micro.split_roots:
                self.learner.observe(task_id, task.batch, task.length, kind, end - start)
        for r in step.tokens:
            self.metrics.token(r.task, now, self.train_done - node.update_count)
        for r in step.finished:
            self.metrics.request_finished(r.task, now)
            self._tasks.pop(r.task_id, None)
        for task in step.trained:
            node.micro.split_roots.discard(task.task_id)
            self.train_done += 1
            self.metrics.trained(task, now)
            self._tasks.pop(task.task_id, None)
            node.update_count = self.train_done  # the node's own weights now hold it
            if self.learner.task_done(task.task_id):
                self.scheduler.estimators = [self.policy.estimator(self.learner.current)] * len(self.nodes)
            if self.serving_nodes is not None and self.train_done % self.params.sync_every == 0:
                for m in self.serving_nodes:  # SEPARATE: push the weights to the live servers
                    if m not in self.scheduler.down:
                        self._command(m, Synced(self.train_done, now), out)
        if step.idle:
            self.active -= 1
            self.metrics.active_change(now, -1)
            self.scheduler.node_idle(n, now)


def record_op(op_log: list, learner: ProfileLearner, op: Optional[Op], now: float) -> None:
    """An op ended: its entry in ``op_log`` (:attr:`Cluster.op_log`), and what the profile
    learner takes from it."""
    if op is None:
        return
    ids = (op.version,) if op.kind == OpKind.SYNC else tuple(x.task_id for x in op.tasks)
    op_log.append((op.start_s, now, op.node, op.stage, op.kind, ids))
    if op.kind == OpKind.DECODE:
        learner.observe_decode(now - op.start_s)
    elif op.kind == OpKind.PREFILL and learner.op_cost:
        learner.observe_prefill(op.batch, max(r.task.length for r in op.tasks), now - op.start_s)


def resumed_task(task: OnlineTask, generated: int) -> OnlineTask:
    """``task`` after ``generated`` of its tokens came out: its prompt now includes them,
    and they count against its budget (same id and arrival, so its latencies include the
    interruption)."""
    if generated == 0:
        return task
    return replace(task, length=task.length + generated,
                   decode_tokens=max(0, task.decode_tokens - generated),
                   max_tokens=task.token_budget - generated)


def node_scheduler(policy, profile, params, n: int) -> NodeScheduler:
    """Node ``n``'s scheduler under ``policy``: the same wherever it is built (a cluster's
    mirror, or the node's own loop next to its stages)."""
    return NodeScheduler(n, profile, params, policy.capabilities.memory_aware,
                         rule=policy.stage_rule(profile, params))
