"""The controller: runs an application's plan on engine actors, stage by stage.

One loop, driven by results. Each live replica has at most one ``run`` call in flight;
when it returns, the finished outputs are persisted, handed to the communicator, and
the requests they make ready are dispatched: to a running replica of their node (round
robin; a chain's document stays on one replica), or queued until their node runs. At a
*stage boundary* (a running node finishes, in reality) the next stage is picked and the
replicas move to it. When the cluster has had fewer GPUs than the run has seen for
``node_loss_s``, the controller stops every actor and raises :class:`CapacityLost`;
``run_application`` then plans what the journal does not hold on the GPUs that remain.

The controller keeps the loop, the results and the figures. Its parts, each a class
with its own state that the controller holds and calls:

* :mod:`raycolo.actors.offline.replicas`: :class:`ReplicaSet`, the replica lifecycle
  (start from the warm pool or cold, restart, drain, stop, resize) and the warm pool;
* :mod:`raycolo.actors.offline.dispatch`: :class:`Dispatcher`, request dispatch (the
  planner's round robin) and the queue of requests whose node does not run;
* :mod:`raycolo.actors.offline.rebalance`: :class:`Rebalancer` (stage boundaries, grown
  nodes, preemption) and :class:`CapacityWatch` (the cluster's GPUs);
* :mod:`raycolo.actors.offline.failures`: the errors (:class:`RunFailed` and its kinds).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from raycolo.engine.replica_messages import ReplicaInfo
from raycolo.actors.offline.dispatch import Dispatcher
from raycolo.actors.offline.failures import ReplicaFailed, RunFailed, cause
from raycolo.actors.offline.rebalance import CAPACITY_CHECK_S, CapacityWatch, Rebalancer
from raycolo.actors.offline.replica_records import Pooled, Replica
from raycolo.actors.offline.replicas import ReplicaSet
from raycolo.generation import StopChecker
from raycolo.offline.planner.engines import SWITCH_KINDS
from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.runtime.communicator import ReadyRequest
from raycolo.offline.runtime.setup import PreparedRun

STARTUP_TIMEOUT_S = 900.0


def _moved_text(ready: ReadyRequest, tokens: list[int], tokenizer) -> str:
    """The text of a request that ran on more than one replica: its whole output replayed
    through raycolo.generation's stop checker (stop token left out, stop strings cut)."""
    checker = StopChecker(ready.sampling(), tokenizer.eos_token_ids, tokenizer)
    for token in tokens:
        if checker.append(token):
            break
    return checker.text(tokenizer)


class Controller:
    """Runs one plan: the loop (:meth:`execute`), the results (persisted, then handed to
    the communicator and ``on_output``) and the figures (:meth:`summary`, :meth:`segments`).
    ``by_ref`` and ``replicas`` are the tables its parts share."""

    def __init__(self, run: PreparedRun, problem: PlanningProblem, plan: AppPlan,
                 on_output: Optional[Callable[["Controller", dict], None]] = None):
        self.run_ = run
        self.config = run.config
        self.problem = problem
        self.plan = plan
        self.comm = run.communicator
        self.store = run.store
        self.on_output = on_output
        self.by_ref: dict[object, tuple[Replica, str]] = {}   # every call in flight: its replica, "info" or "run"
        replicas: dict[str, list[Replica]] = {}                # each node's running replicas
        self.controller_s = 0.0
        self.run_requests = 0
        self.t0 = 0.0
        self.progress = None
        from ray.util.metrics import Counter
        self.requests_metric = Counter("raycolo_requests_done", "requests answered, per node",
                                       tag_keys=("app", "node"))
        self.dispatcher = Dispatcher(replicas, self.by_ref, self.comm, self.config, self.now)
        self.replica_set = ReplicaSet(run, problem, replicas, self.by_ref, self.dispatcher, self.now,
                                      self.note, self._handle, self._finish)
        self.rebalancer = Rebalancer(run, problem, plan, self.replica_set, self.dispatcher, self.now)
        self.capacity = CapacityWatch(problem, self.config, self.note)

    @property
    def replicas(self) -> dict[str, list[Replica]]:
        """Each node's running replicas."""
        return self.replica_set.replicas

    @property
    def pool(self) -> dict[tuple[int, ...], Pooled]:
        """The warm pool: drained (or pre-started) actors by the GPUs they hold."""
        return self.replica_set.pool

    @pool.setter
    def pool(self, pool: dict[tuple[int, ...], Pooled]) -> None:
        self.replica_set.pool = pool

    # -- clock and progress ---------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def note(self, text: str) -> None:
        """A line beside the progress bar (none without one)."""
        if self.progress is not None:
            self.progress.write(text)

    def preempt(self, node: str) -> None:
        """Reload a running node in place (same plan and GPUs): its replicas are drained
        and its unfinished requests continue on the new ones. Operators use it to move
        work off a misbehaving replica; tests use it to exercise preemption."""
        self.rebalancer.preempt(node)

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
            self.dispatcher.enqueue(self.comm.complete(node, index, text))
            if self.progress is not None:
                self.progress.update(1)
            if self.on_output is not None:
                self.on_output(self, record)

    def _handle(self, ref) -> None:
        rep, kind = self.by_ref.pop(ref)
        try:
            result = ray.get(ref)
        except RayTaskError as exc:  # the engine raised: a bug or a bad request, not a crash
            raise ReplicaFailed(f"replica {rep.name}: {cause(exc)}") from None
        except RayActorError as exc:
            if rep.stopped_s is not None:
                return
            if rep.ready_s is None and getattr(exc, "actor_init_failed", False):
                # its constructor raised: a start failure (a bad model or config), not a crash
                raise ReplicaFailed(f"replica {rep.name} failed to start: {cause(exc)}") from None
            self.replica_set.restart(rep, exc)  # the process died (killed, out of memory), starting or not
            return
        if kind == "info":
            rep.info = result
            rep.switch = result.switch
            rep.ready_s = self.now()
            self.dispatcher.kick(rep)
            return
        rep.inflight = None
        rep.account(result)
        self._finish(rep, result.outputs)
        self.dispatcher.kick(rep)

    # -- the loop -----------------------------------------------------------------------
    def execute(self) -> None:
        from tqdm import tqdm

        total = self.comm.total
        self.t0 = time.perf_counter()
        if self.config.progress:
            self.progress = tqdm(total=total, initial=self.comm.done, unit="req",
                                 desc=self.run_.app.name, dynamic_ncols=True)
        try:
            self.dispatcher.enqueue(self.comm.initial())
            if self.comm.done < total:
                self.rebalancer.boundary()
            deadline = time.perf_counter() + STARTUP_TIMEOUT_S
            while self.comm.done < total:
                self.capacity.check()
                refs = list(self.by_ref)
                if not refs:  # nothing runs but work remains: let the adjuster pick again
                    self.rebalancer.boundary()
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
                if self.comm.done < total and self.rebalancer.selection_finished():
                    self.rebalancer.boundary()
                self.controller_s += time.perf_counter() - busy_from
            self.end_s = self.now()
            if self.rebalancer.stages:
                self.rebalancer.stages[-1]["end_s"] = self.end_s
        finally:
            if self.progress is not None:
                self.progress.close()
            self.shutdown()

    def shutdown(self) -> None:
        self.replica_set.shutdown()
        self.by_ref.clear()

    # -- figures ------------------------------------------------------------------------
    def segments(self) -> list[tuple[int, float, float, float, str]]:
        end = getattr(self, "end_s", self.now())
        return [row for rep in self.replica_set.all_replicas for row in rep.segment_rows(end)]

    def _switch_stats(self) -> dict:
        out = {}
        for kind in SWITCH_KINDS:
            times = [r.ready_s - r.created_s for r in self.replica_set.all_replicas
                     if r.switch == kind and r.ready_s is not None]
            out[kind] = {"count": len(times), "median_s": statistics.median(times) if times else None}
        return out

    def _ray_nodes(self) -> list[dict]:
        """Per Ray node that ran a replica: its id and IP, and the replicas (and planner
        GPUs) it ran."""
        nodes: dict[str, dict] = {}
        for r in self.replica_set.all_replicas:
            if r.info is None:
                continue
            node_id = r.info.node_id
            entry = nodes.setdefault(node_id, {"node_id": node_id, "ip": r.info.node_ip,
                                               "replicas": [], "gpus": set()})
            entry["replicas"].append(r.name)
            entry["gpus"].update(r.gpus)
        return [{**e, "gpus": sorted(e["gpus"])} for e in nodes.values()]

    def summary(self) -> dict:
        end = getattr(self, "end_s", self.now())
        per_node = {}
        for node in self.run_.workload.nodes:
            reps = [r for r in self.replica_set.all_replicas if r.node == node]
            records = [r for r in self.store.done.values() if r["node"] == node]
            busy = sum(r.busy_s for r in reps)
            tokens = sum(r["output_tokens"] for r in records)
            per_node[node] = {
                "model": self.run_.app.node(node).model, "requests": len(records),
                "output_tokens": tokens, "busy_s": busy,
                "tokens_per_s": sum(r.tokens for r in reps) / busy if busy else None,
                "replicas_started": len(reps), "restarts": sum(r.restarts for r in reps)}
        gpu_busy = sum(r.busy_s * r.plan.tp for r in self.replica_set.all_replicas)
        gpus = self.problem.cluster.num_gpus
        switches = self.rebalancer.switches[1:]  # the first "switch" is the initial start
        return {
            "actual_makespan_s": end,
            "stages": self.rebalancer.stages,
            "models": per_node,
            "gpu_busy_fraction": gpu_busy / (gpus * end) if end else None,
            "replicas": [{"name": r.name, "node": r.node, "dp": r.plan.dp, "tp": r.plan.tp,
                          "gpus": list(r.gpus), **_where(r.info),
                          "created_s": r.created_s, "switch": r.switch,
                          "ready_s": r.ready_s, "stopped_s": r.stopped_s, "busy_s": r.busy_s,
                          "tokens": r.tokens, "restarts": r.restarts} for r in self.replica_set.all_replicas],
            "ray_nodes": self._ray_nodes(),
            "restarts": sum(r.restarts for r in self.replica_set.all_replicas),
            "requests_moved_by_preemption": self.replica_set.moved_requests,
            "requests_moved_to_new_replicas": self.rebalancer.rebalanced,
            "requests_run": self.run_requests,
            "overhead": {
                "controller_s": self.controller_s,
                "per_request_ms": 1e3 * self.controller_s / self.run_requests if self.run_requests else None,
                "stage_switches": len(switches),
                "switch_decision_ms_median": statistics.median([s["decision_ms"] for s in switches]) if switches else None,
                "switch_stop_s_median": statistics.median([s["stop_s"] for s in switches]) if switches else None,
                "replica_start_s_median": statistics.median(
                    [r.ready_s - r.created_s for r in self.replica_set.all_replicas if r.ready_s is not None]) if self.replica_set.all_replicas else None,
                # replica starts by how they got their actor: cold (new), swap, wake, keep (pooled)
                "replica_switches": self._switch_stats(),
                "pool_evictions": self.replica_set.evicted,
            },
        }


def _where(info: Optional[ReplicaInfo]) -> dict:
    """A report's record of where a replica ran: its GPUs as Ray numbers them, its device
    and model, the Ray actor it ran in (a warm actor keeps its first name) and its node."""
    return {"ray_gpu_ids": getattr(info, "gpu_ids", None), "device": getattr(info, "device", None),
            "model_id": getattr(info, "model_id", None), "actor": getattr(info, "actor_name", None),
            "ray_node_id": getattr(info, "node_id", None), "ray_node_ip": getattr(info, "node_ip", None),
            "ranks": [{"rank": r.rank, "pid": r.pid, "ray_node_id": r.node_id, "ray_node_ip": r.node_ip,
                       "ray_gpu_ids": list(r.gpu_ids)} for r in getattr(info, "ranks", None) or []]}
