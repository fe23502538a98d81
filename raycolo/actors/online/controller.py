"""The live online controller: LeMix (or any online policy) placing real work on stage workers.

One async actor holds the deployment's :class:`~raycolo.online.scheduling.cluster.Cluster` (the
policy, the cluster scheduler and one node scheduler per node: the same objects the
simulator runs) and its :class:`~raycolo.online.driver.ClusterDriver` on a wall clock.
Its op runner role (``runner``) puts an op the driver starts on its stage's queue as a
payload; the stage worker (a Ray Train worker, :mod:`raycolo.actors.online.stage_worker`) pulls it, runs
it and reports back, and the driver carries on with the node scheduler's next step.

Why one actor rather than a controller plus a node-scheduler actor per node: every op's
completion feeds the cluster scheduler (calibration of LeMix's planned paths, the profile
learner, node idleness), so a separate node actor would add an actor hop per op without
saving one. The node logic stays a separate object (``NodeScheduler``) all the same.

The actor is made of role objects, each a class in its own module that owns its fields
and is built with the controller (:mod:`.state` has what all of them read): worker
groups (``workers``, :mod:`.workers`), the op runner (``runner``, :mod:`.op_runner`),
the request desk (``desk``, :mod:`.requests`), the sample pump (``pump``,
:mod:`.sample_pump`), adapter versions (``adapters``, :mod:`.adapters`), adapters loaded
over HTTP (``loras``, :mod:`.loaded_adapters`), reports (``reports``, :mod:`.reports`) and
the links to node loops (``links``, :mod:`.nodes`). A role reads another's fields as
``ctl.<role>.<field>`` and changes them only through its methods. The actor's remote
methods forward to the role that answers them (:data:`API`). What is left here ties them
together: the driver, the policy swap, stop and drain.

Each node is one ``TorchTrainer`` (S workers, one logical or real GPU each), fitted in a
thread of this actor; its workers register as ``node-<n>/stage-<s>``.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import time

import ray

from raycolo.actors.online.adapters import AdapterVersions
from raycolo.actors.online.loaded_adapters import LoadedAdapters
from raycolo.actors.online.nodes import NodeLinks
from raycolo.actors.online.op_runner import OpRunner
from raycolo.actors.online.reports import Reports
from raycolo.actors.online.requests import RequestDesk
from raycolo.actors.online.state import ControllerState
from raycolo.actors.online.sample_pump import SamplePump
from raycolo.actors.online.workers import WorkerGroups
from raycolo.online.driver import ClusterDriver
from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.tasks import OnlineTask


STOP_RUNS_S = 60.0        # stop(): how long the runs get to end before their host is killed

# What the actor offers over Ray, by role: each name is a method of that role, called as
# ``controller.<name>.remote(...)`` (the role objects themselves do not cross the actor).
API = {
    "workers": ("start", "run_name", "run_ended", "incarnation", "register", "group_failed", "registry", "placement"),
    "runner": ("next_op", "op_done", "op_failed"),
    "desk": ("attach", "detach", "submit", "admit", "front_events", "unfinished", "cancel", "stream", "result",
             "progress"),
    "pump": ("stored_samples", "add_samples", "submit_training"),
    "adapters": ("held_out_loss", "held_out_preference", "adapter_versions", "checkpoint_committed",
                 "export_adapter"),
    "loras": ("load_adapter", "unload_adapter", "resolve_adapter", "loaded_adapters"),
    "reports": ("beacon", "train_status", "monitor", "last_node", "health", "stats", "sample_ledger", "metrics",
                "profile_json", "op_log"),
    "links": ("node_setup", "node_commands", "node_report"),
}
ROLES = {"workers": WorkerGroups, "runner": OpRunner, "desk": RequestDesk, "pump": SamplePump,
         "adapters": AdapterVersions, "loras": LoadedAdapters, "reports": Reports, "links": NodeLinks}


def _forward(role: str, name: str):
    """The actor's method ``name``: the same call on its ``role`` (signature and docstring
    kept, so Ray binds the arguments as the role's method does)."""
    method = getattr(ROLES[role], name)
    if inspect.isasyncgenfunction(method):
        async def call(self, *args, **kwargs):
            async for item in getattr(getattr(self, role), name)(*args, **kwargs):
                yield item
    elif inspect.iscoroutinefunction(method):
        async def call(self, *args, **kwargs):
            return await getattr(getattr(self, role), name)(*args, **kwargs)
    else:
        def call(self, *args, **kwargs):
            return getattr(getattr(self, role), name)(*args, **kwargs)
    return functools.wraps(method)(call)


def _offers(cls):
    for role, names in API.items():
        for name in names:
            assert not hasattr(cls, name), f"OnlineController.{name} is offered twice"
            setattr(cls, name, _forward(role, name))
    return cls


@ray.remote(num_cpus=0, max_concurrency=1000)
@_offers
class OnlineController(ControllerState):
    """One actor made of role objects (``self.workers``, ``self.runner``, ``self.desk``,
    ``self.pump``, ``self.adapters``, ``self.loras``, ``self.reports``, ``self.links``),
    each owning its fields; :data:`API` says which role answers each remote call. What is
    here ties them together: the shared state (:mod:`.state`), the driver, the policy
    swap, stop and drain."""

    def __init__(self, config: dict, name: str, namespace: str):
        super().__init__(config, name, namespace)     # what every role reads (state.py)
        for role, cls in ROLES.items():               # each role's own state, in its module
            setattr(self, role, cls(self))            # (in this order: a role may read an earlier one)
        self.mark_cpu()                               # the controller's CPU per task from here

    def start_driver(self) -> None:
        """A driver for the current cluster, on a wall clock (started now)."""
        tick = self.config.lemix.slo_s(self.cluster.profile.forward_latency_s) / 4
        driver = ClusterDriver(self.cluster, self.runner, retry_every_s=tick, on_failed=self._task_failed,
                               on_aborted=self.runner.training_aborted, on_error=self.runner.run_failed,
                               link=self.links if self.links.node_loops else None)
        driver.start()
        self.mark_cpu()
        self.driver = driver

    def mark_cpu(self) -> None:
        """Count this process's CPU time (every thread: the event loop, Ray's own) and the
        arriving tasks from now (stats(): controller_cpu_ms_per_task): a new driver does,
        and a trace replay, so the workers' start-up is not in its figure."""
        self.cpu_mark, self.wall_mark = time.process_time(), time.monotonic()
        self.desk.count_arrivals()

    def _task_failed(self, task: OnlineTask) -> None:
        """No node is left to run ``task``."""
        why = "no stage-worker node is alive: " + "; ".join(self.workers.dead.values())
        req = self.desk.requests.get(task.task_id)
        if req is not None and req.finish_reason is None:
            req.fail(why)
        elif task.is_train:
            self.note_error(f"training task {task.task_id} not run: {why}")

    async def stop(self) -> dict:
        """End the runs (each node's loop is told to stop; its train function returns),
        close the sample store, and end the worker groups' host."""
        for q in self.workers.queues.values():
            q.put_nowait(None)
        self.links.stop()
        host = self.workers.host
        if host is not None:
            try:
                await asyncio.wait_for(host.wait.remote(STOP_RUNS_S), STOP_RUNS_S + 5)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                pass
            ray.kill(host)
        self.pump.store.close()
        return {"errors": self.errors}

    async def drain(self) -> None:
        """Wait until every task submitted so far completed (and the resumed samples'
        training, and the training a node restarting now will replay once it is back: its
        new group says which checkpoint it restored, or on the other nodes after
        ``stage.rejoin_s``), and any checkpoint it started. A restarted controller starts
        first."""
        await self.workers.start()
        await self.driver.drain()
        while self.pump.backlog or any(self.ledger.restoring(n) for n in self.cluster.scheduler.restarting):
            await asyncio.sleep(0.05)
            await self.driver.drain()
        while self.runner.background:
            await asyncio.gather(*list(self.runner.background), return_exceptions=True)

    async def use_policy(self, name: str) -> None:
        """Switch the policy between runs (nothing may be in flight): a fresh cluster
        scheduler and node schedulers, planning from the profile learnt so far, a clock and
        metrics from zero. The stage workers and their adapters stay."""
        from raycolo.online.policies import make_online_policy

        await self.drain()
        for _ in range(1000):   # the stages take the last releases (and a node loop its last
            # weight sync, which no task waits for: its mirror is active until the loop reports)
            if not any(self.runner.inflight) and all(q.empty() for q in self.workers.queues.values()) \
                    and not any(node.active for node in self.cluster.nodes):
                break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("use_policy: work is still in flight")
        cfg = self.config
        self.config = cfg.model_copy(update={"policy": name})
        self.policy = make_online_policy(name, cfg.lemix, nodes=cfg.nodes, train_rate=cfg.train_rate)
        self.cluster = Cluster(self.policy, self.cluster.learner.current, cfg.nodes, cfg.lemix)
        self.cluster.scheduler.down = set(self.workers.dead)  # a node down for good stays down
        self.reports.reset_busy()                            # busy fractions count the new cluster's ops
        self.start_driver()
        self.desk.forget_tasks()
        self.reports.reset_hops()
        if self.links.node_loops:
            self.links.adopt_on_nodes()
