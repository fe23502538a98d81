"""Application state between stages, and what running a stage does to it.

A stage runs a set of (node, plan) pairs from a common start. Each node is simulated
replica by replica with the fast simulator; downstream nodes in the same stage see their
inputs arrive when the upstream simulation finishes them (model-level pipelining). The
stage ends at its first node's finish; the other nodes are stopped there and their
queues are kept, so a node whose plan is unchanged next stage continues exactly where it
was, while a node whose plan changes is reloaded and re-prefills its partial outputs.
"""
from __future__ import annotations

import copy

import hashlib
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

import numpy as np

from raycolo.offline.planner.dispatch import RoundRobin
from raycolo.offline.planner.engines import Actors, start, switch_kind
from raycolo.offline.planner.placement import Placement, place
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.sim import fast
from raycolo.offline.sim.types import ReplicaWorkload, SimResult

_versions = itertools.count(1)
FINISH_TOLERANCE = 1e-9
# Below this many requests per replica, replicas differ too much to stand in for each other.
MIN_REPRESENTATIVE_REQUESTS = 32


@dataclass
class ReplicaQueues:
    """A loaded replica's requests and queues at the end of a stage."""

    requests: np.ndarray
    running: list[tuple[int, int]]
    waiting: list[int]


@dataclass(frozen=True)
class NodeState:
    """Progress of one node. ``version`` changes whenever done/generated change."""

    done: np.ndarray
    generated: np.ndarray
    finish: np.ndarray           # absolute finish time per request (inf: not yet)
    loaded: Optional[ExecPlan] = None
    gpus: Optional[list[tuple[int, ...]]] = None
    replicas: Optional[list[ReplicaQueues]] = None
    load_left: float = 0.0       # loading still in progress when the stage ended
    version: int = field(default_factory=lambda: next(_versions))

    @property
    def finished(self) -> bool:
        return bool(self.done.all())

    @cached_property
    def digest(self) -> bytes:
        """The progress (``done``, ``generated``): all a fresh run of the node depends on."""
        h = hashlib.blake2b(self.done.tobytes(), digest_size=16)
        h.update(self.generated.tobytes())
        return h.digest()

    @cached_property
    def queues_digest(self) -> bytes:
        """What a continuing run depends on beyond the progress: load left and queues."""
        h = hashlib.blake2b(repr(self.load_left).encode(), digest_size=16)
        for q in self.replicas or ():
            h.update(repr((len(q.requests), q.running, q.waiting)).encode())
            h.update(q.requests.tobytes())
        return h.digest()


@dataclass(frozen=True)
class AppState:
    time: float
    nodes: dict[str, NodeState]
    # the engine actors' engines, followed where the problem has ``load_costs`` (else empty)
    actors: Actors = ()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.nodes.values())

    def unfinished(self) -> list[str]:
        return [n for n, s in self.nodes.items() if not s.finished]

    def previous_placement(self) -> dict[str, tuple[ExecPlan, list[tuple[int, ...]]]]:
        return {n: (s.loaded, s.gpus) for n, s in self.nodes.items() if s.loaded is not None}

    @cached_property
    def placement_key(self) -> tuple:
        """:meth:`previous_placement` as a dictionary key."""
        return tuple((n, s.loaded, tuple(s.gpus)) for n, s in self.nodes.items() if s.loaded is not None)


def initial_state(problem: PlanningProblem) -> AppState:
    nodes = {}
    for name, w in problem.workload.nodes.items():
        n = len(w)
        # version 0 marks the initial state, so simulations from it are shared by every search
        nodes[name] = NodeState(np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64),
                                np.full(n, math.inf), version=0)
    return AppState(0.0, nodes, problem.load_costs.actors if problem.load_costs else ())


@dataclass
class NodeRun:
    """One node simulated under one plan for one stage (times are stage-relative)."""

    node: str
    plan: ExecPlan
    continuing: bool
    load_s: float
    finish: np.ndarray           # per request; 0 for done before the stage, inf if not reached
    end: float                   # when every pending request is done (inf if never)
    results: list[Optional[SimResult]]   # one per simulated replica (None: no requests)
    request_maps: list[np.ndarray]       # node request indices of each simulated replica
    key: tuple                           # the evaluator's key: node state versions
    replica_weight: float = 1.0          # >1: one replica simulated stands for all (by requests)
    content: tuple = ()                  # the inputs' content (see StageEvaluator.simulate)
    _useful: dict[float, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def exact(self) -> bool:
        return self.replica_weight == 1.0

    def useful_by(self, t: float) -> float:
        """Useful FLOPs (no recomputation) done by stage time ``t``."""
        useful = self._useful.get(t)
        if useful is None:  # (a greedy asks again for every candidate the stage end stays for)
            useful = self._useful[t] = self.replica_weight * sum(
                r.useful_by(t - self.load_s) for r in self.results if r is not None)
        return useful

    @property
    def total_useful(self) -> float:
        return self.replica_weight * sum(r.total_useful for r in self.results if r is not None)


def _ready_times(problem: PlanningProblem, node: str, st: NodeState,
                 upstream_finish: dict[str, np.ndarray]) -> np.ndarray:
    w = problem.node(node)
    ready = np.zeros(len(w))
    for up, req, upi in w.deps:
        np.maximum.at(ready, req, upstream_finish[up][upi])
    if not w.chain_head.all():
        waiting_for_chain = ~w.chain_head
        waiting_for_chain[1:] &= ~st.done[:-1]  # a chunk whose predecessor is done is free to go
        ready[waiting_for_chain] = math.inf
    return ready


def _assign_replicas(problem: PlanningProblem, node: str, pending: np.ndarray, dp: int,
                     chained: bool) -> list[np.ndarray]:
    """The replicas' requests, by the runtime's own rule (:class:`RoundRobin`: requests in
    turn; for chains, items, so a document stays on one replica)."""
    if dp == 1:
        return [pending]
    ranks = RoundRobin().assign(len(pending), dp, problem.node(node).item[pending] if chained else None)
    return [pending[ranks == r] for r in range(dp)]


def run_node(problem: PlanningProblem, node: str, st: NodeState, plan: ExecPlan, continuing: bool,
             upstream_finish: dict[str, np.ndarray], key: tuple, stop_at: float = math.inf,
             representative: bool = False, load: Optional[float] = None) -> NodeRun:
    """Simulate ``node`` under ``plan`` for one stage, its replicas ready after ``load``
    seconds (default: what is left of its load if it continues, else the problem's
    :meth:`~PlanningProblem.load_seconds`).

    With ``representative``, only the first (largest) data-parallel replica is simulated
    and stands for all of them: the others' requests get the finish time of the request
    at the same queue position. Round-robin makes the replicas statistically alike, so
    this is a good estimate at 1/dp of the cost; searches use it to rank candidates and
    always commit stages with exact simulations.
    """
    w = problem.node(node)
    if load is None:
        load = st.load_left if continuing else problem.load_seconds(node, plan)
    ready = np.maximum(_ready_times(problem, node, st, upstream_finish) - load, 0.0)
    pending = np.flatnonzero(~st.done)
    chained = bool((w.successor >= 0).any())
    if continuing:
        groups = [q.requests[~st.done[q.requests]] for q in st.replicas]
    else:
        groups = _assign_replicas(problem, node, pending, plan.dp, chained)
    limits = problem.limits(w.model.name, plan.tp)
    latency = problem.latency(w.model.name, plan.tp, w.plain_sampling)
    local_of = np.full(len(w), -1, dtype=np.int64)
    finish = np.where(st.done, 0.0, math.inf)
    results: list[Optional[SimResult]] = []
    end = load
    weight = 1.0
    if representative and len(groups) > 1 and len(groups[-1]) >= MIN_REPRESENTATIVE_REQUESTS:
        weight = len(pending) / len(groups[0])
        others, groups = groups[1:], groups[:1]
    for r, idx in enumerate(groups):
        if len(idx) == 0:
            results.append(None)
            continue
        local_of[idx] = np.arange(len(idx))
        succ = None  # none: every request is the last of its chain
        if chained:
            succ = w.successor[idx]
            succ = np.where(succ >= 0, local_of[np.maximum(succ, 0)], -1)
        running, waiting = [], []
        if continuing:
            q = st.replicas[r]
            running = [(int(local_of[i]), s) for i, s in q.running]
            waiting = [int(local_of[i]) for i in q.waiting]
        work = ReplicaWorkload(
            fresh=st.generated[idx] == 0,
            prompt_len=w.input_len[idx] + st.generated[idx],
            remaining=w.output_len[idx] - st.generated[idx],
            ready=ready[idx], successor=succ, running=running, waiting_first=waiting)
        res = fast.simulate(work, limits, latency, stop_at - load)
        results.append(res)
        finish[idx] = res.finish + load
        end = max(end, res.end_time + load)
    if weight != 1.0:
        stand_in = finish[groups[0]]
        for idx in others:
            finish[idx] = stand_in[np.minimum(np.arange(len(idx)), len(stand_in) - 1)]
    if not np.isfinite(finish).all():
        end = math.inf
    return NodeRun(node, plan, continuing, load, finish, end, results, groups, key, weight)


@dataclass
class StageEval:
    selection: dict[str, ExecPlan]
    placement: Placement
    moved: set[str]
    runs: dict[str, NodeRun]
    duration: float
    useful_flops: float          # useful FLOPs done before the stage's first finish

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.selection.values())

    @property
    def throughput(self) -> float:
        """Useful FLOPs done before the stage's first finish, per second (the paper's T(S))."""
        return self.useful_flops / self.duration if self.duration > 0 else 0.0

    @property
    def run_rate(self) -> float:
        """Sum of each node's FLOPs per second over its whole run, load included."""
        return sum(r.total_useful / r.end for r in self.runs.values() if r.end > 0)


class StageEvaluator:
    """Evaluates candidate stages from one state, caching node simulations.

    The cache is keyed by node state versions, so one evaluator can be reused across
    states (a policy keeps a single instance for its whole search). ``simulations`` and
    ``work`` count the node runs missing from that cache: the searches' deterministic
    measure of work done. Below it, equal inputs reached by another path (a state reached
    again with new versions, e.g. the final replay of a search's plan, or a stage another
    policy already ran) are not simulated again: the run is shared by the content of its
    inputs (:meth:`simulate`). That saves time only; what is counted stays the same, so a
    search explores the same states within the same budget.
    """

    def __init__(self, problem: PlanningProblem, representative_replicas: bool = True):
        self.problem = problem
        self.representative = representative_replicas
        self.cache: dict[tuple, NodeRun] = {}
        self.simulations = 0
        # Requests simulated so far (pending requests of every node run asked for, shared
        # or not): the searches' deterministic measure of work done.
        self.work = 0
        self.simulated = 0   # node runs really simulated (the rest came from equal inputs)
        self._chained = {n: bool((problem.node(n).successor >= 0).any()) for n in problem.nodes}
        self._placements: dict[tuple, Optional[tuple[Placement, set[str]]]] = {}

    def fork(self) -> "StageEvaluator":
        """A copy whose cache and counters grow apart from this one's: what a forked
        process starts from (``samullm``'s one-process path runs its second greedy on it)."""
        other = copy.copy(self)
        other.cache = dict(self.cache)
        other._placements = dict(self._placements)
        return other

    def _upstream(self, state: AppState, node: str, runs: dict[str, NodeRun]):
        finish, keys, contents = {}, [], []
        for up in self.problem.upstream[node]:
            if up in runs:
                finish[up] = runs[up].finish
                keys.append(runs[up].key)
                contents.append(runs[up].content)
            else:
                st = state.nodes[up]
                finish[up] = np.where(st.done, 0.0, math.inf)
                keys.append((up, st.version))
                contents.append((up, st.digest))
        return finish, tuple(keys), tuple(contents)

    def _count(self, st: NodeState) -> None:
        self.simulations += 1
        self.work += len(st.done) - int(st.done.sum())

    def simulate(self, node: str, st: NodeState, plan: ExecPlan, continuing: bool,
                 upstream: tuple, key: tuple, estimate: bool = False,
                 stop_at: float = math.inf, load: Optional[float] = None) -> NodeRun:
        """:func:`run_node`, shared by equal inputs: the node's progress (and its queues when
        it continues), the plan, its upstream runs' inputs, the estimate flag, the stop and
        the load. ``upstream``: what :meth:`_upstream` returns. The run is returned under
        ``key``."""
        up_finish, _, up_content = upstream
        # an estimate with too few requests per replica simulates them all: an exact run
        # (an estimate's replicas take the pending requests round-robin: the last has
        # pending // dp of them)
        stands_in = estimate and plan.dp > 1 and \
            (len(st.done) - int(st.done.sum())) // plan.dp >= MIN_REPRESENTATIVE_REQUESTS
        content = ("run", node, st.digest, st.queues_digest if continuing else b"", plan,
                   continuing, up_content, stands_in, stop_at, load)
        run = self.cache.get(content)
        if run is None:
            run = run_node(self.problem, node, st, plan, continuing, up_finish, key,
                           stop_at=stop_at, representative=estimate, load=load)
            run.content = content
            self.cache[content] = run
            self.simulated += 1
        elif run.key != key:
            run = replace(run, key=key)
        return run

    def estimates(self, node: str, plan: ExecPlan, continuing: bool, exact: bool) -> bool:
        """Whether :meth:`node_run` simulates one replica for all (``representative``)."""
        # chains are not alike across replicas: one long document sets the end time
        return not exact and plan.dp > 1 and not continuing and not self._chained[node]

    def node_run(self, state: AppState, node: str, plan: ExecPlan, continuing: bool,
                 runs: dict[str, NodeRun], exact: bool = True, load: Optional[float] = None) -> NodeRun:
        """``node`` simulated for a stage from ``state``, upstream nodes' runs of the same
        stage in ``runs``; ``load``: as :func:`run_node` (a node that continues ignores it)."""
        st = state.nodes[node]
        if continuing or load is None:
            load = st.load_left if continuing else self.problem.load_seconds(node, plan)
        upstream = self._upstream(state, node, runs)
        estimate = self.estimates(node, plan, continuing, exact)
        key = (node, st.version, plan, continuing, upstream[1], estimate, load)
        run = self.cache.get(key)
        if run is None:
            run = self.simulate(node, st, plan, continuing, upstream, key, estimate, load=load)
            self.cache[key] = run
            self._count(st)
        return run

    def place(self, state: AppState, selection: dict[str, ExecPlan]
              ) -> Optional[tuple[Placement, set[str]]]:
        """:func:`place` from ``state``'s placement, remembered per (placement, selection)."""
        key = (state.placement_key, tuple(sorted(selection.items())))
        if key not in self._placements:
            self._placements[key] = place(self.problem.cluster, selection, state.previous_placement())
        placed = self._placements[key]
        if placed is None:
            return None
        placement, moved = placed
        return {n: placement[n] for n in selection}, set(moved)

    def evaluate(self, state: AppState, selection: dict[str, ExecPlan],
                 exact: Optional[bool] = None) -> Optional[StageEval]:
        """Simulate a candidate stage. ``exact=None`` follows the evaluator's setting."""
        if exact is None:
            exact = not self.representative
        placed = self.place(state, selection)
        if placed is None:
            return None
        placement, moved = placed
        runs: dict[str, NodeRun] = {}
        for node in self.problem.nodes:
            if node not in selection:
                continue
            st = state.nodes[node]
            continuing = (st.loaded == selection[node] and node not in moved
                          and st.replicas is not None)
            load = None if continuing else self._load(state, node, selection[node], placement[node])
            runs[node] = self.node_run(state, node, selection[node], continuing, runs, exact, load)
        duration = min(r.end for r in runs.values())
        if not math.isfinite(duration):
            return None
        useful = sum(r.useful_by(duration) for r in runs.values())
        return StageEval(dict(selection), placement, moved, runs, duration, useful)

    def _load(self, state: AppState, node: str, plan: ExecPlan,
              gpus: list[tuple[int, ...]]) -> Optional[float]:
        """With the problem's ``load_costs``: the slowest of the node's replicas to get its
        engine on ``gpus`` from the actors of ``state``. None otherwise (the default)."""
        if self.problem.load_costs is None:
            return None
        key = self.problem.engine_key(node, plan)
        return max(self.problem.switch_seconds(node, plan, switch_kind(state.actors, g, key)) for g in gpus)

    def make_exact(self, state: AppState, ev: StageEval) -> StageEval:
        if all(r.exact for r in ev.runs.values()):
            return ev
        return self.evaluate(state, ev.selection, exact=True)

    def advance(self, state: AppState, ev: StageEval) -> AppState:
        """Run the stage until its first finish; returns the state after it."""
        ev = self.make_exact(state, ev)
        d = ev.duration
        cutoff = d * (1 + FINISH_TOLERANCE) + FINISH_TOLERANCE
        nodes = {}
        stopped_runs: dict[str, NodeRun] = {}
        for node, st in state.nodes.items():
            if node not in ev.selection:
                nodes[node] = replace(st, loaded=None, gpus=None, replicas=None, load_left=0.0)
                continue
            run = ev.runs[node]
            if run.end > cutoff:
                run = self.simulate(node, st, run.plan, run.continuing,
                                    self._upstream(state, node, stopped_runs), run.key, stop_at=cutoff,
                                    load=run.load_s)
                self._count(st)
            stopped_runs[node] = run
            done = st.done | (run.finish <= cutoff)
            generated = st.generated.copy()
            queues = []
            for res, idx in zip(run.results, run.request_maps):
                if res is None:
                    queues.append(ReplicaQueues(idx, [], []))
                    continue
                generated[idx] += res.generated
                queues.append(ReplicaQueues(
                    requests=idx,
                    running=[(int(idx[i]), s) for i, s in res.running],
                    waiting=[int(idx[i]) for i in res.waiting]))
            generated[done] = 0
            finish = np.where(st.done, st.finish,
                              np.where(run.finish <= cutoff, state.time + run.finish, math.inf))
            nodes[node] = NodeState(done, generated, finish, ev.selection[node],
                                    ev.placement[node], None if done.all() else queues,
                                    load_left=max(0.0, run.load_s - d))
        actors = state.actors
        if self.problem.load_costs is not None:
            for node, run in ev.runs.items():
                if not run.continuing:
                    key = self.problem.engine_key(node, run.plan)
                    for gpus in ev.placement[node]:
                        actors = start(actors, gpus, key, self.problem.load_costs.max_parked)
        return AppState(state.time + d, nodes, actors)
