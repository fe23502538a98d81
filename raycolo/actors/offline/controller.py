"""The controller: runs an application's plan on engine actors, stage by stage.

One loop, driven by results. Each live replica has at most one ``run`` call in flight;
when it returns, the finished outputs are persisted, handed to the communicator, and
the requests they make ready are dispatched: to a running replica of their node (round
robin; a chain's document stays on one replica), or queued until their node runs.

A *stage boundary* is the moment a running node finishes, in reality. There the same
:class:`~raycolo.offline.planner.replay.StageAdjuster` that replays plans in the simulator picks
what runs next (SamuLLM §4.3), and :func:`~raycolo.offline.planner.placement.place` keeps
continuing models on their GPUs. Nodes that leave, change plan or must move are
preempted: each replica is drained, and its unfinished requests, with the tokens they
already generated, move to the node's next replicas. A node whose plan only changes its
data parallelism keeps the replicas whose GPUs it keeps (a dp1 replica stays replica 0
of the dp2 plan and runs on with its requests). A replica whose actor dies is restarted
in its placement group and its unfinished requests run again.

Every ``CAPACITY_CHECK_S`` the controller reads the cluster's GPUs. When the cluster has
had fewer than the run has seen (and fewer than the plan's) for ``node_loss_s`` (a node
left: its replicas cannot restart, its placement groups wait for GPUs that are gone), it
stops every actor and raises :class:`CapacityLost`; ``run_application`` then plans what
the journal does not hold on the GPUs that remain.

Drained actors are not stopped: they wait in a warm pool on their GPUs (their placement
group held), and the next replica placed on exactly those GPUs takes one over with
``EngineActor.swap`` (a *keep* for the same model and config, a *swap* for another),
milliseconds to a model load instead of a process start. A replica on GPUs the pool
does not hold first evicts the pooled actors on any of them, then starts cold.
"""
from __future__ import annotations

import statistics
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raycolo.actors.offline.engine_actor import EngineActor
from raycolo.offline.planner.dispatch import RoundRobin
from raycolo.offline.planner.engines import SWITCH_KINDS
from raycolo.offline.planner.placement import place
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.replay import StageAdjuster
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.state import AppState, NodeState
from raycolo.generation import StopChecker
from raycolo.offline.runtime.communicator import ReadyRequest
from raycolo.offline.runtime.setup import PreparedRun

STARTUP_TIMEOUT_S = 900.0
CAPACITY_CHECK_S = 1.0      # how often the controller reads the cluster's GPUs


class RunFailed(RuntimeError):
    """The run cannot go on; what is in the journal stays, and a rerun resumes from it."""


class ReplicaFailed(RunFailed):
    """A replica could not start, or died more often than ``max_restarts`` allows."""


class CapacityLost(RunFailed):
    """The cluster has had fewer GPUs than this run saw for ``node_loss_s``: what is left
    must be planned again on ``gpus_left`` GPUs (``lost_nodes``: the Ray nodes that died)."""

    def __init__(self, message: str, gpus_left: int, gpus_before: int, lost_nodes: list[dict]):
        super().__init__(message)
        self.gpus_left, self.gpus_before, self.lost_nodes = gpus_left, gpus_before, lost_nodes


@dataclass
class Pending:
    """A request on its way: queued, sent to a replica, or moved after a preemption."""

    ready: ReadyRequest
    prompt_ids: Optional[list[int]] = None   # set once a preemption returned it
    generated: list[int] = field(default_factory=list)
    preemptions: int = 0
    attempts: int = 0
    dispatched_s: float = 0.0

    def payload(self) -> dict:
        params = self.ready.sampling(len(self.generated))     # a SamplingParams
        prompt = self.ready.prompt if self.prompt_ids is None else self.prompt_ids + self.generated
        return {"key": self.ready.key, "prompt": prompt, "params": params}


@dataclass
class Replica:
    node: str
    plan: ExecPlan
    rank: int
    gpus: tuple[int, ...]
    name: str
    pg: object
    actor: object
    created_s: float
    info_ref: Optional[object] = None
    ready_s: Optional[float] = None
    stopped_s: Optional[float] = None
    info: dict = field(default_factory=dict)
    inflight: Optional[object] = None
    outbox: list[Pending] = field(default_factory=list)
    outstanding: dict[str, Pending] = field(default_factory=dict)
    busy_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    restarts: int = 0
    stopping: bool = False
    switch: str = "cold"        # how it got its actor: cold (a new one), swap, wake or keep (pooled)

    def segment_rows(self, end_s: float) -> list[tuple[int, float, float, float, str]]:
        stop = self.stopped_s if self.stopped_s is not None else end_s
        ready = self.ready_s if self.ready_s is not None else stop
        return [(g, self.created_s, min(ready, stop), stop, self.node) for g in self.gpus]


@dataclass
class Pooled:
    """A drained engine actor kept warm on its GPUs, with the placement group holding them."""

    gpus: tuple[int, ...]
    pg: object
    actor: object
    # the engine config it serves with and those it parked (EngineActor.info's keys), where
    # known: the warm pool's start tells the planner (raycolo.offline.planner.engines)
    engine_key: str = ""
    parked_keys: tuple[str, ...] = ()


def _moved_text(ready: ReadyRequest, tokens: list[int], tokenizer) -> str:
    """The text of a request that ran on more than one replica: its whole output replayed
    through raycolo.generation's stop checker (stop token left out, stop strings cut)."""
    checker = StopChecker(ready.sampling(), tokenizer.eos_token_ids, tokenizer)
    for token in tokens:
        if checker.append(token):
            break
    return checker.text(tokenizer)


def stop_actor(actor, pg) -> None:
    """Stop an engine actor at once and give its placement group's GPUs back."""
    try:
        ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    except Exception:  # already gone
        pass


class Controller:
    def __init__(self, run: PreparedRun, problem: PlanningProblem, plan: AppPlan,
                 on_output: Optional[Callable[["Controller", dict], None]] = None):
        self.run_ = run
        self.config = run.config
        self.problem = problem
        self.plan = plan
        self.comm = run.communicator
        self.store = run.store
        self.on_output = on_output
        # Ray actor names get this run's token: a gracefully exiting actor of an earlier run
        # of the same application keeps its name until it is gone.
        self.run_token = uuid.uuid4().hex[:8]
        stages = [{n: ExecPlan(dp, tp) for n, (dp, tp) in s.items()} for s in plan.selections()]
        self.adjuster = StageAdjuster(problem, stages)
        self.selection: dict[str, ExecPlan] = {}
        self.replicas: dict[str, list[Replica]] = {}
        self.all_replicas: list[Replica] = []
        self.pending: dict[str, list[Pending]] = defaultdict(list)
        self.by_ref: dict[object, tuple[Replica, str]] = {}
        self.turns: dict[str, RoundRobin] = defaultdict(RoundRobin)    # the planner's dispatch rule
        self.names_used: dict[str, int] = defaultdict(int)
        self.stages: list[dict] = []
        self.switches: list[dict] = []
        self.pool: dict[tuple[int, ...], Pooled] = {}
        self.evicted = 0
        self.rebalanced = 0       # requests a grown node's replicas handed to its new ones
        self.moved_requests = 0
        self.controller_s = 0.0
        self.run_requests = 0
        self.t0 = 0.0
        self.progress = None
        self.gpus_seen = 0            # the most GPUs the cluster had during the run
        self.nodes_seen: dict[str, str] = {}   # Ray node id -> IP, every node alive during the run
        self.lost_since: Optional[float] = None
        self.checked_at = float("-inf")
        from ray.util.metrics import Counter, Gauge
        self.requests_metric = Counter("raycolo_requests_done", "requests answered, per node",
                                       tag_keys=("app", "node"))
        self.stage_metric = Gauge("raycolo_stage", "stage the controller is in", tag_keys=("app",))

    # -- clock --------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.t0

    # -- replicas -----------------------------------------------------------------------
    def engine_config(self, node: str, plan: ExecPlan) -> dict:
        return self.run_.engine_config(self.problem, node, plan)

    def _spawn(self, rep: Replica, suffix: str = "") -> None:
        label = rep.name + suffix
        rep.actor = EngineActor.options(
            name=f"{label}~{self.run_token}", num_gpus=1, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(rep.pg, placement_group_bundle_index=0),
        ).remote(self.engine_config(rep.node, rep.plan), label, self.config.parked_engines)
        rep.info_ref = rep.actor.info.remote()
        self.by_ref[rep.info_ref] = (rep, "info")
        rep.ready_s = None

    def _start_node(self, node: str, plan: ExecPlan, gpu_lists: list[tuple[int, ...]],
                    first_rank: int = 0) -> None:
        """Start replicas ``first_rank``.. of ``node`` on ``gpu_lists``: from the warm pool
        where it holds exactly those GPUs, else cold (evicting pooled actors there)."""
        replicas = []
        for rank, gpus in enumerate(gpu_lists, start=first_rank):
            gpus = tuple(gpus)
            gpu_text = ",".join(str(g) for g in gpus)
            name = f"{self.run_.app.name}/{node}/r{rank}@gpu{gpu_text}#s{len(self.stages)}"
            self.names_used[name] += 1
            if self.names_used[name] > 1:  # reloaded within one stage: names must stay unique
                name += f"#reload{self.names_used[name] - 1}"
            pooled = self.pool.pop(gpus, None)
            if pooled is not None:
                rep = Replica(node, plan, rank, gpus, name, pooled.pg, pooled.actor, self.now(), switch="swap")
                rep.info_ref = rep.actor.swap.options(name=f"{name}.swap").remote(
                    self.engine_config(node, plan), name)
                self.by_ref[rep.info_ref] = (rep, "info")
            else:
                self._evict(gpus)
                pg = placement_group([{"GPU": 1}] * plan.tp, strategy=self.config.placement_strategy,
                                     name=f"{name}/pg")
                rep = Replica(node, plan, rank, gpus, name, pg, None, self.now())
                self._spawn(rep)
            replicas.append(rep)
        grown = node in self.replicas
        self.replicas[node] = self.replicas.get(node, []) + replicas
        self.all_replicas.extend(replicas)
        if grown:
            self._rebalance(node)

    def _rebalance(self, node: str) -> None:
        """A grown node: its running replicas keep their share of its requests and hand the
        rest to the new ones, the least advanced first (not started, then the fewest
        tokens generated; those continue with their tokens, as after a preemption). A
        chained node's documents stay where they are (each follows its own replica)."""
        if node in self.comm.position:
            return
        reps = self.replicas[node]
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
                    p = self._handed_back(rep, item)
                    if p is not None:
                        moved.append(p)
                        self.rebalanced += 1
        for p in sorted(moved, key=lambda p: p.ready.index):
            min(reps, key=held).outbox.append(p)
        for rep in reps:
            self._kick(rep)

    def _evict(self, gpus: tuple[int, ...]) -> None:
        """Stop the pooled actors holding any of ``gpus`` (a replica starts there cold)."""
        for key in [k for k in self.pool if set(k) & set(gpus)]:
            pooled = self.pool.pop(key)
            stop_actor(pooled.actor, pooled.pg)
            self.evicted += 1

    def _kick(self, rep: Replica) -> None:
        # Not before it is ready: a pooled actor runs calls beside its swap, which would
        # start the replica afresh under requests already handed over.
        if (rep.stopping or rep.ready_s is None or rep.inflight is not None
                or not (rep.outbox or rep.outstanding)):
            return
        batch = [p.payload() for p in rep.outbox]
        for p in rep.outbox:
            p.dispatched_s = self.now()
            p.attempts += 1
            rep.outstanding[p.ready.key] = p
        rep.outbox = []
        rep.inflight = rep.actor.run.options(name=f"{rep.name}.run").remote(batch, self.config.slice_s)
        self.by_ref[rep.inflight] = (rep, "run")

    def _dispatch(self, node: str, items: list[Pending]) -> None:
        replicas = self.replicas[node]
        ordered = sorted(items, key=lambda p: p.ready.index)
        chained = node in self.comm.position
        ranks = self.turns[node].assign(len(ordered), len(replicas),
                                        [p.ready.item for p in ordered] if chained else None)
        touched = set()
        for p, rank in zip(ordered, ranks.tolist()):
            replicas[rank].outbox.append(p)
            touched.add(rank)
        for rank in touched:
            self._kick(replicas[rank])

    def _enqueue(self, ready: list[ReadyRequest]) -> None:
        by_node = defaultdict(list)
        for r in ready:
            by_node[r.node].append(Pending(r))
        for node, items in by_node.items():
            if node in self.replicas:
                self._dispatch(node, items)
            else:
                self.pending[node].extend(items)

    # -- results ------------------------------------------------------------------------
    def _finish(self, rep: Replica, outputs: list) -> None:
        records, done = [], []
        for out in outputs:
            p = rep.outstanding.pop(out.request_id)
            tokens = p.generated + list(out.token_ids)
            tokenizer = self.comm.tokenizers[p.ready.node]
            text = out.text if not p.generated else _moved_text(p.ready, tokens, tokenizer)
            prompt_tokens = len(out.prompt_token_ids) - len(p.generated)
            records.append({
                "key": p.ready.key, "node": p.ready.node, "index": p.ready.index,
                "item": p.ready.item, "item_id": self.run_.texts.row_ids.get(p.ready.item),
                "model": self.run_.app.node(p.ready.node).model,
                "replica": rep.name, "prompt": p.ready.prompt, "text": text,
                "prompt_tokens": prompt_tokens, "output_tokens": len(tokens), "token_ids": tokens,
                "finish_reason": out.finish_reason, "dispatched_s": p.dispatched_s,
                "finished_s": self.now(), "engine_latency_s": out.finish_s - out.arrival_s,
                "ttft_s": out.first_token_s - out.arrival_s,
                "preemptions": p.preemptions + out.preemptions, "attempts": p.attempts})
            done.append((p.ready.node, p.ready.index, text))
        self.store.append(records)  # persisted before anything downstream sees it
        self.run_requests += len(records)
        for record, (node, index, text) in zip(records, done):
            self.requests_metric.inc(1, tags={"app": self.run_.app.name, "node": node})
            self._enqueue(self.comm.complete(node, index, text))
            if self.progress is not None:
                self.progress.update(1)
            if self.on_output is not None:
                self.on_output(self, record)

    def _handle(self, ref) -> None:
        rep, kind = self.by_ref.pop(ref)
        try:
            result = ray.get(ref)
        except RayTaskError as exc:  # the engine raised: a bug or a bad request, not a crash
            raise ReplicaFailed(f"replica {rep.name}: {_cause(exc)}") from None
        except RayActorError as exc:
            if rep.stopped_s is not None:
                return
            if rep.ready_s is None and getattr(exc, "actor_init_failed", False):
                # its constructor raised: a start failure (a bad model or config), not a crash
                raise ReplicaFailed(f"replica {rep.name} failed to start: {_cause(exc)}") from None
            self._restart(rep, exc)  # the process died (killed, out of memory), starting or not
            return
        if kind == "info":
            rep.info = result
            rep.switch = result.get("switch", rep.switch)
            rep.ready_s = self.now()
            self._kick(rep)
            return
        rep.inflight = None
        self._account(rep, result)
        self._finish(rep, result["outputs"])
        self._kick(rep)

    @staticmethod
    def _account(rep: Replica, result: dict) -> None:
        rep.busy_s += result["busy_s"]
        rep.tokens += result["tokens"]
        rep.steps += result["steps"]

    def _restart(self, rep: Replica, exc: Exception) -> None:
        rep.restarts += 1
        if rep.restarts > self.config.max_restarts:
            raise ReplicaFailed(f"replica {rep.name} died {rep.restarts} times "
                                f"(--max-restarts {self.config.max_restarts}): {_cause(exc)}")
        for ref in [r for r, (owner, _) in self.by_ref.items() if owner is rep]:
            del self.by_ref[ref]
        lost = list(rep.outstanding.values()) + rep.outbox
        rep.outstanding, rep.outbox, rep.inflight = {}, [], None
        if self.progress is not None:
            self.progress.write(f"replica {rep.name} died ({_cause(exc)}); restarting it, "
                                f"{len(lost)} requests run again")
        self._spawn(rep, f"#restart{rep.restarts}")
        rep.outbox = sorted(lost, key=lambda p: p.ready.index)
        self._kick(rep)

    def _stop_node(self, node: str) -> None:
        self._stop_replicas(node, self.replicas.pop(node))

    def _stop_replicas(self, node: str, replicas: list[Replica]) -> None:
        """Drain ``replicas`` of ``node``: their unfinished requests wait in ``pending``
        for the node's next replicas; the drained actors go to the warm pool."""
        for rep in replicas:
            rep.stopping = True  # no further run calls: everything after this comes from drain
            left = []
            if rep.ready_s is not None:  # a replica still starting has done nothing: just stop it
                drain = rep.actor.drain.remote()  # stops the engine loop; a pending run returns
                if rep.inflight is not None:
                    self._handle(rep.inflight)
                try:
                    drained = ray.get(drain)
                    self._account(rep, drained)
                    self._finish(rep, drained["outputs"])
                    left = drained["unfinished"]
                except RayActorError:
                    left = None       # died while draining: nothing to pool
            rep.stopped_s = self.now()
            for ref in [r for r, (owner, _) in self.by_ref.items() if owner is rep]:
                del self.by_ref[ref]
            rep.inflight = None
            if rep.ready_s is not None and left is not None:
                self.pool[rep.gpus] = Pooled(rep.gpus, rep.pg, rep.actor)   # kept warm
            else:            # still starting (it has done nothing), or dead
                stop_actor(rep.actor, rep.pg)
            left = left or []
            moved = [p for p in (self._handed_back(rep, item) for item in left) if p is not None]
            moved += list(rep.outstanding.values()) + rep.outbox
            rep.outstanding, rep.outbox = {}, []
            self.moved_requests += len(moved)
            self.pending[node].extend(moved)

    def _resize(self, node: str, plan: ExecPlan, gpu_lists: list[tuple[int, ...]]) -> None:
        """``node``'s plan changes to ``plan`` placed on ``gpu_lists``: with the same tp, the
        replicas on GPUs it keeps run on (rank order) with their requests, the others are
        drained; with another tp all are drained and replaced."""
        replicas = self.replicas[node]
        kept = len(replicas) if replicas[0].plan.tp == plan.tp else 0
        for rank, rep in enumerate(replicas):
            if rank >= len(gpu_lists) or rep.gpus != tuple(gpu_lists[rank]):
                kept = min(kept, rank)
        if kept == 0:
            self._stop_node(node)
            return
        self._stop_replicas(node, replicas[kept:])
        self.replicas[node] = replicas[:kept]
        for rep in self.replicas[node]:
            rep.plan = plan

    @staticmethod
    def _handed_back(rep: Replica, item: dict) -> Optional[Pending]:
        """An unfinished request a replica handed back (drained or taken): it continues
        elsewhere from its prompt plus the tokens generated so far."""
        p = rep.outstanding.pop(item["key"], None)
        if p is None:
            return None
        if p.prompt_ids is None and item["prompt_ids"] is not None:
            p.prompt_ids = list(item["prompt_ids"])
        p.generated = p.generated + list(item["generated"])
        p.preemptions += 1
        return p

    def preempt(self, node: str) -> None:
        """Reload a running node in place (same plan and GPUs): its replicas are drained
        and its unfinished requests continue on the new ones. Operators use it to move
        work off a misbehaving replica; tests use it to exercise preemption."""
        if node not in self.replicas:
            raise ValueError(f"node {node} is not running")
        gpus = [r.gpus for r in self.replicas[node]]
        self._stop_node(node)
        self._start_node(node, self.selection[node], gpus)
        self._dispatch(node, self.pending.pop(node, []))

    # -- stages -------------------------------------------------------------------------
    def _app_state(self) -> AppState:
        nodes = {}
        for name, w in self.run_.workload.nodes.items():
            zeros = np.zeros(len(w))
            nodes[name] = NodeState(self.comm.node_done(name), zeros.astype(np.int64), zeros)
        return AppState(self.now(), nodes)

    def _boundary(self) -> None:
        started = self.now()
        state = self._app_state()
        running = {n: p for n, p in self.selection.items() if not self.comm.node_finished(n)}
        selection = self.adjuster.next_selection(state, running)
        previous = {n: (self.selection[n], [r.gpus for r in reps]) for n, reps in self.replicas.items()}
        placed = place(self.problem.cluster, selection, previous) or place(self.problem.cluster, selection, {})
        placement, moved = placed
        decided = self.now()
        for node in list(self.replicas):
            if self.comm.node_finished(node) or node not in selection or node in moved:
                self._stop_node(node)
            elif selection[node] != self.selection.get(node):
                self._resize(node, selection[node], placement[node])
        stopped = self.now()
        self.selection = selection
        for node, plan in selection.items():
            have = len(self.replicas.get(node, []))
            if have < plan.dp:
                self._start_node(node, plan, placement[node][have:], first_rank=have)
        for node in selection:
            if self.pending.get(node):
                self._dispatch(node, self.pending.pop(node))
        if self.stages:
            self.stages[-1]["end_s"] = started
        self.stage_metric.set(len(self.stages), tags={"app": self.run_.app.name})
        self.stages.append({"start_s": started, "end_s": None,
                            "models": [{"node": n, "dp": p.dp, "tp": p.tp,
                                        "replica_gpus": [list(g) for g in placement[n]],
                                        "started": any(r.created_s >= stopped for r in self.replicas[n])}
                                       for n, p in selection.items()]})
        self.switches.append({"at_s": started, "decision_ms": 1e3 * (decided - started),
                              "stop_s": stopped - decided, "started_replicas": sum(
                                  1 for reps in self.replicas.values() for r in reps if r.created_s >= stopped)})

    def _selection_finished(self) -> bool:
        return any(self.comm.node_finished(n) for n in self.selection)

    # -- capacity -----------------------------------------------------------------------
    def _check_capacity(self) -> None:
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
            if self.progress is not None:
                self.progress.write(f"the cluster has {alive} GPUs (had {self.gpus_seen}); re-planning "
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

    # -- the loop -----------------------------------------------------------------------
    def execute(self) -> None:
        from tqdm import tqdm

        total = self.comm.total
        self.t0 = time.perf_counter()
        if self.config.progress:
            self.progress = tqdm(total=total, initial=self.comm.done, unit="req",
                                 desc=self.run_.app.name, dynamic_ncols=True)
        try:
            self._enqueue(self.comm.initial())
            if self.comm.done < total:
                self._boundary()
            deadline = time.perf_counter() + STARTUP_TIMEOUT_S
            while self.comm.done < total:
                self._check_capacity()
                refs = list(self.by_ref)
                if not refs:  # nothing runs but work remains: let the adjuster pick again
                    self._boundary()
                    if not self.by_ref:
                        raise RunFailed("the runtime is stuck: no replica can run the remaining "
                                           f"{total - self.comm.done} requests")
                    continue
                done, _ = ray.wait(refs, num_returns=1, timeout=CAPACITY_CHECK_S)
                if not done and time.perf_counter() < deadline:
                    continue
                if not done:
                    waiting = [r.name for r, kind in self.by_ref.values() if kind == "info"]
                    raise ReplicaFailed(f"no progress for {STARTUP_TIMEOUT_S:.0f}s; replicas still "
                                        f"starting: {', '.join(waiting) or 'none'} (too few GPUs?)")
                busy_from = time.perf_counter()
                deadline = busy_from + STARTUP_TIMEOUT_S
                for ref in done:
                    self._handle(ref)
                if self.comm.done < total and self._selection_finished():
                    self._boundary()
                self.controller_s += time.perf_counter() - busy_from
            self.end_s = self.now()
            if self.stages:
                self.stages[-1]["end_s"] = self.end_s
        finally:
            if self.progress is not None:
                self.progress.close()
            self.shutdown()

    def shutdown(self) -> None:
        for node in list(self.replicas):
            for rep in self.replicas.pop(node):
                rep.stopped_s = rep.stopped_s if rep.stopped_s is not None else self.now()
                stop_actor(rep.actor, rep.pg)
        for pooled in self.pool.values():
            stop_actor(pooled.actor, pooled.pg)
        self.pool.clear()
        self.by_ref.clear()

    # -- figures ------------------------------------------------------------------------
    def segments(self) -> list[tuple[int, float, float, float, str]]:
        end = getattr(self, "end_s", self.now())
        return [row for rep in self.all_replicas for row in rep.segment_rows(end)]

    def _switch_stats(self) -> dict:
        out = {}
        for kind in SWITCH_KINDS:
            times = [r.ready_s - r.created_s for r in self.all_replicas
                     if r.switch == kind and r.ready_s is not None]
            out[kind] = {"count": len(times), "median_s": statistics.median(times) if times else None}
        return out

    def _ray_nodes(self) -> list[dict]:
        """Per Ray node that ran a replica: its id and IP, and the replicas (and planner
        GPUs) it ran."""
        nodes: dict[str, dict] = {}
        for r in self.all_replicas:
            node_id = r.info.get("node_id")
            if node_id is None:
                continue
            entry = nodes.setdefault(node_id, {"node_id": node_id, "ip": r.info.get("node_ip"),
                                               "replicas": [], "gpus": set()})
            entry["replicas"].append(r.name)
            entry["gpus"].update(r.gpus)
        return [{**e, "gpus": sorted(e["gpus"])} for e in nodes.values()]

    def summary(self) -> dict:
        end = getattr(self, "end_s", self.now())
        per_node = {}
        for node in self.run_.workload.nodes:
            reps = [r for r in self.all_replicas if r.node == node]
            records = [r for r in self.store.done.values() if r["node"] == node]
            busy = sum(r.busy_s for r in reps)
            tokens = sum(r["output_tokens"] for r in records)
            per_node[node] = {
                "model": self.run_.app.node(node).model, "requests": len(records),
                "output_tokens": tokens, "busy_s": busy,
                "tokens_per_s": sum(r.tokens for r in reps) / busy if busy else None,
                "replicas_started": len(reps), "restarts": sum(r.restarts for r in reps)}
        gpu_busy = sum(r.busy_s * r.plan.tp for r in self.all_replicas)
        gpus = self.problem.cluster.num_gpus
        switches = self.switches[1:]  # the first "switch" is the initial start
        return {
            "actual_makespan_s": end,
            "stages": self.stages,
            "models": per_node,
            "gpu_busy_fraction": gpu_busy / (gpus * end) if end else None,
            "replicas": [{"name": r.name, "node": r.node, "dp": r.plan.dp, "tp": r.plan.tp,
                          "gpus": list(r.gpus), "ray_gpu_ids": r.info.get("gpu_ids"),
                          "device": r.info.get("device"), "model_id": r.info.get("model_id"),
                          # the Ray actor it ran in (a warm actor keeps its first name) and its node
                          "actor": r.info.get("actor_name"), "ray_node_id": r.info.get("node_id"),
                          "ray_node_ip": r.info.get("node_ip"),
                          "created_s": r.created_s, "switch": r.switch,
                          "ready_s": r.ready_s, "stopped_s": r.stopped_s, "busy_s": r.busy_s,
                          "tokens": r.tokens, "restarts": r.restarts} for r in self.all_replicas],
            "ray_nodes": self._ray_nodes(),
            "restarts": sum(r.restarts for r in self.all_replicas),
            "requests_moved_by_preemption": self.moved_requests,
            "requests_moved_to_new_replicas": self.rebalanced,
            "requests_run": self.run_requests,
            "overhead": {
                "controller_s": self.controller_s,
                "per_request_ms": 1e3 * self.controller_s / self.run_requests if self.run_requests else None,
                "stage_switches": len(switches),
                "switch_decision_ms_median": statistics.median([s["decision_ms"] for s in switches]) if switches else None,
                "switch_stop_s_median": statistics.median([s["stop_s"] for s in switches]) if switches else None,
                "replica_start_s_median": statistics.median(
                    [r.ready_s - r.created_s for r in self.all_replicas if r.ready_s is not None]) if self.all_replicas else None,
                # replica starts by how they got their actor: cold (new), swap, wake, keep (pooled)
                "replica_switches": self._switch_stats(),
                "pool_evictions": self.evicted,
            },
        }


def _cause(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    for line in reversed(text):
        line = line.strip()
        if line and not line.startswith(("File ", "Traceback", "^")):
            return line[:300]
    return type(exc).__name__
