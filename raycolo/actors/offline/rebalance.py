"""Rebalance and adaptation of the offline controller: stage boundaries, grown nodes,
preemption, and the cluster's capacity.

A *stage boundary* is the moment a running node finishes, in reality. There the same
:class:`~raycolo.offline.planner.replay.StageAdjuster` that replays plans in the simulator picks
what runs next (SamuLLM §4.3), and :func:`~raycolo.offline.planner.placement.place` keeps
continuing models on their GPUs. Nodes that leave, change plan or must move are
preempted: each replica is drained, and its unfinished requests, with the tokens they
already generated, move to the node's next replicas. A node that grows hands part of
its requests to its new replicas (:meth:`Rebalancer.rebalance`).

Every ``CAPACITY_CHECK_S`` the controller reads the cluster's GPUs
(:class:`CapacityWatch`). When the cluster has had fewer than the run has seen (and
fewer than the plan's) for ``node_loss_s`` (a node left: its replicas cannot restart,
its placement groups wait for GPUs that are gone), it raises :class:`CapacityLost`.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError

from raycolo.actors.offline.dispatch import Dispatcher
from raycolo.actors.offline.replica_records import Pending
from raycolo.actors.offline.failures import CapacityLost
from raycolo.actors.offline.replicas import ReplicaSet
from raycolo.offline.planner.placement import place
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.replay import StageAdjuster
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.state import AppState, NodeState
from raycolo.offline.runtime.setup import PreparedRun, RunConfig

CAPACITY_CHECK_S = 1.0      # how often the controller reads the cluster's GPUs


class Rebalancer:
    """Picks each stage at its boundary and moves the replicas and requests to it.
    ``replica_set`` starts and stops the replicas, ``dispatcher`` queues the requests."""

    def __init__(self, run: PreparedRun, problem: PlanningProblem, plan: AppPlan,
                 replica_set: ReplicaSet, dispatcher: Dispatcher, now: Callable[[], float]):
        self.run_ = run
        self.problem = problem
        self.comm = run.communicator
        self.replica_set = replica_set
        self.dispatcher = dispatcher
        self.now = now
        stages = [{n: ExecPlan(dp, tp) for n, (dp, tp) in s.items()} for s in plan.selections()]
        self.adjuster = StageAdjuster(problem, stages)
        self.selection: dict[str, ExecPlan] = {}
        self.stages: list[dict] = []
        self.switches: list[dict] = []
        self.rebalanced = 0       # requests a grown node's replicas handed to its new ones
        from ray.util.metrics import Gauge
        self.stage_metric = Gauge("raycolo_stage", "stage the controller is in", tag_keys=("app",))

    def start_node(self, node: str, plan: ExecPlan, gpu_lists: list[tuple[int, ...]],
                   first_rank: int = 0) -> None:
        """Start replicas ``first_rank``.. of ``node`` on ``gpu_lists``; a node that grew
        is rebalanced."""
        if self.replica_set.start_node(node, plan, gpu_lists, len(self.stages), first_rank):
            self.rebalance(node)

    def rebalance(self, node: str) -> None:
        """A grown node: its running replicas keep their share of its requests and hand the
        rest to the new ones, the least advanced first (not started, then the fewest
        tokens generated; those continue with their tokens, as after a preemption). A
        chained node's documents stay where they are (each follows its own replica)."""
        if node in self.comm.position:
            return
        reps = self.replica_set.replicas[node]
        held = lambda r: len(r.outstanding) + len(r.outbox)   # noqa: E731
        share = -(-sum(held(r) for r in reps) // len(reps))
        moved: list[Pending] = []
        for rep in reps:
            extra = held(rep) - share
            if extra <= 0:
                continue
            k = min(extra, len(rep.outbox))
            moved += rep.outbox[len(rep.outbox) - k:]
            del rep.outbox[len(rep.outbox) - k:]
            self.rebalanced += k
            if extra > k and rep.outstanding and rep.ready_s is not None:
                try:
                    items = ray.get(rep.actor.take.remote(extra - k))
                except RayActorError:
                    continue          # it died: its restart runs everything again
                for item in items:
                    p = self.replica_set.handed_back(rep, item)
                    if p is not None:
                        moved.append(p)
                        self.rebalanced += 1
        for p in sorted(moved, key=lambda p: p.ready.index):
            min(reps, key=held).outbox.append(p)
        for rep in reps:
            self.dispatcher.kick(rep)

    def preempt(self, node: str) -> None:
        """Reload a running node in place (same plan and GPUs): its replicas are drained
        and its unfinished requests continue on the new ones."""
        replicas = self.replica_set.replicas
        if node not in replicas:
            raise ValueError(f"node {node} is not running")
        gpus = [r.gpus for r in replicas[node]]
        self.replica_set.stop_node(node)
        self.start_node(node, self.selection[node], gpus)
        self.dispatcher.dispatch(node, self.dispatcher.pending.pop(node, []))

    def app_state(self) -> AppState:
        nodes = {}
        for name, w in self.run_.workload.nodes.items():
            zeros = np.zeros(len(w))
            nodes[name] = NodeState(self.comm.node_done(name), zeros.astype(np.int64), zeros)
        return AppState(self.now(), nodes)

    def boundary(self) -> None:
        replicas, pending = self.replica_set.replicas, self.dispatcher.pending
        started = self.now()
        state = self.app_state()
        running = {n: p for n, p in self.selection.items() if not self.comm.node_finished(n)}
        selection = self.adjuster.next_selection(state, running)
        previous = {n: (self.selection[n], [r.gpus for r in reps]) for n, reps in replicas.items()}
        placed = place(self.problem.cluster, selection, previous) or place(self.problem.cluster, selection, {})
        placement, moved = placed
        decided = self.now()
        for node in list(replicas):
            if self.comm.node_finished(node) or node not in selection or node in moved:
                self.replica_set.stop_node(node)
            elif selection[node] != self.selection.get(node):
                self.replica_set.resize(node, selection[node], placement[node])
        stopped = self.now()
        self.selection = selection
        for node, plan in selection.items():
            have = len(replicas.get(node, []))
            if have < plan.dp:
                self.start_node(node, plan, placement[node][have:], first_rank=have)
        for node in selection:
            if pending.get(node):
                self.dispatcher.dispatch(node, pending.pop(node))
        if self.stages:
            self.stages[-1]["end_s"] = started
        self.stage_metric.set(len(self.stages), tags={"app": self.run_.app.name})
        self.stages.append({"start_s": started, "end_s": None,
                            "models": [{"node": n, "dp": p.dp, "tp": p.tp,
                                        "replica_gpus": [list(g) for g in placement[n]],
                                        "started": any(r.created_s >= stopped for r in replicas[n])}
                                       for n, p in selection.items()]})
        self.switches.append({"at_s": started, "decision_ms": 1e3 * (decided - started),
                              "stop_s": stopped - decided, "started_replicas": sum(
                                  1 for reps in replicas.values() for r in reps if r.created_s >= stopped)})

    def selection_finished(self) -> bool:
        return any(self.comm.node_finished(n) for n in self.selection)


class CapacityWatch:
    """The most GPUs (and the Ray nodes behind them) the cluster had during the run, and
    since when it has had fewer."""

    def __init__(self, problem: PlanningProblem, config: RunConfig, note: Callable[[str], None]):
        self.problem = problem
        self.config = config
        self.note = note
        self.gpus_seen = 0            # the most GPUs the cluster had during the run
        self.nodes_seen: dict[str, str] = {}   # Ray node id -> IP, every node alive during the run
        self.lost_since: Optional[float] = None
        self.checked_at = float("-inf")

    def check(self) -> None:
        """At most every ``CAPACITY_CHECK_S``: compare the cluster's GPUs with the most it had
        (and with the plan's); short for ``node_loss_s`` in a row: :class:`CapacityLost`."""
        now = time.perf_counter()
        if now - self.checked_at < CAPACITY_CHECK_S:
            return
        self.checked_at = now
        alive = int(ray.cluster_resources().get("GPU", 0))
        if alive > self.gpus_seen:     # the nodes behind the most GPUs: those a loss names
            self.nodes_seen.update({n["NodeID"]: n.get("NodeManagerAddress", "")
                                    for n in ray.nodes() if n.get("Alive")})
        self.gpus_seen = max(self.gpus_seen, alive)
        if alive >= min(self.gpus_seen, self.problem.cluster.num_gpus):
            self.lost_since = None
            return
        if self.lost_since is None:
            self.lost_since = now
            self.note(f"the cluster has {alive} GPUs (had {self.gpus_seen}); re-planning "
                      f"in {self.config.node_loss_s:g}s unless they come back")
        if now - self.lost_since < self.config.node_loss_s:
            return
        lost = [{"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"),
                 "gpus": n.get("Resources", {}).get("GPU", 0)}
                for n in ray.nodes() if not n.get("Alive") and n["NodeID"] in self.nodes_seen]
        raise CapacityLost(
            f"the Ray cluster lost GPUs: {alive} left of {self.gpus_seen} for "
            f"{now - self.lost_since:.1f}s (--node-loss-s {self.config.node_loss_s:g}); nodes gone: "
            + (", ".join(f"{n['node_id'][:12]} ({n['ip']})" for n in lost) or "unknown"),
            alive, self.gpus_seen, lost)
