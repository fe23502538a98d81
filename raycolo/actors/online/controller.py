"""The live online controller: LeMix (or any online policy) placing real work on stage workers.

One async actor holds the deployment's :class:`~raycolo.online.scheduling.cluster.Cluster` (the
policy, the cluster scheduler and one node scheduler per node: the same objects the
simulator runs) and its :class:`~raycolo.online.driver.ClusterDriver` on a wall clock.
It is also the *op runner*: an op the driver starts becomes a payload on its stage's queue;
the stage worker (a Ray Train worker, :mod:`raycolo.actors.online.stage_worker`) pulls it, runs
it and reports back, and the driver carries on with the node scheduler's next step.

Why one actor rather than a controller plus a node-scheduler actor per node: every op's
completion feeds the cluster scheduler (calibration of LeMix's planned paths, the profile
learner, node idleness), so a separate node actor would add an actor hop per op without
saving one. The node logic stays a separate object (``NodeScheduler``) all the same.

The actor is made of roles, each a class in its own module that owns its fields
(:mod:`.state` has what all of them read): worker groups (:mod:`.workers`), the op runner
(:mod:`.op_runner`), the request desk (:mod:`.requests`), the sample pump
(:mod:`.sample_pump`), adapter versions (:mod:`.adapters`), adapters loaded over HTTP
(:mod:`.loaded_adapters`), reports (:mod:`.reports`) and the links to node loops
(:mod:`.nodes`). What is left here ties them together: the driver, the policy swap,
stop and drain.

Each node is one ``TorchTrainer`` (S workers, one logical or real GPU each), fitted in a
thread of this actor; its workers register as ``node-<n>/stage-<s>``.
"""
from __future__ import annotations

import asyncio
import time

import ray

from raycolo.actors.online.adapters import AdapterVersions
from raycolo.actors.online.loaded_adapters import LoadedAdapters
from raycolo.actors.online.nodes import NodeLinks
from raycolo.actors.online.op_runner import OpRunner
from raycolo.actors.online.reports import Reports
from raycolo.actors.online.requests import RequestDesk
from raycolo.actors.online.sample_pump import SamplePump
from raycolo.actors.online.workers import WorkerGroups
from raycolo.online.driver import ClusterDriver
from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.tasks import OnlineTask


@ray.remote(num_cpus=0, max_concurrency=1000)
class OnlineController(WorkerGroups, OpRunner, RequestDesk, SamplePump, AdapterVersions, LoadedAdapters,
                       Reports, NodeLinks):
    """One actor, its roles in their own modules (see :mod:`.state`); what is here ties
    them together: the state, the driver, the policy swap, stop and drain."""

    def __init__(self, config: dict, name: str, namespace: str):
        super().__init__(config, name, namespace)     # what every role reads (state.py)
        for own in (self._workers_init, self._runner_init, self._desk_init, self._pump_init, self._versions_init,
                    self._loaded_init, self._reports_init, self._links_init):
            own()                                     # each role's own state, in its module
        self.mark_cpu()                               # the controller's CPU per task from here

    def _start_driver(self) -> None:
        """A driver for the current cluster, on a wall clock (started now)."""
        tick = self.config.lemix.slo_s(self.cluster.profile.forward_latency_s) / 4
        driver = ClusterDriver(self.cluster, self, retry_every_s=tick, on_failed=self._task_failed,
                               on_aborted=self._training_aborted, on_error=self._run_failed,
                               link=self if self.node_loops else None)
        driver.start()
        self.mark_cpu()
        self.driver = driver

    def mark_cpu(self) -> None:
        """Count this process's CPU time (every thread: the event loop, Ray's own) and the
        arriving tasks from now (stats(): controller_cpu_ms_per_task): a new driver does,
        and a trace replay, so the workers' start-up is not in its figure."""
        self.cpu_mark, self.wall_mark = time.process_time(), time.monotonic()
        self._count_arrivals()

    def _task_failed(self, task: OnlineTask) -> None:
        """No node is left to run ``task``."""
        why = "no stage-worker node is alive: " + "; ".join(self.dead.values())
        req = self.requests.get(task.task_id)
        if req is not None and req.finish_reason is None:
            req.fail(why)
        elif task.is_train:
            self._note_error(f"training task {task.task_id} not run: {why}")

    async def stop(self) -> dict:
        for q in self.queues.values():
            q.put_nowait(None)
        self._links_stop()
        for f in self.fit_futures:
            try:
                await asyncio.wait_for(asyncio.shield(f), 60)
            except asyncio.TimeoutError:
                pass
        self.store.close()
        return {"errors": self.errors}

    async def drain(self) -> None:
        """Wait until every task submitted so far completed (and the resumed samples'
        training, and the training a node restarting now will replay once it is back: its
        new group says which checkpoint it restored, or on the other nodes after
        ``stage.rejoin_s``), and any checkpoint it started. A restarted controller starts
        first."""
        await self.start()
        await self.driver.drain()
        while self.backlog or any(self.ledger.restoring(n) for n in self.cluster.scheduler.restarting):
            await asyncio.sleep(0.05)
            await self.driver.drain()
        while self.background:
            await asyncio.gather(*list(self.background), return_exceptions=True)

    async def use_policy(self, name: str) -> None:
        """Switch the policy between runs (nothing may be in flight): a fresh cluster
        scheduler and node schedulers, planning from the profile learnt so far, a clock and
        metrics from zero. The stage workers and their adapters stay."""
        from raycolo.online.policies import make_online_policy

        await self.drain()
        for _ in range(1000):   # the stages take the last releases (and a node loop its last
            # weight sync, which no task waits for: its mirror is active until the loop reports)
            if not any(self.inflight) and all(q.empty() for q in self.queues.values()) \
                    and not any(node.active for node in self.cluster.nodes):
                break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("use_policy: work is still in flight")
        cfg = self.config
        self.config = cfg.model_copy(update={"policy": name})
        self.policy = make_online_policy(name, cfg.lemix, nodes=cfg.nodes, train_rate=cfg.train_rate)
        self.cluster = Cluster(self.policy, self.cluster.learner.current, cfg.nodes, cfg.lemix)
        self.cluster.scheduler.down = set(self.dead)  # a node down for good stays down
        self._reset_busy()                            # busy fractions count the new cluster's ops
        self._start_driver()
        self._forget_tasks()
        self._reset_hops()
        if self.node_loops:
            self._adopt_on_nodes()
