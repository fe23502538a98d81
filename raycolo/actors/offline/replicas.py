"""Replica lifecycle of the offline controller: start, restart, drain, stop and resize
the engine replicas of a run.

Drained actors are not stopped: they wait in a warm pool on their GPUs (their placement
group held), and the next replica placed on exactly those GPUs takes one over with
``EngineActor.swap`` (a *keep* for the same model and config, a *swap* for another),
milliseconds to a model load instead of a process start. A replica on GPUs the pool
does not hold first evicts the pooled actors on any of them, then starts cold. A
replica whose actor dies is restarted in its placement group and its unfinished
requests run again. A node whose plan only changes its data parallelism keeps the
replicas whose GPUs it keeps (:meth:`ReplicaSet.resize`: a dp1 replica stays replica 0
of the dp2 plan and runs on with its requests).
"""
from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Callable, Optional

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group

from raycolo.engine.replica_messages import Unfinished
from raycolo.actors.offline.dispatch import Dispatcher
from raycolo.actors.offline.replica_records import Pending, Pooled, Replica
from raycolo.actors.offline.engine_actor import EngineActor, placement
from raycolo.actors.offline.gpu_nodes import GpuNodes
from raycolo.actors.offline.failures import ReplicaFailed, cause
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.runtime.setup import PreparedRun


def stop_actor(actor, pg) -> None:
    """Stop an engine actor at once and give its placement group's GPUs back."""
    try:
        ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    except Exception:  # already gone
        pass


class ReplicaSet:
    """The engine replicas of one run and the warm pool of drained actors.

    ``replicas`` (each node's running replicas) and ``by_ref`` (every call in flight: its
    replica and kind) are the controller's tables, shared with the ``dispatcher`` that
    queues requests on the replicas; ``handle`` (a finished call) and ``finish`` (a
    replica's finished outputs) are the controller's result handlers, which a drain
    calls for the results it collects; ``note`` writes a line beside the progress bar."""

    def __init__(self, run: PreparedRun, problem: PlanningProblem,
                 replicas: dict[str, list[Replica]], by_ref: dict[object, tuple[Replica, str]],
                 dispatcher: Dispatcher, now: Callable[[], float], note: Callable[[str], None],
                 handle: Callable[[object], None], finish: Callable[[Replica, list], None]):
        self.run_ = run
        self.config = run.config
        self.problem = problem
        self.replicas = replicas
        self.by_ref = by_ref
        self.dispatcher = dispatcher
        self.now = now
        self.note = note
        self.handle = handle
        self.finish = finish
        # Ray actor names get this run's token: a gracefully exiting actor of an earlier run
        # of the same application keeps its name until it is gone.
        self.run_token = uuid.uuid4().hex[:8]
        self.all_replicas: list[Replica] = []
        self.names_used: dict[str, int] = defaultdict(int)
        self.pool: dict[tuple[int, ...], Pooled] = {}
        self.gpu_nodes = GpuNodes()       # the node of each planner GPU (set by the launch)
        self.evicted = 0
        self.moved_requests = 0

    def engine_config(self, node: str, plan: ExecPlan) -> dict:
        return self.run_.engine_config(self.problem, node, plan)

    def spawn(self, rep: Replica, suffix: str = "") -> None:
        label = rep.name + suffix
        config = self.engine_config(rep.node, rep.plan)
        rep.actor = EngineActor.options(name=f"{label}~{self.run_token}", max_restarts=0,
                                        **placement(config, rep.pg)
                                        ).remote(config, label, self.config.parked_engines)
        rep.info_ref = rep.actor.info.remote()
        self.by_ref[rep.info_ref] = (rep, "info")
        rep.ready_s = None

    def start_node(self, node: str, plan: ExecPlan, gpu_lists: list[tuple[int, ...]], stage: int,
                   first_rank: int = 0) -> bool:
        """Start replicas ``first_rank``.. of ``node`` on ``gpu_lists`` in stage ``stage``:
        from the warm pool where it holds exactly those GPUs, else cold (evicting pooled
        actors there). True when ``node`` already ran: it grew (the caller rebalances it)."""
        replicas = []
        for rank, gpus in enumerate(gpu_lists, start=first_rank):
            gpus = tuple(gpus)
            gpu_text = ",".join(str(g) for g in gpus)
            name = f"{self.run_.app.name}/{node}/r{rank}@gpu{gpu_text}#s{stage}"
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
                self.evict(gpus)
                pg = placement_group([{"GPU": 1}] * plan.tp, strategy=self.config.placement_strategy,
                                     name=f"{name}/pg", bundle_label_selector=self.gpu_nodes.selector(gpus))
                rep = Replica(node, plan, rank, gpus, name, pg, None, self.now())
                self.spawn(rep)
            replicas.append(rep)
        grown = node in self.replicas
        self.replicas[node] = self.replicas.get(node, []) + replicas
        self.all_replicas.extend(replicas)
        return grown

    def evict(self, gpus: tuple[int, ...]) -> None:
        """Stop the pooled actors holding any of ``gpus`` (a replica starts there cold)."""
        for key in [k for k in self.pool if set(k) & set(gpus)]:
            pooled = self.pool.pop(key)
            stop_actor(pooled.actor, pooled.pg)
            self.evicted += 1

    def restart(self, rep: Replica, exc: Exception) -> None:
        rep.restarts += 1
        if rep.restarts > self.config.max_restarts:
            raise ReplicaFailed(f"replica {rep.name} died {rep.restarts} times "
                                f"(--max-restarts {self.config.max_restarts}): {cause(exc)}")
        for ref in [r for r, (owner, _) in self.by_ref.items() if owner is rep]:
            del self.by_ref[ref]
        lost = list(rep.outstanding.values()) + rep.outbox
        rep.outstanding, rep.outbox, rep.inflight = {}, [], None
        self.note(f"replica {rep.name} died ({cause(exc)}); restarting it, "
                  f"{len(lost)} requests run again")
        self.spawn(rep, f"#restart{rep.restarts}")
        rep.outbox = sorted(lost, key=lambda p: p.ready.index)
        self.dispatcher.kick(rep)

    def stop_node(self, node: str) -> None:
        self.stop_replicas(node, self.replicas.pop(node))

    def stop_replicas(self, node: str, replicas: list[Replica]) -> None:
        """Drain ``replicas`` of ``node``: their unfinished requests wait in the dispatcher's
        ``pending`` for the node's next replicas; the drained actors go to the warm pool."""
        for rep in replicas:
            rep.stopping = True  # no further run calls: everything after this comes from drain
            left = []
            if rep.ready_s is not None:  # a replica still starting has done nothing: just stop it
                drain = rep.actor.drain.remote()  # stops the engine loop; a pending run returns
                if rep.inflight is not None:
                    self.handle(rep.inflight)
                try:
                    drained = ray.get(drain)
                    rep.account(drained)
                    self.finish(rep, drained.outputs)
                    left = drained.unfinished
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
            moved = [p for p in (self.handed_back(rep, item) for item in left) if p is not None]
            moved += list(rep.outstanding.values()) + rep.outbox
            rep.outstanding, rep.outbox = {}, []
            self.moved_requests += len(moved)
            self.dispatcher.pending[node].extend(moved)

    def resize(self, node: str, plan: ExecPlan, gpu_lists: list[tuple[int, ...]]) -> None:
        """``node``'s plan changes to ``plan`` placed on ``gpu_lists``: with the same tp, the
        replicas on GPUs it keeps run on (rank order) with their requests, the others are
        drained; with another tp all are drained and replaced."""
        replicas = self.replicas[node]
        kept = len(replicas) if replicas[0].plan.tp == plan.tp else 0
        for rank, rep in enumerate(replicas):
            if rank >= len(gpu_lists) or rep.gpus != tuple(gpu_lists[rank]):
                kept = min(kept, rank)
        if kept == 0:
            self.stop_node(node)
            return
        self.stop_replicas(node, replicas[kept:])
        self.replicas[node] = replicas[:kept]
        for rep in self.replicas[node]:
            rep.plan = plan

    @staticmethod
    def handed_back(rep: Replica, item: Unfinished) -> Optional[Pending]:
        """An unfinished request a replica handed back (drained or taken): it continues
        elsewhere from its prompt plus the tokens generated so far."""
        p = rep.outstanding.pop(item.key, None)
        if p is None:
            return None
        if p.prompt_ids is None and item.prompt_ids is not None:
            p.prompt_ids = list(item.prompt_ids)
        p.generated = p.generated + list(item.generated)
        p.preemptions += 1
        return p

    def shutdown(self) -> None:
        """Stop every replica's actor and every pooled one."""
        for node in list(self.replicas):
            for rep in self.replicas.pop(node):
                rep.stopped_s = rep.stopped_s if rep.stopped_s is not None else self.now()
                stop_actor(rep.actor, rep.pg)
        for pooled in self.pool.values():
            stop_actor(pooled.actor, pooled.pg)
        self.pool.clear()
