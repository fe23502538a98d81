"""What an online run measured, the same way in the simulator and the live runtime.

:class:`OnlineMetrics` is fed by :class:`~raycolo.online.scheduling.cluster.Cluster` as node
schedulers report tokens, finished requests and trained tasks, at the executor's clock;
:meth:`OnlineMetrics.result` turns that into an :class:`OnlineResult`, whose
:meth:`~OnlineResult.summary` keys are what ``simulate-online`` and ``online run`` print.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raycolo.online.tasks import OnlineTask


@dataclass
class OnlineResult:
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
    training_aborts: int = 0     # training tasks aborted to give a prefill memory (SIRIUS)
    training_splits: int = 0     # training micro-batches split to fit memory (SIRIUS)
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
            "training_aborts": self.training_aborts,
            "training_splits": self.training_splits,
        }


class OnlineMetrics:
    """Per-task times and counts as a run goes."""

    def __init__(self):
        self.ttft: dict[int, float] = {}
        self.tbt: dict[int, float] = {}
        self.e2e: dict[int, float] = {}
        self.token_times: dict[int, list[float]] = {}
        self.first_staleness: dict[int, int] = {}
        self.completions: dict[int, int] = {}
        self.staleness: dict[int, int] = {}
        self.active_steps: list[tuple[float, int]] = [(0.0, 0)]
        self.forgotten = 0          # completed tasks whose records were dropped (forget)
        self.folded_area = 0.0      # active-node seconds of the steps folded away (forget)
        self.deferred_max = 0
        self.failed: dict[int, OnlineTask] = {}     # tasks no node could run (all were down)

    def token(self, task: OnlineTask, now: float, staleness: int) -> None:
        times = self.token_times.setdefault(task.task_id, [])
        if not times:
            self.ttft[task.task_id] = now - task.arrival_s
            self.first_staleness[task.task_id] = staleness
        times.append(now)

    def request_finished(self, task: OnlineTask, now: float) -> None:
        times = self.token_times.pop(task.task_id, [])
        self.tbt[task.task_id] = float(np.mean(np.diff(times))) if len(times) > 1 else 0.0
        self.e2e[task.task_id] = now - task.arrival_s
        self.staleness[task.task_id] = self.first_staleness.pop(task.task_id, 0)
        self._complete(task)

    def trained(self, task: OnlineTask, now: float) -> None:
        self.e2e[task.task_id] = now - task.arrival_s
        self._complete(task)

    def _complete(self, task: OnlineTask) -> None:
        self.completions[task.task_id] = self.completions.get(task.task_id, 0) + 1

    def active_change(self, now: float, delta: int) -> None:
        self.active_steps.append((now, self.active_steps[-1][1] + delta))

    @property
    def completed(self) -> int:
        """Tasks completed, counting those whose records were forgotten."""
        return len(self.completions) + self.forgotten

    def forget(self, task_ids, keep_steps: int = 10_000) -> None:
        """Drop the per-task records of finished ``task_ids`` (a long-running service; its
        results then cover the tasks kept) and fold all but the last ``keep_steps`` changes
        of the active-node count into a running area."""
        for tid in task_ids:
            self.forgotten += self.completions.pop(tid, 0)
            for records in (self.ttft, self.tbt, self.e2e, self.staleness, self.first_staleness, self.token_times):
                records.pop(tid, None)
        steps = self.active_steps
        if len(steps) > 2 * keep_steps:
            cut = len(steps) - keep_steps
            self.folded_area += sum((t1 - t0) * c for (t0, c), (t1, _) in zip(steps[:cut], steps[1:cut + 1]) if t1 > t0)
            del steps[:cut]

    def result(self, policy: str, tasks: list[OnlineTask], nodes: list, slo_s: float,
               train_done: int, decision_us_mean: float) -> OnlineResult:
        """``nodes``: the run's :class:`~raycolo.online.scheduling.node.NodeScheduler` objects."""
        first = min((t.arrival_s for t in tasks), default=0.0)
        end = max((n.last_end for n in nodes), default=0.0)
        makespan = max(end - first, 1e-9)
        inference = [t for t in tasks if not t.is_train]
        ttft = np.array([self.ttft[t.task_id] for t in inference if t.task_id in self.ttft])
        busy = [sum(st.busy_s for st in n.stages) for n in nodes]
        spans = [(n.last_end - n.first_start) if n.first_start is not None else 0.0 for n in nodes]
        steps = self.active_steps + [(end, 0)]
        area = self.folded_area + sum((t1 - t0) * c for (t0, c), (t1, _) in zip(steps[:-1], steps[1:]) if t1 > t0)
        stages = len(nodes[0].stages) if nodes else 1
        completed = sum(self.completions.values()) + self.forgotten
        return OnlineResult(
            policy=policy, tasks=len(tasks), inference=len(inference),
            train=len(tasks) - len(inference), completed=completed,
            makespan_s=makespan, throughput=completed / makespan,
            slo_s=slo_s, slo_attainment=float((ttft <= slo_s).mean()) if len(ttft) else 1.0,
            ttft_s=ttft, tbt_s=np.array([self.tbt[t.task_id] for t in inference if t.task_id in self.tbt]),
            e2e_s=np.array(list(self.e2e.values())), node_busy_s=busy, node_span_s=spans,
            idle_fraction=1 - sum(busy) / (len(nodes) * stages * makespan),
            active_nodes=steps, active_nodes_mean=area / makespan,
            train_done=train_done,
            staleness=np.array(list(self.staleness.values())), decision_us_mean=decision_us_mean,
            deferred_max=self.deferred_max, memory_waits=sum(n.memory_waits for n in nodes),
            offloads=sum(n.offloads for n in nodes), overruns=sum(n.overruns for n in nodes),
            training_aborts=sum(n.aborts for n in nodes), training_splits=sum(n.micro.count for n in nodes),
            completions=dict(self.completions))
