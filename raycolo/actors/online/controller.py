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

Adapter checkpoints, pins and exports live in :mod:`.online_adapters`, read-only reports
(status, health, stats, monitor) in :mod:`.online_reports`: mixins of this actor.

Each node is one ``TorchTrainer`` (S workers, one logical or real GPU each), fitted in a
thread of this actor; its workers register as ``node-<n>/stage-<s>``.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import ray

from raycolo.errors import ConfigError
from raycolo.engine.executor.stage_ops import DropActivations, ReleaseKV, StageResult, StageWork
from raycolo.actors.online.adapters import AdapterVersions
from raycolo.actors.online.nodes import NodeLinks
from raycolo.actors.online.reports import Reports
from raycolo.online.scheduling.node_commands import OutOfBand
from raycolo.online.serving.messages import LAST_EVENTS, Admission, StreamEvent
from raycolo.online.serving.token_wire import FrontKey, token_events
from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.config import OnlineConfig, layer_bounds, live_profile, model_hf_config, stage_build
from raycolo.online.driver import ClusterDriver, OpLost
from raycolo.online.scheduling.node import Op
from raycolo.online.scheduling.node_events import OpResult
from raycolo.online.stage_messages import ServedRequest, TrainingShare, stage_message, take_token, training_share
from raycolo.online.samples import (Cursor, SampleStore, TrainingLedger, clip_sample, from_ranges, plan_resumption,
                                    training_rows)
from raycolo.generation import SamplingParams, stop_token_set
from raycolo.online.tasks import OnlineTask


KEPT_FINISHED = 4096      # finished requests the controller keeps (result(), progress())
LOST_IN_RESTART = ("request {rid} was accepted before the deployment's controller restarted; "
                   "its outcome went with that controller (its stream ended then)")


@dataclass
class LiveRequest(ServedRequest):
    """A request's events (raycolo.online.serving.messages.StreamEvent) go to its stream."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_s: float = 0.0


START_TIMEOUT_S = 300.0    # stage workers must register within this


class FrontQueue:
    """The events of a request an HTTP replica admitted: they go to that replica's
    channel (:meth:`OnlineController.front_events`), tagged with the replica's key for
    the request, rather than to a queue per request (raycolo/actors/serve/front_channel.py)."""

    __slots__ = ("mux", "key")

    def __init__(self, mux: asyncio.Queue, key: int):
        self.mux, self.key = mux, key

    def put_nowait(self, event) -> None:
        self.mux.put_nowait((self.key, event))


@ray.remote(num_cpus=0, max_concurrency=1000)
class OnlineController(AdapterVersions, Reports, NodeLinks):
    def __init__(self, config: dict, name: str, namespace: str):
        from raycolo.engine.models import load_tokenizer
        from raycolo.online.policies import make_online_policy

        self.config = OnlineConfig.model_validate(config)
        self.name, self.namespace = name, namespace
        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model_loading_config.model_id)
        self.model_config = model_hf_config(cfg.model_loading_config.model_id)
        self.bounds = layer_bounds(self.model_config.num_hidden_layers, cfg.stages)
        profile = live_profile(cfg, self.model_config)
        self.policy = make_online_policy(cfg.policy, cfg.lemix, nodes=cfg.nodes, train_rate=cfg.train_rate)
        self.cluster = Cluster(self.policy, profile, cfg.nodes, cfg.lemix)
        self.store = SampleStore(cfg.sample_store)
        self.cursor = Cursor()
        self.driver: Optional[ClusterDriver] = None
        self.queues = {(n, s): asyncio.Queue() for n in range(cfg.nodes) for s in range(cfg.stages)}
        self.waiting: dict[tuple[int, int, int], asyncio.Future] = {}
        self.workers: dict[str, dict] = {}
        self.epochs = [0] * cfg.nodes
        self.registered = [set() for _ in range(cfg.nodes)]
        self.ready = asyncio.Event()
        self.requests: dict[int, LiveRequest] = {}
        self.tasks: dict[int, OnlineTask] = {}
        self.train_tasks: dict[int, list] = {}
        self.train_seqs: dict[int, list[int]] = {}          # training task -> its samples' seqs
        self.ledger = TrainingLedger(cfg.nodes)             # which samples the adapters keep
        self.restarts: list[dict] = []                       # node, reason, time, lost, replayed
        self.dead: dict[int, str] = {}                       # node -> why its worker group is gone
        self.losses: list[tuple[float, int, float]] = []    # (time, task, loss)
        # ids stay unique across restarts of this actor: a request accepted before a crash
        # is never mistaken for one accepted after (microseconds since the epoch)
        self.first_id = self.next_id = time.time_ns() // 1000
        self.adapter_version = 0
        self.trained_steps = [0] * cfg.nodes
        self.gates = [asyncio.Event() for _ in range(cfg.nodes)]
        for g in self.gates:
            g.set()
        self.inflight = [0] * cfg.nodes
        self.fit_futures = []
        self.errors: list[str] = []
        self.hops = 0
        self.run_token = uuid.uuid4().hex[:8]
        self.adapter_dir = Path(cfg.storage_path) / f"adapter-{self.run_token}"
        self.last_trained_node = 0
        self.exports: dict[int, asyncio.Task] = {}
        self.versions: list[int] = []                 # adapter versions servable as @v<k>
        self.loaded: dict[str, dict] = {}             # adapters loaded over HTTP, by name (online_adapters.py)
        self.oob_seq = -1_000_000     # seq numbers of out-of-band payloads (checkpoint, lora)
        self.background: set[asyncio.Task] = set()   # checkpoints under way
        self.rejections = 0                           # admissions refused (429)
        self.auto_train = False                       # samples arrive over HTTP: train them as they come
        self.adapter_changed_s = time.time()          # the served adapter last changed
        self.fronts: set[str] = set()                 # HTTP replicas attached (serve_app.py)
        self.muxes: dict[str, asyncio.Queue] = {}     # HTTP replica -> its requests' events (front_events)
        self.front_sent = [0, 0]                      # front_events: messages, events in them
        self.busy_s: dict = {}                        # (node, stage) -> seconds of ops run (monitor)
        self.device: dict = {}                        # (node, stage) -> its device's last reading
        self.sends: dict = {}                         # (node, stage) -> (sends held, sends posted)
        self.busy_seen = 0                            # op_log entries counted into busy_s
        self.mark_cpu()                               # the controller's CPU per task from here
        self._starting: Optional[asyncio.Task] = None      # the launch of the stage workers
        self._partial: Optional[asyncio.TimerHandle] = None  # serve with the nodes there are (_serve_partial)
        self.cancelled: dict[str, int] = {}           # requests ended early, by reason: stop, abort (client gone)
        self.restored: dict[int, tuple] = {}          # node -> (version, seqs held, cursor) of an earlier run
        self.resumption: Optional[dict] = None        # what this deployment took up from an earlier one
        self.train_runs = [0] * cfg.nodes             # Ray Train runs started per node (a new one after its controller died)
        self._flush_timer: Optional[asyncio.TimerHandle] = None   # trains a partial micro-batch of HTTP samples
        self.backlog: list[int] = []                  # resumed samples to train, fed in as training tasks finish
        # (node, stage) -> seqs of its sends that their receivers consumed: told to it with
        # its next op, so it lets go of them (gloo's isend reports completion only to wait())
        self.received: dict[tuple[int, int], list[int]] = {}
        self._links_init()

    # -- start and stop ----------------------------------------------------------------------
    async def start(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """Start the stage workers and wait until they registered. Idempotent: a second
        caller (another HTTP replica, a restarted one) waits for the same start. Requests
        and samples start it too: a controller Ray restarted after a crash starts again on
        its first call, resuming from the checkpoints and the sample store. A launch that
        failed (no GPUs for even one node) is tried again by the next call."""
        self._wake()
        await asyncio.shield(self._starting)
        try:
            await asyncio.wait_for(asyncio.shield(self.ready.wait()), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"stage workers did not register within {timeout_s:.0f} s "
                               f"({sum(len(r) for r in self.registered)} of "
                               f"{self.config.nodes * self.config.stages}): {self.errors}") from None
        return {"workers": sorted(self.workers), "layer_bounds": self.bounds}

    def _wake(self) -> None:
        """Launch the stage workers (in the background) unless that is done or under way."""
        task = self._starting
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            self._starting = asyncio.get_running_loop().create_task(self._launch())

    async def attach(self, front: str) -> None:
        """An HTTP replica uses this deployment."""
        self.fronts.add(front)

    async def detach(self, front: str, grace_s: float = 30.0) -> None:
        """An HTTP replica shut down; with none attached after ``grace_s`` (a replica that is
        only being replaced attaches again), the deployment stops and this actor exits."""
        self.fronts.discard(front)
        await asyncio.sleep(grace_s)
        if front not in self.fronts and front in self.muxes:
            self.muxes.pop(front).put_nowait(None)      # ends its front_events call
        if not self.fronts:
            await self.stop()
            ray.actor.exit_actor()

    async def _launch(self) -> None:
        """Start every node's worker group. A first start needs a GPU per stage worker. A
        controller Ray restarted (its Ray node died with the GPUs there) starts with one
        node's worth: the nodes that fit register and serve after ``stage.start_grace_s``;
        Ray Train keeps trying to place the others, which join when GPUs come back."""
        need = self.config.nodes * self.config.gpus_per_node()
        gpus = ray.cluster_resources().get("GPU", 0)
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if gpus < (self.config.gpus_per_node() if restarted else need) - 1e-9:
            raise ConfigError(f"nodes x stages: the deployment needs {need:g} GPUs ({self.config.stage.gpus_per_worker:g} "
                              f"per stage worker); the Ray cluster has {gpus:g}. On a CPU machine give the "
                              f"cluster logical GPUs: ray start --head --num-gpus={self.config.gpus_needed()}")
        if gpus < need - 1e-9:
            self.errors.append(f"restarted with {gpus:g} of the {need:g} GPUs the deployment needs: "
                               f"the nodes that fit serve; the others join when GPUs come back")
        loop = self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._release_groups)   # of an earlier controller of this deployment
        self.driver = self._driver()
        for n in range(self.config.nodes):
            trainer = self._trainer(n)
            self.fit_futures.append(loop.run_in_executor(None, self._fit, n, trainer))

    def _serve_partial(self) -> None:
        """``stage.start_grace_s`` after the first node registered: serve with the nodes
        there are; the others are avoided until their groups register (``register``)."""
        if self.ready.is_set():
            return
        for n in range(self.config.nodes):
            if len(self.registered[n]) < self.config.stages:
                if self.config.resume and n not in self.restored:   # what its group will restore
                    committed = self._committed_checkpoint(n)
                    if committed is not None:
                        self.restored[n] = committed
                self.driver.node_lost(n)
                self.errors.append(f"node {n}: not registered {self.config.stage.start_grace_s:g} s after "
                                   f"the first node; serving without it until it does")
        self._resume()
        self.ready.set()

    def _committed_checkpoint(self, n: int) -> Optional[tuple]:
        """(adapter version, seqs held, cursor) of node ``n``'s newest committed checkpoint,
        read from its run directory (Ray Train's ``checkpoint_manager_snapshot.json``):
        what its group restores when it starts. A node not yet back still holds those
        samples, so they are not trained again elsewhere; None without one."""
        run_dir = Path(self.config.storage_path).resolve() / self.run_name(n)
        try:
            latest = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
            found = run_dir / latest["checkpoint_dir_name"]
            version = int(latest["metrics"]["adapter_version"])
            held = json.loads((found / "held.json").read_text()) if (found / "held.json").exists() else []
            cursor = json.loads((found / "cursor.json").read_text()) if (found / "cursor.json").exists() else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return version, from_ranges(held), Cursor(**cursor) if cursor else Cursor()

    def _driver(self) -> ClusterDriver:
        tick = self.config.lemix.slo_s(self.cluster.profile.forward_latency_s) / 4
        driver = ClusterDriver(self.cluster, self, retry_every_s=tick, on_failed=self._task_failed,
                               on_aborted=self._training_aborted, on_error=self._run_failed,
                               link=self if self.node_loops else None)
        driver.start()
        self.mark_cpu()
        return driver

    def mark_cpu(self) -> None:
        """Count this process's CPU time (every thread: the event loop, Ray's own) and the
        arriving tasks from now (stats(): controller_cpu_ms_per_task): a new driver does,
        and a trace replay, so the workers' start-up is not in its figure."""
        self.cpu_mark, self.wall_mark, self.arrived = time.process_time(), time.monotonic(), 0

    def run_name(self, n: int) -> str:
        """Node ``n``'s Ray Train run: fixed per storage path and adapter shape when the
        deployment resumes (a new run of the same name restores its newest checkpoint)."""
        if self.config.resume:
            return f"raycolo-{self.config.adapter_fingerprint()}-node{n}"
        return f"raycolo-node{n}-{self.run_token}"

    def _trainer(self, n: int):
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from raycolo.actors.online.group_watch import GroupWatch
        from raycolo.actors.online.stage_worker import stage_loop

        cfg = self.config
        loop_config = {
            "node": n, "controller": self.name, "namespace": self.namespace, **stage_build(cfg),
            "layer_bounds": self.bounds, "cpu_threads": cfg.stage.cpu_threads,
            "init_from": cfg.lora.init_from,      # every stage starts from its part (no checkpoint restored)
            "run_dir": str(Path(cfg.storage_path).resolve() / self.run_name(n)),
            "data_plane": cfg.stage.data_plane, "report_every_s": cfg.stage.report_every_s,
            "switch_interval_s": cfg.stage.switch_interval_s,
        }
        return TorchTrainer(
            stage_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=cfg.stages, use_gpu=True,
                                         resources_per_worker={"CPU": cfg.stage.cpus_per_worker,
                                                               "GPU": cfg.stage.gpus_per_worker}),
            torch_config=TorchConfig(backend=cfg.stage.backend),
            run_config=RunConfig(name=self.run_name(n),
                                 storage_path=str(Path(cfg.storage_path).resolve()),
                                 failure_config=FailureConfig(max_failures=cfg.stage.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                 callbacks=[GroupWatch(self.name, self.namespace, n)]))

    def _fit(self, n: int, trainer) -> None:
        """Run node ``n``'s worker group. Past ``max_failures`` restarts of the group the
        node is gone for good; if instead the run's own Ray Train controller died (its
        workers die with it), a new run of the same name restores the newest checkpoint,
        at most ``max_failures`` times too."""
        from ray.exceptions import RayActorError

        while True:
            self.train_runs[n] += 1
            try:
                trainer.fit()
                return
            except Exception as exc:
                why = f"node {n}: {type(exc).__name__}: {exc}"
                self.errors.append(why)
                lost_controller = isinstance(exc, RayActorError) or isinstance(exc.__cause__, RayActorError)
                if lost_controller and self.train_runs[n] <= self.config.stage.max_failures and self.config.resume:
                    self._loop.call_soon_threadsafe(self._node_lost, n, f"node {n}: its Ray Train controller died")
                    self._release_groups([n])
                    trainer = self._trainer(n)
                    continue
                self._loop.call_soon_threadsafe(self._node_dead, n, why)
                return

    def _groups_file(self) -> Path:
        run = self.config.adapter_fingerprint() if self.config.resume else self.run_token
        return Path(self.config.storage_path) / f"placement-groups-{run}.json"

    def _note_group(self, node: int, group: Optional[str]) -> None:
        """Remember (on disk: a restarted controller reads it) the placement group that
        holds node ``node``'s stage workers."""
        if not group:
            return
        path = self._groups_file()
        held = json.loads(path.read_text()) if path.exists() else {}
        if held.get(str(node)) != group:
            held[str(node)] = group
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(held))
            tmp.replace(path)

    def _release_groups(self, nodes=None) -> None:
        """Remove the placement groups of worker groups whose Ray Train controller died.
        Ray removes a placement group with the job that created it, not with the actor, and
        Ray Train's own cleaner needs the dashboard's state API; without this, their GPUs
        stay reserved and a new run of the node never starts."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

        path = self._groups_file()
        if not path.exists():
            return
        held = json.loads(path.read_text())
        for node, group in list(held.items()):
            if nodes is not None and int(node) not in nodes:
                continue
            pg = PlacementGroup(PlacementGroupID(bytes.fromhex(group)))
            if placement_group_table(pg).get("state") not in (None, "REMOVED"):
                remove_placement_group(pg)
                self.errors.append(f"node {node}: released the placement group {group[:12]} of a dead worker group")
            del held[node]
        path.write_text(json.dumps(held))

    def _node_dead(self, node: int, why: str) -> None:
        """The node's group failed past its restarts: nothing is placed there any more and
        its work moves to the other nodes; with none left, requests get an error event."""
        self.dead[node] = why
        self._node_lost(node, why, down=True)

    def _task_failed(self, task: OnlineTask) -> None:
        """No node is left to run ``task``."""
        why = "no stage-worker node is alive: " + "; ".join(self.dead.values())
        req = self.requests.get(task.task_id)
        if req is not None and req.finish_reason is None:
            req.finish_reason = "error"
            req.events.put_nowait(StreamEvent("error", why))
        elif task.is_train:
            self.errors.append(f"training task {task.task_id} not run: {why}")

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

    # -- the stage workers' side ------------------------------------------------------------
    async def register(self, node: int, stage: int, info: dict) -> int:
        """A stage worker starts; returns its epoch (the node's worker-group generation).
        A stage registering twice means Ray Train restarted the node's group."""
        if stage in self.registered[node]:
            self._node_lost(node, f"node-{node}/stage-{stage} registered again (worker group restarted)")
        key = f"node-{node}/stage-{stage}"
        self.workers[key] = dict(info, node=node, stage=stage, epoch=self.epochs[node],
                                 registered_s=time.time())
        if stage == 0:
            self._note_group(node, info.get("placement_group"))
        if stage == 0 and not self.ready.is_set() and self.config.resume and info.get("restored_version"):
            self.restored[node] = (info["restored_version"], from_ranges(info.get("restored_held") or []),
                                   Cursor(**info["restored_cursor"]) if info.get("restored_cursor") else Cursor())
        self.registered[node].add(stage)
        complete = len(self.registered[node]) == self.config.stages
        if complete and self.driver is not None:
            self.driver.node_back(node)    # a restarted node takes work again (no-op otherwise)
        if complete and self.ledger.restoring(node):
            for r in self.restarts:      # the node's new group is complete: it serves again
                if r["node"] == node and r["epoch"] == self.epochs[node]:
                    r["back_s"] = self.driver.now()
            # train again what the restored checkpoint does not hold
            self._replay(node, self.ledger.restore(node, self.workers[f"node-{node}/stage-0"].get("restored_version")))
        if all(len(r) == self.config.stages for r in self.registered) and not self.ready.is_set():
            self._resume()
            self.ready.set()
        elif complete and not self.ready.is_set() and self._partial is None:
            self._partial = self._loop.call_later(self.config.stage.start_grace_s, self._serve_partial)
        return self.epochs[node]

    def _resume(self) -> None:
        """Every node registered for the first time: take up an earlier deployment's
        training (its checkpoints, restored by the nodes, and the samples stored since: fed
        in ``lora.queued_tasks`` per node at a time), then the samples that arrived while
        the workers started."""
        if self.config.resume:
            plan = plan_resumption(self.restored, len(self.store))
            for node, (version, seqs, _) in self.restored.items():
                self.ledger.resume(node, version, seqs)
            self.adapter_version, self.cursor = plan.adapter_version, plan.cursor
            self.resumption = {"adapter_version": plan.adapter_version, "samples_held": plan.held,
                               "samples_resumed": len(plan.pending),
                               "nodes_restored": sorted(self.restored)}
            self.backlog = list(plan.pending)
        self._pump_training()

    @ray.method(enable_task_events=False)   # per op and stage: kept out of the GCS's task-event store
    async def next_op(self, node: int, stage: int, epoch: int,
                      done: Optional[StageResult] = None) -> Optional[StageWork]:
        """The stage's next op; None tells a worker of an old group to stop. ``done``: the
        result of the op the worker just ran, reported in the same call (one actor call
        per op rather than two)."""
        self.hops += 1
        if done is not None:
            self._op_done(node, stage, epoch, done)
        if epoch != self.epochs[node]:
            return None
        return await self.queues[(node, stage)].get()

    @ray.method(enable_task_events=False)   # per op and stage: kept out of the GCS's task-event store
    async def op_done(self, node: int, stage: int, epoch: int, result: StageResult) -> None:
        self.hops += 1
        self._op_done(node, stage, epoch, result)

    def _op_done(self, node: int, stage: int, epoch: int, result: StageResult) -> None:
        if epoch != self.epochs[node]:
            return           # an op of a worker group that is gone: its node was reset
        if result.device is not None:
            self.device[(node, stage)] = result.device
        if result.sends is not None:
            self.sends[(node, stage)] = result.sends
        future = self.waiting.pop((node, stage, result.seq), None)
        if future is not None and not future.done():
            future.set_result(result)

    async def op_failed(self, node: int, stage: int, epoch: int, seq: int, error: str) -> None:
        """An op raised on its stage (the worker then exits and Ray Train restarts the
        group, up to ``max_failures``): the node is reset now rather than at the new
        group's registration, and its work is placed again."""
        self.errors.append(f"node-{node}/stage-{stage} op {seq}: {error}")
        if epoch == self.epochs[node]:
            self._node_lost(node, f"node-{node}/stage-{stage} op {seq} failed: {error}")

    async def group_failed(self, node: int, at: float, why: str) -> None:
        """Ray Train found node ``node``'s worker group failed at ``at`` (wall clock; told
        by :class:`~raycolo.actors.online.group_watch.GroupWatch` before the restart): the node is
        reset now and avoided until its new group is complete, rather than found out when
        the new group registers. Ignored if the loss is known already (an op that raised
        told us first) or a new group registered since."""
        if self.driver is None or node in self.dead:
            return
        if not self.registered[node] and node in self.cluster.scheduler.restarting:
            return                          # already reset, the new group not yet here
        if any(w["node"] == node and w["epoch"] == self.epochs[node] and w["registered_s"] > at
               for w in self.workers.values()):
            return                          # a new group registered after the failure
        self._node_lost(node, why)

    def _node_lost(self, node: int, reason: str, down: bool = False) -> None:
        """Node ``node``'s worker group is gone (its KV caches, activations, queued ops)
        and its adapter rolls back to its last checkpoint: a new epoch starts, its ops in
        flight are dropped, its requests resume (prompt + streamed tokens, re-prefilled),
        its training tasks start over, and the samples it trained since the checkpoint
        are trained again."""
        self.epochs[node] += 1
        self.registered[node] = set()
        for s in range(self.config.stages):    # an old worker still waiting for an op stops
            self.queues[(node, s)].put_nowait(None)
            self.queues[(node, s)] = asyncio.Queue()
            self.received.pop((node, s), None)
        self._links_lost(node, reason)
        resumed = self.cluster.resumed
        if down:
            self.driver.node_down(node)
        else:
            self.driver.node_lost(node)
        for key in [k for k in self.waiting if k[0] == node]:
            future = self.waiting.pop(key)
            if not future.done():
                future.set_exception(OpLost(reason))
        self.ledger.lose(node)
        self.restarts.append({"node": node, "reason": reason, "time_s": self.driver.now(),
                              "epoch": self.epochs[node], "resumed_tasks": self.cluster.resumed - resumed,
                              "replayed_samples": None, "adapter_version": self.ledger.version[node],
                              "down": down})
        if down:                   # trained again on the other nodes
            self._replay(node, self.ledger.abandon(node))
        else:   # replayed once the new group says which checkpoint it restored (register),
            # or on the other nodes if it is not back in time (its Ray node may be gone)
            self._loop.call_later(self.config.stage.rejoin_s, self._rejoin_overdue, node, self.epochs[node])

    def _rejoin_overdue(self, node: int, epoch: int) -> None:
        """Node ``node``'s group lost at ``epoch`` is not back after ``stage.rejoin_s``: the
        samples it trained since its last checkpoint are trained on the other nodes (its
        adapter, when it comes back, is that checkpoint's)."""
        if self.epochs[node] != epoch or len(self.registered[node]) == self.config.stages \
                or not self.ledger.restoring(node):
            return
        seqs = self.ledger.abandon(node)
        self.errors.append(f"node {node}: not back {self.config.stage.rejoin_s:g} s after its loss; "
                           f"{len(seqs)} samples it trained since its checkpoint go to the other nodes")
        self._replay(node, seqs)

    def _replay(self, node: int, seqs: list) -> None:
        for r in reversed(self.restarts):
            if r["node"] == node:
                r["replayed_samples"] = len(seqs)
                break
        for i in range(0, len(seqs), self.config.lora.micro_batch):
            self._submit_samples(self.store.get(seqs[i:i + self.config.lora.micro_batch]))

    def registry(self) -> dict:
        return dict(self.workers)

    def placement(self) -> dict:
        """Which Ray node runs what: this controller, and each stage worker (by Ray node id)."""
        return {"controller": ray.get_runtime_context().get_node_id(),
                "stage_workers": {key: w["node_id"] for key, w in self.workers.items()}}

    # -- the op runner (ClusterDriver calls it) ---------------------------------------------
    async def run(self, op: Op):
        if op.kind == "sync":   # every stage of a serving node waits for the exported adapter
            await self._export_for_sync(op.version)
        await self.gates[op.node].wait()
        if op.generation != self.cluster.nodes[op.node].generation:
            raise OpLost("its node was reset")
        payload = self._payload(op)
        future = asyncio.get_running_loop().create_future()
        self.waiting[(op.node, op.stage, op.seq)] = future
        self.inflight[op.node] += 1
        try:
            self.queues[(op.node, op.stage)].put_nowait(payload)
            result = await future
        except OpLost:
            raise            # its requests were placed again
        except Exception as exc:
            self._fail_requests(op, f"node-{op.node}/stage-{op.stage}: {exc}")
            raise
        finally:
            self.inflight[op.node] -= 1
        if op.generation != self.cluster.nodes[op.node].generation:
            raise OpLost("its node was reset as it finished")
        if op.after is not None:      # this op received what its neighbour sent
            sender = op.stage + 1 if op.kind == "train_b" else op.stage - 1
            self.received.setdefault((op.node, sender), []).append(op.after)
        return self._absorb_result(op, result)

    def _fail_requests(self, op: Op, why: str) -> None:
        """The requests ``op`` carried get a clear error in their streams."""
        if op.kind in ("prefill", "decode"):
            for r in op.tasks:
                req = self.requests.get(r.task_id)
                if req is not None and req.finish_reason is None:
                    req.finish_reason = "error"
                    req.events.put_nowait(StreamEvent("error", why))

    def _payload(self, op: Op) -> StageWork:
        return stage_message(op, self.config.stages, self.requests, self._samples_of,
                             lambda v: str(self._version_dir(v)), lambda v: str(self.adapter_dir / f"v{v}"),
                             self.config.lora.dpo_beta, self.received.pop((op.node, op.stage), ()))

    def _samples_of(self, op: Op) -> TrainingShare:
        """A training op's task: its root task id, its samples and its share of the root's loss."""
        return training_share(op, self.cluster.nodes[op.node].micro, self.train_tasks.__getitem__,
                              self.config.lora.max_len)

    def _run_failed(self, exc: BaseException) -> None:
        """An op failed and the driver stopped: no request may wait for ever, so every one
        still running ends with the error in its stream."""
        why = f"the run stopped: {exc!r}"
        self.errors.append(why)
        for req in self.requests.values():
            if req.finish_reason is None:
                req.finish_reason = "error"
                req.events.put_nowait(StreamEvent("error", why))

    def _training_aborted(self, aborted: list) -> None:
        """SIRIUS took memory back from training micro-batches: every stage of their node
        drops their activations now (they run again from their first forward)."""
        for node, task_id in aborted:
            for s in range(self.config.stages):
                self.queues[(node, s)].put_nowait(DropActivations(seq=-1, tasks=(task_id,)))

    def _absorb_result(self, op: Op, result: StageResult) -> OpResult:
        if op.kind in ("prefill", "decode") and op.stage == self.config.stages - 1:
            finished = set()
            logprobs = result.logprobs or [None] * len(op.tasks)
            for r, token, logprob in zip(op.tasks, result.tokens, logprobs):
                req = self.requests[r.task_id]
                kept, reason = take_token(req, token)     # raycolo.generation's stop rules
                if self._deliver(req, token, kept, reason, logprob):
                    finished.add(r.task_id)
                    for s in range(self.config.stages):
                        self.queues[(op.node, s)].put_nowait(ReleaseKV(seq=-1, requests=(r.task_id,)))
            return OpResult(frozenset(finished))
        return self._training_done(op, result.loss)

    @staticmethod
    def _deliver(req: LiveRequest, token: int, kept: bool, reason: Optional[str], logprob) -> bool:
        """A token the request got (``kept``: it is the request's; ``reason``: it ended it)
        goes to its stream, unless its node sent it to the request's HTTP replica itself
        (``req.front``); returns whether the request ended."""
        if req.front is None:
            for event in token_events(token, kept, reason, logprob):
                req.events.put_nowait(event)
        if reason:
            req.finish_reason = reason
        return bool(reason)

    def _training_done(self, op: Op, loss: Optional[float]) -> OpResult:
        """A training op ended (before its node's scheduler takes it in): a last-stage
        forward's loss; a backward reaching stage 0 that takes the optimizer step."""
        if op.kind == "train_f" and op.stage == self.config.stages - 1:   # the node's stage rule takes the loss
            self.losses.append((time.time(), op.tasks[0].task_id, loss))
            return OpResult(loss=loss)
        if op.kind == "train_b" and op.stage == 0:
            if not op.step:           # a micro-batch of a task whose last one is still to come
                return OpResult()
            root = self._samples_of(op).root
            self.train_tasks.pop(root, None)
            self.ledger.train(op.node, self.train_seqs.pop(root, []))
            self.last_trained_node = op.node
            self.trained_steps[op.node] += 1
            self.adapter_changed_s = time.time()
            if self.auto_train or self.backlog:
                self._pump_training()
            if self.trained_steps[op.node] % self.config.lora.checkpoint_every == 0:
                task = asyncio.get_running_loop().create_task(self._checkpoint(op.node))
                self.background.add(task)
                task.add_done_callback(self.background.discard)
        return OpResult()

    async def _paused(self, node: int, payloads: list) -> list:
        """Run out-of-band payloads, one per stage, with the node's scheduled ops held back
        and none in flight (so no stage waits on a neighbour busy with something else).
        ``payloads`` may be a function, called once nothing is in flight."""
        gate = self.gates[node]
        while not gate.is_set():
            await asyncio.sleep(0.001)
        gate.clear()
        try:
            if self.node_loops:         # the node's loop holds its ops back itself
                await self._pause_node(node)
            while self.inflight[node] > 0:
                await asyncio.sleep(0.001)
            if callable(payloads):
                payloads = payloads()
            futures = []
            for s, payload in enumerate(payloads):
                fut = asyncio.get_running_loop().create_future()
                self.waiting[(node, s, payload.seq)] = fut
                futures.append(fut)
            if self.node_loops:
                self._send(node, OutOfBand(list(payloads)))
            else:
                for s, payload in enumerate(payloads):
                    self.queues[(node, s)].put_nowait(payload)
            return await asyncio.gather(*futures)
        finally:
            gate.set()

    # -- clients ---------------------------------------------------------------------------
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _params(self, max_tokens: Optional[int], temperature: float, top_p: float, seed: int,
                ignore_eos: bool, params: Optional[SamplingParams]) -> SamplingParams:
        """The request's SamplingParams: ``params`` as given (its max_tokens defaulting to
        the deployment's), or built from the older positional arguments."""
        if params is None:
            params = SamplingParams(max_tokens=max_tokens or self.config.max_tokens, temperature=temperature,
                                    top_p=top_p, seed=seed, ignore_eos=ignore_eos)
        elif "max_tokens" not in params.model_fields_set:
            params = params.model_copy(update={"max_tokens": self.config.max_tokens})
        return params

    async def submit(self, prompt: list, max_tokens: Optional[int] = None, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, base: bool = False,
                     version: Optional[int] = None, params: Optional[SamplingParams] = None,
                     front: Optional[FrontKey] = None) -> int:
        """Accept a completion request; returns its id (stream it with :meth:`stream`).
        ``params``: its SamplingParams (else built from max_tokens ... ignore_eos);
        ``base``: serve it with the base model (the adapter switched off for its rows);
        ``version``: with that saved adapter version (one of :meth:`adapter_versions`);
        ``front``: (HTTP replica, its key for the request): the events go to that
        replica's :meth:`front_events` instead."""
        await self.start()
        if version is not None and not self._servable(version):
            raise ValueError(f"adapter version {version} is not servable; these are: {self.versions}")
        params = self._params(max_tokens, temperature, top_p, seed, ignore_eos, params)
        tid = self._new_id()
        task = OnlineTask(tid, "inference", self.driver.now(), len(prompt), 1, 0, params.max_tokens)
        self._forget_finished()
        req = LiveRequest(task, list(prompt), params, seed=params.seed if params.seed is not None else seed,
                          stop_ids=stop_token_set(params, self.tokenizer.eos_token_ids),
                          submitted_s=self.driver.now(), base=base, version=version)
        if front is not None:
            req.events = FrontQueue(self._mux(front.replica), front.key)
            if self.node_loops and front.inbox is not None:
                req.front = front       # its node sends its tokens to the replica itself
        self.requests[tid] = req
        self.tasks[tid] = task
        self.arrived += 1
        self.driver.submit(task)
        return tid

    async def admit(self, prompt: list, max_tokens: Optional[int] = None, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, base: bool = False,
                    version: Optional[int] = None, params: Optional[SamplingParams] = None,
                    front: Optional[FrontKey] = None) -> Admission:
        """The HTTP front's submit: the request's id, or rejected "overloaded" beyond
        ``serve.max_ongoing_requests`` unfinished requests, "unavailable" when no node is
        alive, "unknown_version" (with the servable versions) for an adapter version that
        is not (or no longer) servable, "starting" while the stage workers (re)start. A
        rejected request was never accepted; an accepted one ends with its tokens or an
        error event, never silently."""
        if not self.ready.is_set():
            self._wake()
            return Admission(rejected="starting", retry_after_s=self.config.serve.retry_after_s,
                             why="the deployment is starting (or restarting after its controller failed)")
        if version is not None and not self._servable(version):
            return Admission(rejected="unknown_version", versions=tuple(self.versions))
        if len(self.dead) == self.config.nodes:
            return Admission(rejected="unavailable", why="; ".join(self.dead.values()))
        if self.unfinished() >= self.config.serve.max_ongoing_requests:
            self.rejections += 1
            return Admission(rejected="overloaded", retry_after_s=self.config.serve.retry_after_s)
        return Admission(id=await self.submit(prompt, max_tokens, temperature, top_p, seed, ignore_eos, base,
                                              version, params, front))

    def _mux(self, front: str) -> asyncio.Queue:
        if front not in self.muxes:
            self.muxes[front] = asyncio.Queue()
        return self.muxes[front]

    @ray.method(enable_task_events=False)
    async def front_events(self, front: str):
        """The events of every request HTTP replica ``front`` admitted (``admit(...,
        front=FrontKey(front, key))``), as they come: lists of (key, event), each with every event
        ready then (with B requests decoding, one message per iteration rather than B).
        Ends when the replica detached for good."""
        mux = self._mux(front)
        while True:
            batch = [await mux.get()]
            while not mux.empty():
                batch.append(mux.get_nowait())
            if None in batch:
                return
            self.front_sent[0] += 1
            self.front_sent[1] += len(batch)
            yield batch

    def _forget_finished(self) -> None:
        """A long-running service keeps at most ``KEPT_FINISHED`` finished requests (their
        prompts, tokens and event queues; the oldest go first), so memory does not grow
        with every request served; the scheduler and metrics forget them too (the run's
        figures then cover the requests kept; Prometheus histograms hold the rest)."""
        finished = len(self.requests) - self.unfinished()
        if finished <= KEPT_FINISHED + KEPT_FINISHED // 4:
            return
        gone = [rid for rid, r in self.requests.items() if r.finish_reason is not None][:finished - KEPT_FINISHED]
        trained = [tid for tid, t in self.tasks.items() if t.is_train and tid not in self.train_tasks]
        gone += trained[:max(0, len(trained) - KEPT_FINISHED)]
        for rid in gone:
            self.requests.pop(rid, None)
            self.tasks.pop(rid, None)
        self.cluster.forget(gone)

    def unfinished(self) -> int:
        return sum(1 for r in self.requests.values() if r.finish_reason is None)

    async def cancel(self, rid: int, reason: str = "stop") -> None:
        """End request ``rid`` at its next step (a stop string matched, or its client went
        away): no more tokens are sent, and its KV blocks are released like a finished one's."""
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None and req.cancelled is None:
            req.cancelled = reason
            self.cancelled[reason] = self.cancelled.get(reason, 0) + 1
            if self.node_loops:
                self._cancel_on_nodes(rid, reason)

    def _request(self, rid: int) -> Optional[LiveRequest]:
        """Request ``rid``, or None when it was accepted before this controller restarted
        (its outcome went with the old one; its client got an error). Unknown ids and
        finished requests forgotten long ago (only the last ``KEPT_FINISHED`` are kept)
        raise ValueError."""
        req = self.requests.get(rid)
        if req is not None:
            return req
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise ValueError(f"request id: expected an int, got {rid!r}")
        if rid < self.first_id:
            return None
        if rid < self.next_id:
            raise ValueError(f"request {rid} finished long ago and was forgotten "
                             f"(the last {KEPT_FINISHED} finished requests are kept)")
        raise ValueError(f"request {rid}: no such request")

    async def stream(self, rid: int):
        """Events of request ``rid`` as they come (:class:`~raycolo.online.serving.messages.StreamEvent`)."""
        req = self._request(rid)
        if req is None:
            yield StreamEvent("error", LOST_IN_RESTART.format(rid=rid))
            return
        self._own_queue(req, rid)
        while True:
            event = await req.events.get()
            yield event
            if event[0] in LAST_EVENTS:
                return

    async def result(self, rid: int) -> dict:
        """The whole completion: tokens (the stop token included), and finish_reason
        "stop", "length" or "error" (with ``error``, what failed)."""
        req = self._request(rid)
        if req is None:
            return {"id": rid, "tokens": [], "finish_reason": "error", "error": LOST_IN_RESTART.format(rid=rid)}
        self._own_queue(req, rid)
        tokens = []
        while True:
            kind, value = await req.events.get()
            if kind in ("token", "stop_token"):
                tokens.append(value)
            elif kind == "logprob":
                continue
            elif kind == "done":
                return {"id": rid, "tokens": tokens, "finish_reason": value}
            else:
                return {"id": rid, "tokens": tokens, "finish_reason": "error", "error": value}

    @staticmethod
    def _own_queue(req: LiveRequest, rid: int) -> None:
        if isinstance(req.events, FrontQueue):
            raise ValueError(f"request {rid} streams to the HTTP replica that admitted it")

    async def progress(self, rid: int) -> dict:
        """Tokens request ``rid`` has streamed so far, and how it ended (None: running)."""
        req = self._request(rid)
        if req is None:
            return {"id": rid, "tokens": 0, "finish_reason": "error"}
        return {"id": rid, "tokens": len(req.generated), "finish_reason": req.finish_reason}

    async def stored_samples(self, seqs: list) -> list[tuple]:
        """The stored samples ``seqs`` as token ids: (prompt, completion) or (prompt,
        chosen, rejected), as training takes them."""
        return [tuple(list(part) for part in s.ids()) for s in self.store.get(seqs)]

    async def add_samples(self, samples: list, train: bool = False) -> dict:
        """Persist training samples (fsynced) before acknowledging them: (prompt,
        completion) token ids, or preference pairs (prompt, chosen, rejected). With ``train``
        (the HTTP front), every full micro-batch of pending samples becomes a training task."""
        seqs = self.store.append([tuple(x) for x in samples])   # (prompt, completion) or pairs
        if train:
            self.auto_train = True
            if self.ready.is_set():
                self._pump_training()
            else:                      # a restarted controller: pumped once its workers are back
                self._wake()
        return {"ids": seqs, "stored": len(self.store)}

    def _pump_training(self, flush: bool = False) -> None:
        """Samples that came over HTTP: full micro-batches of pending samples become training
        tasks, at most ``lora.queued_tasks`` per node outstanding (more follow as they finish).
        A partial micro-batch is trained as it is once it waited ``lora.flush_after_s``
        (``flush``), so no acknowledged sample waits for ever for others to fill its batch."""
        limit = self.config.lora.queued_tasks * (self.config.nodes - len(self.dead))
        micro = self.config.lora.micro_batch
        while self.backlog and len(self.train_tasks) < limit:      # resumed samples first
            batch, self.backlog = self.backlog[:micro], self.backlog[micro:]
            self._submit_samples(self.store.get(batch))
        if not self.auto_train:
            return
        while len(self.train_tasks) < limit and (self.store.pending(self.cursor) >= micro or
                                                 (flush and self.store.pending(self.cursor) > 0)):
            samples, self.cursor = self.store.take(self.cursor, micro)
            self._submit_samples(samples)
        if 0 < self.store.pending(self.cursor) < micro and self._flush_timer is None:
            def flush() -> None:
                self._flush_timer = None
                self._pump_training(flush=True)
            self._flush_timer = asyncio.get_running_loop().call_later(self.config.lora.flush_after_s, flush)

    async def submit_training(self) -> Optional[int]:
        """Turn the next micro-batch of stored samples into a training task."""
        await self.start()
        samples, self.cursor = self.store.take(self.cursor, self.config.lora.micro_batch)
        if not samples:
            return None
        return self._submit_samples(samples)[0]

    def _submit_samples(self, samples: list) -> list[int]:
        """Stored samples become training tasks: one for the (prompt, completion) samples,
        one for the preference pairs (trained with the DPO loss), as there are."""
        tids = []
        for group in ([s for s in samples if not s.is_pair], [s for s in samples if s.is_pair]):
            if not group:
                continue
            tid = self._new_id()
            ids = [s.ids() for s in group]
            rows, _ = training_rows([clip_sample(x, self.config.lora.max_len) for x in ids])
            task = OnlineTask(tid, "train", self.driver.now(), max(len(p) + len(c) for p, c in rows), len(rows), 0)
            self.train_tasks[tid] = ids
            self.train_seqs[tid] = [s.seq for s in group]
            self.tasks[tid] = task
            self.arrived += 1
            self.driver.submit(task)
            tids.append(tid)
        return tids

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
        for _ in range(1000):   # the stages take the last releases
            if not any(self.inflight) and all(q.empty() for q in self.queues.values()):
                break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("use_policy: work is still in flight")
        cfg = self.config
        self.config = cfg.model_copy(update={"policy": name})
        self.policy = make_online_policy(name, cfg.lemix, nodes=cfg.nodes, train_rate=cfg.train_rate)
        self.cluster = Cluster(self.policy, self.cluster.learner.current, cfg.nodes, cfg.lemix)
        self.cluster.scheduler.down = set(self.dead)  # a node down for good stays down
        self.busy_s, self.busy_seen = {}, 0          # busy fractions count the new cluster's ops
        self.driver = self._driver()
        self.tasks = {}
        self.hops = 0
        if self.node_loops:
            self._adopt_on_nodes()
