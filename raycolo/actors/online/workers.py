"""The worker groups: each node is one Ray Train ``TorchTrainer`` of S stage workers, fitted
in a thread of the controller. Their start, registration (``register``), loss and
restart (a new epoch), checkpoint restore and replay of lost training, and the
placement of what runs where.

A role of the online controller (``ctl.<role>``, see :mod:`.state`)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import ray

from raycolo.errors import ConfigError
from raycolo.online.samples import Cursor, from_ranges, plan_resumption
from raycolo.online.stages.checkpoints import newest_committed
from raycolo.online.stage_messages import WorkerInfo


START_TIMEOUT_S = 300.0    # stage workers must register within this


class WorkerGroups:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        cfg = self.ctl.config
        self.host = None                                     # the GroupHost fitting the trainers
        self.host_runs: Optional[list[str]] = None           # its run names, when it outlived a controller
        self.restarts: list[dict] = []                       # node, reason, time, lost, replayed
        self.queues = {(n, s): asyncio.Queue() for n in range(cfg.nodes) for s in range(cfg.stages)}
        self.by_name: dict[str, dict] = {}
        # the nodes' worker-group generations; they count from this controller's first id, so a
        # message from a group of the controller before a crash never matches a current one
        self.epochs = [ctl.first_id] * cfg.nodes
        self.registered = [set() for _ in range(cfg.nodes)]
        self.dead: dict[int, str] = {}                       # node -> why its worker group is gone
        self._starting: Optional[asyncio.Task] = None      # the launch of the stage workers
        self._partial: Optional[asyncio.TimerHandle] = None  # serve with the nodes there are (_serve_partial)
        self.restored: dict[int, tuple] = {}          # node -> (version, seqs held, cursor) of an earlier run
        self.resumption: Optional[dict] = None        # what this deployment took up from an earlier one
        # when this controller's start got where (time.time()): start_timeline()
        self.timeline: dict[str, float] = {"constructed_s": time.time()}

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """Start the stage workers and wait until they registered. Idempotent: a second
        caller (another HTTP replica, a restarted one) waits for the same start. Requests
        and samples start it too: a controller Ray restarted after a crash starts again on
        its first call, resuming from the checkpoints and the sample store. A launch that
        failed (no GPUs for even one node) is tried again by the next call."""
        self.wake()
        await asyncio.shield(self._starting)
        try:
            await asyncio.wait_for(asyncio.shield(self.ctl.ready.wait()), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"stage workers did not register within {timeout_s:.0f} s "
                               f"({sum(len(r) for r in self.registered)} of "
                               f"{self.ctl.config.nodes * self.ctl.config.stages}): {self.ctl.errors}") from None
        return {"workers": sorted(self.by_name), "layer_bounds": self.ctl.bounds}

    def wake(self) -> None:
        """Launch the stage workers (in the background) unless that is done or under way."""
        task = self._starting
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            self._starting = asyncio.get_running_loop().create_task(self._launch())

    async def _launch(self) -> None:
        """Start every node's worker group. A first start needs a GPU per stage worker. A
        controller Ray restarted (its Ray node died with the GPUs there) starts with one
        node's worth: the nodes that fit register and serve after ``stage.start_grace_s``;
        Ray Train keeps trying to place the others, which join when GPUs come back."""
        need = self.ctl.config.nodes * self.ctl.config.gpus_per_node()
        gpus = ray.cluster_resources().get("GPU", 0)
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if gpus < (self.ctl.config.gpus_per_node() if restarted else need) - 1e-9:
            raise ConfigError(f"nodes x stages: the deployment needs {need:g} GPUs ({self.ctl.config.stage.gpus_per_worker:g} "
                              f"per stage worker); the Ray cluster has {gpus:g}. On a CPU machine give the "
                              f"cluster logical GPUs: ray start --head --num-gpus={self.ctl.config.gpus_needed()}")
        if gpus < need - 1e-9:
            self.ctl.note_error(f"restarted with {gpus:g} of the {need:g} GPUs the deployment needs: "
                               f"the nodes that fit serve; the others join when GPUs come back")
        self._loop = asyncio.get_running_loop()
        self.timeline["launch_s"] = time.time()
        self.ctl.warm_up()       # while the stage workers start, not once the first requests come
        self.host = self._host()
        running = await self.host.fitting.remote()
        if running:       # the groups outlived the controller before this one: they register again
            self.host_runs = await self.host.run_names.remote()
            self.timeline["groups_found_s"] = time.time()
            self.ctl.note_error(f"restarted: the worker groups of nodes {running} outlived the controller "
                                f"and register again")
        else:
            await asyncio.to_thread(self.ctl.groups.release)   # of an earlier controller of this deployment
            self.timeline["groups_released_s"] = time.time()
        self.ctl.start_driver()
        for n in range(self.ctl.config.nodes):
            if n not in running:
                await self.host.fit.remote(n)
        self.timeline["trainers_started_s"] = time.time()

    def _serve_partial(self) -> None:
        """``stage.start_grace_s`` after the first node registered: serve with the nodes
        there are; the others are avoided until their groups register (``register``)."""
        if self.ctl.ready.is_set():
            return
        for n in range(self.ctl.config.nodes):
            if len(self.registered[n]) < self.ctl.config.stages:
                if self.ctl.config.resume and n not in self.restored:   # what its group will restore
                    committed = self._committed_checkpoint(n)
                    if committed is not None:
                        self.restored[n] = committed
                self.ctl.driver.node_lost(n)
                self.ctl.note_error(f"node {n}: not registered {self.ctl.config.stage.start_grace_s:g} s after "
                                   f"the first node; serving without it until it does")
        self._resume()
        self.ctl.ready.set()

    def _committed_checkpoint(self, n: int) -> Optional[tuple]:
        """(adapter version, seqs held, cursor) of node ``n``'s newest committed checkpoint
        (:func:`~raycolo.online.stages.checkpoints.newest_committed`): what its group
        restores when it starts. A node not yet back still holds those samples, so they are
        not trained again elsewhere; None without one."""
        found = newest_committed(str(Path(self.ctl.config.storage_path).resolve() / self.run_name(n)))
        if found is None:
            return None
        return found.version, from_ranges(found.held), Cursor(**found.cursor) if found.cursor else Cursor()

    def run_name(self, n: int) -> str:
        """Node ``n``'s Ray Train run: fixed per storage path and adapter shape when the
        deployment resumes (a new run of the same name restores its newest checkpoint);
        the host's, when the groups outlived an earlier controller."""
        if self.host_runs is not None:
            return self.host_runs[n]
        if self.ctl.config.resume:
            return f"raycolo-{self.ctl.config.adapter_fingerprint()}-node{n}"
        return f"raycolo-node{n}-{self.ctl.run_token}"

    def _host(self):
        """The host of this deployment's worker groups (:mod:`.group_host`): the one an
        earlier controller left (its groups still run), or a new one."""
        from raycolo.actors.online.group_host import GroupHost, host_name

        cfg = self.ctl.config
        detached = self.ctl.links.node_loops     # stage.data_plane: node
        if detached:
            try:
                return ray.get_actor(host_name(self.ctl.name), namespace=self.ctl.namespace)
            except ValueError:
                pass
        options = {"name": host_name(self.ctl.name), "namespace": self.ctl.namespace,
                   "lifetime": "detached"} if detached else {}
        return GroupHost.options(**options).remote(
            cfg.model_dump(), self.ctl.name, self.ctl.namespace, self.ctl.bounds,
            [self.run_name(n) for n in range(cfg.nodes)], str(self.ctl.groups.path), detached)

    def run_ended(self, node: int, why: str, again: bool) -> None:
        """The host says node ``node``'s run ended with ``why``: its own Ray Train
        controller died and a new run of the same name starts (``again``), or the group
        failed past its restarts."""
        self.ctl.note_error(why)
        if again:
            self.node_lost(node, f"node {node}: its Ray Train controller died")
        else:
            self._node_dead(node, why)

    def _node_dead(self, node: int, why: str) -> None:
        """The node's group failed past its restarts: nothing is placed there any more and
        its work moves to the other nodes; with none left, requests get an error event."""
        self.dead[node] = why
        self.node_lost(node, why, down=True)

    async def incarnation(self) -> int:
        """This controller's incarnation: another after Ray restarted it (a stage worker that
        outlived the one before registers again when it sees a new one). The nodes and
        replicas that lost the controller ask this first: a restarted one starts at once."""
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.wake()
        return self.ctl.first_id

    async def register(self, node: int, stage: int, info: WorkerInfo) -> int:
        """A stage worker starts, or its group outlived the controller before this one
        (``info.rejoined``); returns its epoch (the node's worker-group generation). A
        stage registering twice means Ray Train restarted the node's group."""
        self.wake()                    # a rejoining worker's call may be this controller's first
        await asyncio.shield(self._starting)
        if stage in self.registered[node]:
            self.node_lost(node, f"node-{node}/stage-{stage} registered again (worker group restarted)")
        key = f"node-{node}/stage-{stage}"
        self.by_name[key] = dict(asdict(info), node=node, stage=stage, epoch=self.epochs[node],
                                 registered_s=time.time())
        if stage == 0:
            self.ctl.groups.note(node, info.placement_group)
        if stage == 0 and not self.ctl.ready.is_set() and self.ctl.config.resume and info.restored_version:
            self.restored[node] = (info.restored_version, from_ranges(info.restored_held or []),
                                   Cursor(**info.restored_cursor) if info.restored_cursor else Cursor())
        self.registered[node].add(stage)
        complete = len(self.registered[node]) == self.ctl.config.stages
        if complete and self.ctl.driver is not None:
            self.ctl.driver.node_back(node)    # a restarted node takes work again (no-op otherwise)
        if complete and self.ctl.ledger.restoring(node):
            for r in self.restarts:      # the node's new group is complete: it serves again
                if r["node"] == node and r["epoch"] == self.epochs[node]:
                    r["back_s"] = self.ctl.driver.now()
            # train again what the restored checkpoint does not hold
            self._retrain(node, self.ctl.ledger.restore(node, self.by_name[f"node-{node}/stage-0"].get("restored_version")))
        if all(len(r) == self.ctl.config.stages for r in self.registered) and not self.ctl.ready.is_set():
            self._resume()
            self.ctl.ready.set()
            self.timeline["ready_s"] = time.time()
        elif complete and not self.ctl.ready.is_set() and self._partial is None:
            self._partial = self._loop.call_later(self.ctl.config.stage.start_grace_s, self._serve_partial)
        return self.epochs[node]

    def _resume(self) -> None:
        """Every node registered for the first time: take up an earlier deployment's
        training (its checkpoints, restored by the nodes, and the samples stored since: fed
        in ``lora.queued_tasks`` per node at a time), then the samples that arrived while
        the workers started."""
        if self.ctl.config.resume:
            plan = plan_resumption(self.restored, len(self.ctl.pump.store))
            for node, (version, seqs, _) in self.restored.items():
                self.ctl.ledger.resume(node, version, seqs)
            self.ctl.adapters.resume_version(plan.adapter_version)
            self.resumption = {"adapter_version": plan.adapter_version, "samples_held": plan.held,
                               "samples_resumed": len(plan.pending),
                               "nodes_restored": sorted(self.restored)}
            self.ctl.pump.resume_samples(plan.cursor, plan.pending)
        self.ctl.pump.pump_training()

    async def group_failed(self, node: int, at: float, why: str) -> None:
        """Ray Train found node ``node``'s worker group failed at ``at`` (wall clock; told
        by :class:`~raycolo.actors.online.group_watch.GroupWatch` before the restart): the node is
        reset now and avoided until its new group is complete, rather than found out when
        the new group registers. Ignored if the loss is known already (an op that raised
        told us first) or a new group registered since."""
        if self.ctl.driver is None or node in self.dead:
            return
        if not self.registered[node] and node in self.ctl.cluster.scheduler.restarting:
            return                          # already reset, the new group not yet here
        if any(w["node"] == node and w["epoch"] == self.epochs[node] and w["registered_s"] > at
               for w in self.by_name.values()):
            return                          # a new group registered after the failure
        self.node_lost(node, why)

    def node_lost(self, node: int, reason: str, down: bool = False) -> None:
        """Node ``node``'s worker group is gone (its KV caches, activations, queued ops)
        and its adapter rolls back to its last checkpoint: a new epoch starts, its ops in
        flight are dropped, its requests resume (prompt + streamed tokens, re-prefilled),
        its training tasks start over, and the samples it trained since the checkpoint
        are trained again."""
        self.epochs[node] += 1
        self.registered[node] = set()
        for s in range(self.ctl.config.stages):    # an old worker still waiting for an op stops
            self.queues[(node, s)].put_nowait(None)
            self.queues[(node, s)] = asyncio.Queue()
        self.ctl.runner.forget_received(node)
        self.ctl.links.links_lost(node, reason)
        resumed = self.ctl.cluster.resumed
        if down:
            self.ctl.driver.node_down(node)
        else:
            self.ctl.driver.node_lost(node)
        self.ctl.runner.fail_waiting(node, reason)
        self.ctl.ledger.lose(node)
        self.restarts.append({"node": node, "reason": reason, "time_s": self.ctl.driver.now(),
                              "epoch": self.epochs[node], "resumed_tasks": self.ctl.cluster.resumed - resumed,
                              "replayed_samples": None, "adapter_version": self.ctl.ledger.version[node],
                              "down": down})
        if down:                   # trained again on the other nodes
            self._retrain(node, self.ctl.ledger.abandon(node))
        else:   # replayed once the new group says which checkpoint it restored (register),
            # or on the other nodes if it is not back in time (its Ray node may be gone)
            self._loop.call_later(self.ctl.config.stage.rejoin_s, self._rejoin_overdue, node, self.epochs[node])

    def _rejoin_overdue(self, node: int, epoch: int) -> None:
        """Node ``node``'s group lost at ``epoch`` is not back after ``stage.rejoin_s``: the
        samples it trained since its last checkpoint are trained on the other nodes (its
        adapter, when it comes back, is that checkpoint's)."""
        if self.epochs[node] != epoch or len(self.registered[node]) == self.ctl.config.stages \
                or not self.ctl.ledger.restoring(node):
            return
        seqs = self.ctl.ledger.abandon(node)
        self.ctl.note_error(f"node {node}: not back {self.ctl.config.stage.rejoin_s:g} s after its loss; "
                           f"{len(seqs)} samples it trained since its checkpoint go to the other nodes")
        self._retrain(node, seqs)

    def _retrain(self, node: int, seqs: list) -> None:
        for r in reversed(self.restarts):
            if r["node"] == node:
                r["replayed_samples"] = len(seqs)
                break
        for i in range(0, len(seqs), self.ctl.config.lora.micro_batch):
            self.ctl.pump.submit_samples(self.ctl.pump.store.get(seqs[i:i + self.ctl.config.lora.micro_batch]))

    def start_timeline(self) -> dict:
        """Where this controller's start went, in seconds after it was constructed (a
        restarted one: after Ray restarted it): its first call launching the worker groups,
        the earlier placement groups released, the trainers started, each stage worker's
        process start, model build, checkpoint restore and registration, and ready."""
        t0 = self.timeline["constructed_s"]
        out = {k[:-2]: round(v - t0, 3) for k, v in self.timeline.items() if k != "constructed_s"}
        out["constructed_at_s"] = t0            # wall clock (time.time())
        out["workers"] = {key: {k[:-2]: round(v - t0, 3) for k, v in {**(w.get("started") or {}),
                                                                      "registered_s": w["registered_s"]}.items()
                                if v is not None}
                          for key, w in sorted(self.by_name.items())}
        return out

    def registry(self) -> dict:
        return dict(self.by_name)

    def placement(self) -> dict:
        """Which Ray node runs what: this controller, and each stage worker (by Ray node id)."""
        return {"controller": ray.get_runtime_context().get_node_id(),
                "stage_workers": {key: w["node_id"] for key, w in self.by_name.items()}}
