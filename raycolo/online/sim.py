"""A discrete-event simulator of a cluster of pipeline nodes serving and training.

Each node is S stages, one GPU each; a stage runs one operation at a time, oldest ready
first. Operations and their costs come from the node's :class:`NodeProfile`:

* inference: a *prefill* forward through the stages for a batch formed by Algorithm 3
  (up to ``max_batch`` within ``T_w`` of its first task; a training task closes it),
  then *decode* iterations in which all of the node's running requests advance one token
  on every stage (iteration-level batching; decode stays on the node);
* training: a forward through the stages, then a backward from stage S down to 1; the
  activations stay on each stage between the two.

Memory per stage is tracked: KV of running requests (reserved at prefill for prompt and
output), activations of training tasks. Memory-aware policies run Algorithm 2 before a
forward: wait in steps of Δt while the stage is over its threshold, and after ``T_max``
offload the task's memory to the host (transfer time added). Others run anyway and pay
``overrun_slowdown`` on a forward that overflows. The scheduler (the registered policy)
decides where every task goes; executed forward/backward times calibrate its plans.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from raycolo.online.clock import SimClock
from raycolo.online.params import LemixParams
from raycolo.online.profiles import NodeProfile
from raycolo.online.scheduler import Decision, OnlineScheduler
from raycolo.online.tasks import OnlineTask

FORWARD_KINDS = ("prefill", "train_f")


@dataclass
class Op:
    kind: str                    # prefill | train_f | train_b | decode | sync
    node: int
    stage: int
    ready_s: float
    seq: int
    tasks: list
    mem_bytes: float = 0.0       # allocated on this stage when a forward starts
    waited_s: float = 0.0
    offloaded: bool = False
    start_s: float = 0.0
    duration_s: float = 0.0

    @property
    def key(self) -> tuple[float, int]:
        return (self.ready_s, self.seq)


@dataclass
class Stage:
    ready: list = field(default_factory=list)   # heap of (ready_s, seq, op)
    busy: Optional[Op] = None
    used_bytes: float = 0.0
    held: dict = field(default_factory=dict)   # (kind, task id) -> bytes this stage holds
    busy_s: float = 0.0
    retry_pending: bool = False


@dataclass
class Request:
    """An inference task's progress on its node."""

    task: OnlineTask
    context: int
    remaining: int
    kv_bytes: float = 0.0        # reserved on each stage whose prefill kept it on the GPU
    token_times: list = field(default_factory=list)
    staleness: int = 0


@dataclass
class Node:
    stages: list[Stage]
    batch: list = field(default_factory=list)
    batch_c: int = 0
    batch_token: int = 0         # invalidates a scheduled close of an earlier batch
    decoding: list = field(default_factory=list)
    joining: list = field(default_factory=list)
    decode_inflight: bool = False
    queued_ops: int = 0          # ops ready or running on any stage
    update_count: int = 0        # cluster training tasks reflected in the served weights
    first_start: Optional[float] = None
    last_end: float = 0.0
    active: bool = False
    syncing: int = 0             # sync ops left on this node's stages


@dataclass
class SimResult:
    policy: str
    tasks: int
    inference: int
    train: int
    completed: int
    makespan_s: float
    throughput: float
    slo_s: float
    slo_attainment: float
    ttft_s: np.ndarray
    tbt_s: np.ndarray
    e2e_s: np.ndarray
    node_busy_s: list
    node_span_s: list
    idle_fraction: float
    active_nodes: list           # (time, count) steps
    active_nodes_mean: float
    train_done: int
    staleness: np.ndarray
    decision_us_mean: float
    deferred_max: int
    memory_waits: int
    offloads: int
    overruns: int
    completions: dict = field(default_factory=dict)   # task id -> completion count

    def summary(self) -> dict:
        def pct(a, q):
            return float(np.percentile(a, q)) if len(a) else None
        return {
            "policy": self.policy, "tasks": self.tasks, "completed": self.completed,
            "throughput": self.throughput, "makespan_s": self.makespan_s,
            "slo_s": self.slo_s, "slo_attainment": self.slo_attainment,
            "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
            "tbt_p50_s": pct(self.tbt_s, 50), "tbt_p99_s": pct(self.tbt_s, 99),
            "e2e_p50_s": pct(self.e2e_s, 50),
            "node_busy_s": self.node_busy_s, "node_span_s": self.node_span_s,
            "idle_fraction": self.idle_fraction, "active_nodes_mean": self.active_nodes_mean,
            "train_done": self.train_done,
            "staleness_mean": float(self.staleness.mean()) if len(self.staleness) else 0.0,
            "decision_us_mean": self.decision_us_mean, "deferred_max": self.deferred_max,
            "memory_waits": self.memory_waits, "offloads": self.offloads, "overruns": self.overruns,
        }


class ClusterSimulator:
    """The simulated :class:`~raycolo.online.clock.Executor`."""

    def __init__(self, tasks: list[OnlineTask], profile: NodeProfile, nodes: int, policy,
                 params: LemixParams, estimator: Optional[object] = None):
        self.tasks = sorted(tasks, key=lambda t: (t.arrival_s, t.task_id))
        self.profile = profile
        self.params = params
        self.policy = policy
        self.nodes = [Node([Stage() for _ in range(profile.stages)]) for _ in range(nodes)]
        self.clock = SimClock()
        self._events: list = []
        self._seq = itertools.count()
        self.scheduler = OnlineScheduler(policy, [profile] * nodes, [estimator or profile] * nodes,
                                         params, utilization=self.utilization)
        self.ttft: dict[int, float] = {}
        self.tbt: dict[int, float] = {}
        self.e2e: dict[int, float] = {}
        self.completions: dict[int, int] = {}
        self.staleness: list[int] = []
        self.train_done = 0
        self.active_steps: list[tuple[float, int]] = [(0.0, 0)]
        self.memory_waits = self.offloads = self.overruns = 0
        self.deferred_max = 0
        self.sync_every = params.sync_every
        self.serving_nodes: Optional[set] = None
        if hasattr(policy, "groups"):
            train, serve = policy.groups(nodes)
            self.serving_nodes = set(serve) - set(train) if set(serve) != set(train) else None

    @property
    def now(self) -> float:
        return self.clock.now()

    # -- event queue -------------------------------------------------------------------
    def _at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> SimResult:
        for task in self.tasks:
            self._at(task.arrival_s, self._arrive, task)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self.clock.advance_to(t)
            fn(*args)
        if self.scheduler.deferred:  # unreachable: deferral ends with the last arrival
            raise RuntimeError(f"{len(self.scheduler.deferred)} training tasks were never placed")
        return self._result()

    # -- arrivals and dispatch -----------------------------------------------------------
    def _arrive(self, task: OnlineTask) -> None:
        if task is self.tasks[-1]:
            self.scheduler.arrivals_done = True
        decision = self.scheduler.submit(task, self.now)
        if decision is not None:
            self._at(decision.decided_s, self.dispatch, decision)
        self.deferred_max = max(self.deferred_max, len(self.scheduler.deferred))
        self._retry()

    def _retry(self) -> None:
        for decision in self.scheduler.retry(self.now):
            self._at(decision.decided_s, self.dispatch, decision)

    def dispatch(self, decision: Decision) -> None:
        """Executor interface: the task reaches its node (after any decision delay)."""
        task, n = decision.task, decision.node
        node = self.nodes[n]
        if task.is_train:
            if node.batch:
                self._close_batch(n, node.batch_token)
            mem = self.profile.train_bytes(task.batch, task.length)
            self._ready(Op("train_f", n, 0, self.now, next(self._seq), [task], mem))
            return
        if not node.batch:
            node.batch_token += 1
            wait = self.params.max_wait * self.profile.forward_latency_s
            self._at(self.now + wait, self._close_batch, n, node.batch_token)
        node.batch.append(task)
        node.batch_c += task.batch
        self._set_active(n)
        if node.batch_c >= self.params.max_batch:
            self._close_batch(n, node.batch_token)

    def _close_batch(self, n: int, token: int) -> None:
        node = self.nodes[n]
        if token != node.batch_token or not node.batch:
            return
        tasks, node.batch, node.batch_c = node.batch, [], 0
        node.batch_token += 1
        requests = [Request(t, t.length, t.decode_tokens) for t in tasks]
        for r in requests:
            r.kv_bytes = self.profile.inference_bytes(r.task.batch, r.task.length + r.task.decode_tokens)
        mem = sum(r.kv_bytes for r in requests)
        self._ready(Op("prefill", n, 0, self.now, next(self._seq), requests, mem))

    # -- stages ----------------------------------------------------------------------------
    def _ready(self, op: Op) -> None:
        node = self.nodes[op.node]
        heapq.heappush(node.stages[op.stage].ready, (op.ready_s, op.seq, op))
        node.queued_ops += 1
        self._set_active(op.node)
        self._try_start(op.node, op.stage)

    def _duration(self, op: Op) -> float:
        p = self.profile
        if op.kind == "prefill":
            return p.forward_s(sum(r.task.batch for r in op.tasks), max(r.task.length for r in op.tasks))
        if op.kind == "train_f":
            return p.forward_s(op.tasks[0].batch, op.tasks[0].length)
        if op.kind == "train_b":
            return p.backward_s(op.tasks[0].batch, op.tasks[0].length)
        if op.kind == "decode":
            batch = sum(r.task.batch for r in op.tasks)
            context = int(np.mean([r.context for r in op.tasks]))
            return p.decode_step_s(batch, context)
        return p.weight_bytes_per_stage / self.params.sync_bandwidth  # sync

    def _try_start(self, n: int, s: int) -> None:
        stage = self.nodes[n].stages[s]
        if stage.busy is not None or not stage.ready:
            return
        capacity = self.profile.free_bytes
        limit = self.params.memory_threshold * capacity
        chosen, blocked = None, False
        for _, _, op in sorted(stage.ready):
            if op.kind not in FORWARD_KINDS or op.offloaded or op.mem_bytes == 0:
                chosen = op
                break
            if blocked:
                continue  # forwards keep their order behind a waiting forward
            if not self.policy.memory_aware or stage.used_bytes + op.mem_bytes <= limit:
                chosen = op
                break
            if op.waited_s >= self.params.max_memory_wait * self.profile.forward_latency_s:
                op.offloaded = True  # Algorithm 2 line 10: give the stage its memory back
                self.offloads += 1
                chosen = op
                break
            blocked = True
            if not stage.retry_pending:
                stage.retry_pending = True
                step = self.params.check_interval * self.profile.forward_latency_s
                self.memory_waits += 1
                self._at(self.now + step, self._memory_retry, n, s, op, step)
        if chosen is None:
            return
        stage.ready.remove((chosen.ready_s, chosen.seq, chosen))
        heapq.heapify(stage.ready)
        chosen.start_s = self.now
        chosen.duration_s = self._duration(chosen)
        if chosen.kind in FORWARD_KINDS:
            if chosen.offloaded:
                chosen.duration_s += chosen.mem_bytes / self.params.offload_bandwidth
            else:
                if stage.used_bytes + chosen.mem_bytes > capacity:
                    self.overruns += 1
                    chosen.duration_s *= self.params.overrun_slowdown
                for key, size in self._holdings(chosen):
                    stage.held[key] = size
                    stage.used_bytes += size
        if chosen.kind == "train_b" and ("train", chosen.tasks[0].task_id) not in stage.held:
            chosen.duration_s += chosen.mem_bytes / self.params.offload_bandwidth  # reload
        stage.busy = chosen
        node = self.nodes[n]
        node.first_start = self.now if node.first_start is None else node.first_start
        self._at(self.now + chosen.duration_s, self._done, chosen)

    @staticmethod
    def _holdings(op: Op) -> list[tuple[tuple, float]]:
        """What a forward keeps on its stage, per task, so release is exact per stage."""
        if op.kind == "prefill":
            return [(("req", r.task.task_id), r.kv_bytes) for r in op.tasks]
        return [(("train", op.tasks[0].task_id), op.mem_bytes)]

    def _release(self, stage: Stage, key: tuple) -> None:
        stage.used_bytes -= stage.held.pop(key, 0.0)

    def _memory_retry(self, n: int, s: int, op: Op, step: float) -> None:
        stage = self.nodes[n].stages[s]
        stage.retry_pending = False
        op.waited_s += step
        self._try_start(n, s)

    def _done(self, op: Op) -> None:
        n, s = op.node, op.stage
        node = self.nodes[n]
        stage = node.stages[s]
        stage.busy = None
        stage.busy_s += op.duration_s
        node.queued_ops -= 1
        node.last_end = self.now
        last = s == len(node.stages) - 1
        if op.kind == "prefill":
            for r in op.tasks:
                self.scheduler.observe(r.task.task_id, s, "forward", op.start_s, self.now)
            if not last:
                self._ready(Op("prefill", n, s + 1, self.now, next(self._seq), op.tasks, op.mem_bytes))
            else:
                for r in op.tasks:
                    self.ttft[r.task.task_id] = self.now - r.task.arrival_s
                    r.staleness = self.train_done - node.update_count
                    self._token_out(n, r)
                self._decode_next(n)
        elif op.kind == "train_f":
            task = op.tasks[0]
            self.scheduler.observe(task.task_id, s, "forward", op.start_s, self.now)
            nxt = Op("train_f", n, s + 1, self.now, next(self._seq), op.tasks, op.mem_bytes) if not last else \
                Op("train_b", n, s, self.now, next(self._seq), op.tasks, op.mem_bytes)
            self._ready(nxt)
        elif op.kind == "train_b":
            task = op.tasks[0]
            self.scheduler.observe(task.task_id, s, "backward", op.start_s, self.now)
            self._release(stage, ("train", task.task_id))
            if s > 0:
                self._ready(Op("train_b", n, s - 1, self.now, next(self._seq), op.tasks, op.mem_bytes))
            else:
                self._train_finished(n, task)
        elif op.kind == "decode":
            if not last:
                self._ready(Op("decode", n, s + 1, self.now, next(self._seq), op.tasks))
            else:
                node.decode_inflight = False
                for r in op.tasks:
                    r.context += 1
                    self._token_out(n, r)
                self._decode_next(n)
        elif op.kind == "sync":
            node.syncing -= 1
            if node.syncing == 0:
                node.update_count = op.tasks[0]
        self._try_start(n, s)
        self._maybe_idle(n)
        self._retry()

    def _decode_next(self, n: int) -> None:
        node = self.nodes[n]
        if node.decode_inflight or not node.joining:
            return
        running, node.joining = node.joining, []
        node.decode_inflight = True
        self._ready(Op("decode", n, 0, self.now, next(self._seq), running))

    def _token_out(self, n: int, r: Request) -> None:
        """A request's token left the last stage: it is done, or it joins the next decode."""
        r.remaining -= 1
        r.token_times.append(self.now)
        if r.remaining <= 0:
            self._finish_request(n, r)
        else:
            self.nodes[n].joining.append(r)

    def _finish_request(self, n: int, r: Request) -> None:
        task = r.task
        for stage in self.nodes[n].stages:
            self._release(stage, ("req", task.task_id))
        times = r.token_times
        self.tbt[task.task_id] = float(np.mean(np.diff(times))) if len(times) > 1 else 0.0
        self.e2e[task.task_id] = self.now - task.arrival_s
        self.staleness.append(r.staleness)
        self.completions[task.task_id] = self.completions.get(task.task_id, 0) + 1

    def _train_finished(self, n: int, task: OnlineTask) -> None:
        self.train_done += 1
        self.completions[task.task_id] = self.completions.get(task.task_id, 0) + 1
        self.e2e[task.task_id] = self.now - task.arrival_s
        self.nodes[n].update_count = self.train_done  # the node's own weights now hold it
        if self.serving_nodes is not None and self.train_done % self.sync_every == 0:
            for m in sorted(self.serving_nodes):  # SEPARATE: push the weights to the servers
                node = self.nodes[m]
                node.syncing = len(node.stages)
                for s in range(len(node.stages)):
                    self._ready(Op("sync", m, s, self.now, next(self._seq), [self.train_done]))

    # -- node activity -------------------------------------------------------------------
    def _set_active(self, n: int) -> None:
        node = self.nodes[n]
        if not node.active:
            node.active = True
            self.active_steps.append((self.now, self.active_steps[-1][1] + 1))

    def _maybe_idle(self, n: int) -> None:
        node = self.nodes[n]
        if node.active and node.queued_ops == 0 and not node.batch and not node.joining \
                and not node.decode_inflight:
            node.active = False
            self.active_steps.append((self.now, self.active_steps[-1][1] - 1))
            self.scheduler.node_idle(n, self.now)

    def utilization(self, n: int) -> float:
        """Busy fraction of the node's GPUs so far, counting operations in flight."""
        node = self.nodes[n]
        busy = sum(st.busy_s + (self.now - st.busy.start_s if st.busy else 0.0) for st in node.stages)
        return busy / (len(node.stages) * max(self.now, 1e-9))

    # -- result ----------------------------------------------------------------------------
    def _result(self) -> SimResult:
        for node in self.nodes:  # every byte held was released: memory is conserved
            for stage in node.stages:
                if stage.held or abs(stage.used_bytes) > 1.0:
                    raise RuntimeError(f"memory left held after the run: {len(stage.held)} tasks, "
                                       f"{stage.used_bytes:.0f} bytes")
        first = self.tasks[0].arrival_s if self.tasks else 0.0
        end = max((n.last_end for n in self.nodes), default=0.0)
        makespan = max(end - first, 1e-9)
        inference = [t for t in self.tasks if not t.is_train]
        slo = self.params.slo_s(self.profile.forward_latency_s)
        ttft = np.array([self.ttft[t.task_id] for t in inference if t.task_id in self.ttft])
        busy = [sum(st.busy_s for st in n.stages) for n in self.nodes]
        spans = [(n.last_end - n.first_start) if n.first_start is not None else 0.0 for n in self.nodes]
        steps = self.active_steps + [(end, 0)]
        area = sum((t1 - t0) * c for (t0, c), (t1, _) in zip(steps[:-1], steps[1:]) if t1 > t0)
        stages = self.profile.stages
        return SimResult(
            policy=self.policy.name, tasks=len(self.tasks), inference=len(inference),
            train=len(self.tasks) - len(inference), completed=sum(self.completions.values()),
            makespan_s=makespan, throughput=sum(self.completions.values()) / makespan,
            slo_s=slo, slo_attainment=float((ttft <= slo).mean()) if len(ttft) else 1.0,
            ttft_s=ttft, tbt_s=np.array([self.tbt[t.task_id] for t in inference if t.task_id in self.tbt]),
            e2e_s=np.array(list(self.e2e.values())), node_busy_s=busy, node_span_s=spans,
            idle_fraction=1 - sum(busy) / (len(self.nodes) * stages * makespan),
            active_nodes=steps, active_nodes_mean=area / makespan, train_done=self.train_done,
            staleness=np.array(self.staleness), decision_us_mean=self.scheduler.mean_decision_us,
            deferred_max=self.deferred_max, memory_waits=self.memory_waits, offloads=self.offloads,
            overruns=self.overruns, completions=dict(self.completions))


def simulate(tasks: list[OnlineTask], profile: NodeProfile, nodes: int, policy_name: str,
             params: Optional[LemixParams] = None, train_rate: float = 0.5) -> SimResult:
    """Run one registered policy over ``tasks`` on ``nodes`` nodes of ``profile``."""
    from raycolo.policies import get_online_policy

    params = params or LemixParams()
    policy = get_online_policy(policy_name)(params, nodes=nodes, train_rate=train_rate)
    estimator = None
    if getattr(policy, "profiled", True) is False:
        from raycolo.policies.lemix import LengthBlind
        estimator = LengthBlind(profile.forward_latency_s / profile.stages,
                                profile.backward_latency_s / profile.stages)
    return ClusterSimulator(tasks, profile, nodes, policy, params, estimator).run()
