"""The controller's side of node loops (``stage.data_plane: node``): a role of the online
controller.

Each node's scheduler runs in its first stage's process
(:mod:`raycolo.actors.online.node_worker`); the controller's cluster keeps a mirror of it
(:class:`~raycolo.online.driver.ClusterDriver` with a link). The controller

* hands each node its commands (:mod:`raycolo.online.scheduling.node_commands`): the node's stage 0
  waits for them with :meth:`NodeLinks.node_commands`, one long-poll at a time, off its
  data path;
* takes each node's reports (:meth:`NodeLinks.node_report`), sent as the node goes, at
  most one under way per node: their tokens go to the requests' streams and their events
  to the node's mirror, which checks it does what the node did; and
* runs out-of-band work (checkpoints, adapter reads, evaluations) by pausing the node
  (:meth:`NodeLinks.pause_node`, then an ``OutOfBand`` command).

No actor call per op: a decode iteration costs the controller at most one report, and
under load one report carries several iterations.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import fields
from typing import Optional

from raycolo.generation import FinishReason
from raycolo.online.driver import OpLost
from raycolo.online.scheduling.node_commands import Adopt, Cancel, NodeSetup, Pause, Serve, Sync, Train
from raycolo.online.scheduling.node_events import Dispatched, NodeEvent, OpDone, Synced
from raycolo.online.scheduling.node_loop import NodeReport
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.scheduling.node_types import OpKind


COMMAND_POLL_S = 1.0        # a node's wait for commands returns empty after this long


class NodeLinks:
    """The role ``ctl.links`` of OnlineController (see the module docstring)."""

    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        nodes = self.ctl.config.nodes
        self.inbox: list[list] = [[] for _ in range(nodes)]            # node -> commands not yet taken
        self.inbox_ready = [asyncio.Event() for _ in range(nodes)]
        self.pauses: dict[tuple[int, int], asyncio.Future] = {}        # (node, token) -> paused
        self.pause_tokens = 0
        self.eras = [0] * nodes                                         # schedulers the nodes were given (Adopt)
        self.stopping = False

    @property
    def node_loops(self) -> bool:
        return self.ctl.config.stage.data_plane == "node"

    # -- the node's calls --------------------------------------------------------------------
    async def node_setup(self, node: int, epoch: int) -> Optional[NodeSetup]:
        """What node ``node``'s loop starts from (None: its group is stale)."""
        if epoch != self.ctl.workers.epochs[node] or self.stopping:
            return None
        return self._setup(node)

    def _setup(self, node: int) -> NodeSetup:
        return NodeSetup(self.ctl.cluster.nodes[node], time.time() - self.ctl.driver.now(), self.ctl.config.lora.dpo_beta,
                         self.ctl.config.lora.max_len, str(self.ctl.adapter_dir), self.eras[node])

    async def node_commands(self, node: int, epoch: int) -> Optional[list]:
        """Node ``node``'s next commands, once there are some (empty after
        ``COMMAND_POLL_S``); None: stop (the deployment stops, or the group is stale)."""
        self.ctl.reports.hop()
        ready = self.inbox_ready[node]
        if epoch == self.ctl.workers.epochs[node] and not self.stopping and not self.inbox[node]:
            try:
                await asyncio.wait_for(ready.wait(), COMMAND_POLL_S)
            except asyncio.TimeoutError:
                pass
        if epoch != self.ctl.workers.epochs[node] or self.stopping:
            return None
        out, self.inbox[node] = self.inbox[node], []
        ready.clear()
        return out

    async def node_report(self, node: int, epoch: int, report: NodeReport) -> Optional[str]:
        """What node ``node``'s loop did since its last report (in order: each node sends
        its next report once this one returned). Returns why the node's group must start
        over (its loop and the mirror parted), else None."""
        self.ctl.reports.hop()
        if epoch != self.ctl.workers.epochs[node] or report.era != self.eras[node]:
            return None               # a group that is gone, or a scheduler replaced since
        for stage in report.devices.keys() | report.sends.keys():
            self.ctl.reports.note_readings(node, stage, report.devices.get(stage), report.sends.get(stage))
        for out in report.tokens:
            req = self.ctl.desk.requests.get(out.task_id)
            if req is None or req.finish_reason is not None:
                continue
            if out.kept:
                req.generated.append(out.token)
            self.ctl.runner.deliver(req, out.token, out.kept, out.finish_reason, out.logprob, out.prompt_logprobs)
        mirror = self.ctl.cluster.nodes[node]
        try:
            for event, keys in report.events:
                if type(event) is OpDone:     # the controller's share of a training op, as live
                    op = mirror.stages[event.stage].busy
                    if op is not None and op.seq == event.seq and op.kind in (OpKind.TRAIN_F, OpKind.TRAIN_B):
                        self.ctl.runner.training_done(op, event.loss)
                self.ctl.driver.absorb(node, event, keys)
        except Exception as exc:      # out of step: the node's group starts over from its mirror
            why = f"node {node}'s loop and its mirror parted: {exc!r}"
            self.ctl.note_error(why)
            return why
        if report.paused is not None:
            future = self.pauses.pop((node, report.paused), None)
            if future is not None and not future.done():
                future.set_result(None)
        return None

    # -- the controller's side ---------------------------------------------------------------
    def send(self, node: int, command) -> None:
        self.inbox[node].append(command)
        self.inbox_ready[node].set()

    def command(self, n: int, event: NodeEvent) -> None:
        """The driver's link (raycolo.online.driver.NodeLink): what the cluster wants of node ``n``."""
        if type(event) is Synced:     # once the training group's weights are exported
            task = asyncio.get_running_loop().create_task(self._sync_node(n, event.version))
            self.ctl.runner.in_background(task)
            return
        if type(event) is not Dispatched:
            raise TypeError(f"no command for {event!r}")
        task = event.task
        if task.is_train:
            self.send(n, Train(task, self.ctl.pump.train_tasks[task.task_id]))
            return
        req = self.ctl.desk.requests[task.task_id]
        served = ServedRequest(**{f.name: getattr(req, f.name) for f in fields(ServedRequest)})
        served.task, served.generated = task, list(req.generated)
        pinned = None if req.version is None else str(self.ctl.adapters.version_dir(req.version))
        self.send(n, Serve(served, pinned))

    async def _sync_node(self, n: int, version: int) -> None:
        await self.ctl.adapters.export_for_sync(version)
        self.send(n, Sync(version))

    def cancel_on_nodes(self, rid: int, reason: FinishReason) -> None:
        for n in range(self.ctl.config.nodes):
            self.send(n, Cancel(rid, reason))

    def adopt_on_nodes(self) -> None:
        """A new cluster (use_policy): every node's loop schedules with its new mirror."""
        for n in range(self.ctl.config.nodes):
            self.eras[n] += 1
            self.send(n, Adopt(self._setup(n)))

    def links_lost(self, node: int, reason: str) -> None:
        """Node ``node``'s group is gone: its commands not yet taken go with it, a pause
        under way fails, and its old stage 0 (waiting for commands) hears it."""
        self.inbox[node] = []
        self.inbox_ready[node].set()
        self.inbox_ready[node] = asyncio.Event()
        for key in [k for k in self.pauses if k[0] == node]:
            future = self.pauses.pop(key)
            if not future.done():
                future.set_exception(OpLost(reason))

    def stop(self) -> None:
        self.stopping = True
        for ready in self.inbox_ready:
            ready.set()

    async def pause_node(self, node: int) -> None:
        """Pause node ``node``'s loop; returns once it said nothing is in flight (and its
        report brought the controller up to date). ``OutOfBand`` work then resumes it."""
        self.pause_tokens += 1
        paused = asyncio.get_running_loop().create_future()
        self.pauses[(node, self.pause_tokens)] = paused
        self.send(node, Pause(self.pause_tokens))
        await paused
