"""LeMix (Li et al.): plan every task's path on every node, score nodes by eq. 3, hold
training back when the next inference would miss its SLO (eq. 4).

Registered variants drop one part each, for the paper's ablation (Fig. 17):
``lemix-noprofile`` plans with length-blind latencies (the reference task's, whatever
the query length), ``lemix-noprioritize`` never defers training, ``lemix-nomemory`` runs
without the memory-aware wait-or-offload of Algorithm 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raycolo.online.scheduling.allocation import best_node, idleness_profit, length_consistency, priority, violates_slo
from raycolo.online.scheduling.batch_rule import BatchRule
from raycolo.online.scheduling.planning import commit_plan, compute_idleness, response_upper_bound, with_path
from raycolo.online.scheduling.scheduler import OnlinePolicy, PolicyCapabilities
from raycolo.online.tasks import OnlineTask
from raycolo.online.policies.registry import register_online


@dataclass
class Lemix(OnlinePolicy):
    params: object
    name: str = "lemix"
    prioritize: bool = True
    memory_aware: bool = True
    profiled: bool = True

    def __post_init__(self) -> None:
        self.capabilities = PolicyCapabilities(prioritize=self.prioritize, memory_aware=self.memory_aware)
        self._rules: dict = {}         # id(profile) -> (profile, its BatchRule)
        self._responses: dict = {}     # node -> ((trace version, a′, ℓ′, estimator), R′): eq. 4's cache
        self._holding = False          # the last training task eq. 4 decided was held

    def estimator(self, profile):
        if self.profiled:
            return profile
        return LengthBlind(profile.forward_latency_s / profile.stages,
                           profile.backward_latency_s / profile.stages)

    def allocate(self, task: OnlineTask, sched, now: float) -> Optional[int]:
        hold = self._hold(sched, now) if task.is_train and self.capabilities.prioritize else None
        # the precheck pays where holding is the rule (the last training decision held)
        if hold is not None and self._holding and self._surely_held(sched, task, now, hold):
            return None
        nodes, scanned = self._nodes(sched, task, now)
        plans, scores = self.score(sched, task, now, nodes)
        n = best_node(scores)
        if hold is not None:
            self._holding = self._at_risk(sched, n, plans[n], now, scanned, nodes, hold)
            if self._holding:
                return None
        sched.pending_path = commit_plan(sched.traces[n], plans[n], now)
        return n

    def _next_response(self, sched, n: int, plan, arrival: float, length: int, now: float) -> float:
        """R′ of the next inference task (at ``arrival`` >= now, ``length``) planned on node
        ``n``, with ``plan``'s path committed there first. Without a plan it depends on the
        trace alone (``now`` only through max(now, arrival) = arrival), so it is kept until
        the trace changes (``trace_version``): a backlog of held training tasks retried on
        every event re-plans only the nodes that moved."""
        if plan is not None:
            trace = with_path(sched.traces[n], plan.path)
        else:
            key = (sched.trace_version[n], arrival, length, id(sched.estimators[n]))
            hit = self._responses.get(n)
            if hit is not None and hit[0] == key:
                return hit[1]
            trace = sched.traces[n]
        r = compute_idleness(trace, -1, arrival, length, 1, False, sched.estimators[n], now,
                             batching=self.batching(sched, n)).response
        if plan is None:
            self._responses[n] = (key, r)
        return r

    def batching(self, sched, n: int) -> Optional[BatchRule]:
        """Node ``n``'s batching rule when plans are batch-aware (the node closes batches by it)."""
        if not self.params.batch_aware:
            return None
        profile = sched.profiles[n]
        cached = self._rules.get(id(profile))
        if cached is None or cached[0] is not profile:
            cached = self._rules[id(profile)] = (profile, BatchRule.of(self.params, profile))
        return cached[1]

    def score(self, sched, task: OnlineTask, now: float, nodes) -> tuple[dict, dict]:
        """Algorithm 1's plan and eq. 3's score of the task on each of ``nodes`` (pure)."""
        p = self.params
        # an idle node's gap counts up to the SLO in forward latencies (docs/online.md), so eq. 1's
        # idle penalty stays within slo_multiplier·τ/tau of a busy node's whatever absolute SLO is set
        idle_cap = p.slo_multiplier * sched.profiles[0].forward_latency_s
        traces, estimators, profiles = sched.traces, sched.estimators, sched.profiles
        global_gap = sched.interarrival if p.arrival_gap == "global" else None
        task_id, arrival, length, batch, is_train = task.task_id, task.arrival_s, task.length, task.batch, task.is_train
        tau, lambda1, lambda2, rule = p.tau, p.lambda1, p.lambda2, p.score_rule
        shape = p.length_consistency == "shape"
        backlog = sched.backlog if p.backlog_aware else None
        shared_rule = self.batching(sched, 0) if sched.uniform_profile else None   # one profile: one rule
        plans, scores = {}, {}
        # one estimator for every node (the cluster sets them all at once): one forward latency
        forward = estimators[0].forward_s(batch, length) if sched.uniform_estimator else None
        for n in nodes:
            trace = traces[n]
            plan = compute_idleness(trace, task_id, arrival, length, batch, is_train, estimators[n], now,
                                    idle_cap=idle_cap, forward=forward,
                                    batching=shared_rule if sched.uniform_profile else self.batching(sched, n))
            if global_gap is not None:
                gap = global_gap
            else:
                last = trace.last
                gap = max(0.0, now - last.arrival_s) if last is not None else 0.0
            tau_s = tau * profiles[n].forward_latency_s
            ip = idleness_profit(plan.idle, trace.stages, gap, tau_s)
            lc = length_consistency(length, trace.count, trace.length_mean, trace.length_std,
                                    tau_s if shape else None)
            response = plan.response + backlog(n, now) if backlog is not None else plan.response
            plans[n] = plan
            scores[n] = priority(ip, lc, response, lambda1, lambda2, rule)
        return plans, scores

    def _nodes(self, sched, task: OnlineTask, now: float) -> tuple[list[int], bool]:
        """The nodes to plan the task on, and whether they are every placeable node: all
        of them up to ``scan_nodes``, else the node index's candidates (node_index.py)."""
        p = self.params
        if sched.nodes - len(sched.down) <= p.scan_nodes or not sched.uniform_estimator:
            return sched.placeable, True
        at = max(now, task.arrival_s)
        reach = at + (sched.stages - 1) * sched.estimators[0].forward_s(task.batch, task.length)
        sched.index.refresh(sched.traces, reach)
        found = sched.index.candidates(at, task.length, sched.preferred, p.candidate_window, p.candidate_lengths)
        return (found, False) if found else (sched.placeable, True)

    def _hold(self, sched, now: float) -> Optional[tuple]:
        """What eq. 4 checks against, once per decision: (the next inference task's
        predicted arrival a′, its length ℓ′, the threshold on R′, the per-node backlog added
        to R′: (node, now) -> seconds); None when nothing is predicted (nothing is held)."""
        nxt = sched.next_inference(now)
        if nxt is None:
            return None
        p = self.params
        slo = p.hold_share * p.slo_s(sched.profiles[0].forward_latency_s)
        # each node's backlog calibrates the batch-aware check; without it, the global margin does
        if p.backlog_aware and p.batch_aware:
            return nxt[0], nxt[1], slo, sched.backlog
        return nxt[0], nxt[1], slo - sched.plan_margin(p.plan_error_quantile), _no_backlog

    def _surely_held(self, sched, task: OnlineTask, now: float, hold: Optional[tuple] = None) -> bool:
        """Eq. 4 (batch-aware) would hold this training task wherever Algorithm 1 placed it,
        decided without planning it: on every placeable node, a lower bound of R′ that holds
        both without the task and with it committed there exceeds the threshold. Exact: it
        answers True only where :meth:`_at_risk` would, so a backlog of held tasks retried
        on every event costs O(S) per node plus R′ of the nodes whose trace moved.

        The bound with the task: its forward chain and the next inference task's, each stage
        starting no earlier than the previous stage's end and the node's last planned
        forward (the far-dependency walk and the backward only delay them)."""
        hold = hold if hold is not None else self._hold(sched, now)
        if not self.params.batch_aware or hold is None:
            return False
        arrival, length, slo, backlog = hold
        placeable = sched.placeable
        stages, traces, estimators = sched.stages, sched.traces, sched.estimators
        uniform = sched.uniform_estimator and sched.uniform_profile
        train = serve = close = None
        lates = {}
        for n in placeable:                  # the bounds with the task first: O(S) each
            trace = traces[n]
            late = lates[n] = backlog(n, now)   # the same sums as _at_risk's
            if close is None or not uniform:
                estimator, rule = estimators[n], self.batching(sched, n)
                train = estimator.forward_s(task.batch, task.length)
                serve = estimator.forward_s(1, length)
                close = arrival if rule.full(1) else rule.closes_at(arrival)
            own, end = (task.arrival_s if task.arrival_s > now else now), close
            for s in range(stages):
                prev = trace.prev_end_f(s)
                own = (own if own > prev else prev) + train
                end = (end if end > own else own) + serve
            if end - arrival + late <= slo:
                return False
        # then R′ without it, in _at_risk's order (it reuses the cached R′)
        return all(self._next_response(sched, n, None, arrival, length, now) + lates[n] > slo
                   for n in _least_busy_first(sched, lates))

    def _answers_in_time(self, sched, order, arrival: float, length: int, slo: float, backlog, now: float) -> bool:
        """Below saturation (the last training decision was not held): the least busy of
        ``order`` answers the next inference task in time by an upper bound of its R′
        (planning.response_upper_bound), so eq. 4 passes without planning it. Exact: where
        the bound does not answer, the check plans R′ as before."""
        if not order:
            return False
        n = order[0]
        bound = response_upper_bound(sched.traces[n], arrival, length, sched.estimators[n], self.batching(sched, n))
        return bound is not None and bound + backlog(n, now) <= slo

    def _at_risk(self, sched, node: int, plan, now: float, scanned: bool = True, nodes=(),
                 hold: Optional[tuple] = None) -> bool:
        """Eq. 4 with this training task placed on ``node`` (``hold``: :meth:`_hold`'s, if
        the caller has it). Unscanned (many nodes, one estimator): the other nodes are the
        planned ``nodes`` and the one the index says finishes first."""
        hold = hold if hold is not None else self._hold(sched, now)
        if hold is None:
            return False
        arrival, length, slo, backlog = hold
        p = self.params
        if p.batch_aware:
            # the next inference task planned on every node as it would run: in its batch,
            # behind the forwards and backwards planned there (this task's on ``node``)
            check = sched.placeable
            if not scanned:
                first = sched.index.finish.first(sched.preferred, node)
                check = list(nodes) + ([first[1]] if first is not None and first[1] not in nodes else [])
            # one node that answers in time ends the check: the least busy first, ``node`` last
            order = _least_busy_first(sched, (n for n in check if n != node))
            if not self._holding and self._answers_in_time(sched, order, arrival, length, slo, backlog, now):
                return False
            order += [node] if node in check else []
            return all(self._next_response(sched, n, plan if n == node else None, arrival, length, now)
                       + backlog(n, now) > slo for n in order)
        stages = sched.stages
        free, forward = [], []
        if scanned:
            for n in sched.placeable:
                trace = sched.traces[n]
                last = plan if n == node else trace.last
                free.append(max(now, arrival, last.end_f(stages - 1) if last else now))
                forward.append(stages * sched.estimators[n].forward_s(1, length))
        else:
            other = sched.index.earliest_finish(sched.preferred, exclude=node)
            free = [max(now, arrival, plan.end_f(stages - 1))]
            free += [max(now, arrival, other)] if other is not None else []
            forward = [stages * sched.estimators[node].forward_s(1, length)] * len(free)
        return violates_slo(free, forward, arrival, slo)


def _no_backlog(node: int, now: float) -> float:
    """Eq. 4 without per-node backlogs (its margin comes off the threshold instead)."""
    return 0.0


def _least_busy_first(sched, nodes) -> list:
    """``nodes`` by their last planned forward end on the last stage, earliest first."""
    traces, last = sched.traces, sched.stages - 1
    return sorted(nodes, key=lambda n: traces[n].prev_end_f(last))


@dataclass
class LengthBlind:
    """Latencies without a profile: the reference task's per stage, whatever ℓ and C."""

    forward: float
    backward: float

    def forward_s(self, batch: int, length: int) -> float:
        return self.forward

    def backward_s(self, batch: int, length: int) -> float:
        return self.backward


@register_online("lemix")
def lemix(params, **_):
    return Lemix(params)


@register_online("lemix-noprofile")
def lemix_noprofile(params, **_):
    return Lemix(params, name="lemix-noprofile", profiled=False)


@register_online("lemix-noprioritize")
def lemix_noprioritize(params, **_):
    return Lemix(params, name="lemix-noprioritize", prioritize=False)


@register_online("lemix-nomemory")
def lemix_nomemory(params, **_):
    return Lemix(params, name="lemix-nomemory", memory_aware=False)
