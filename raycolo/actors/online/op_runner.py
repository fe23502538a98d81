"""The op runner: an op the :class:`~raycolo.online.driver.ClusterDriver` starts becomes a
typed payload on its stage's queue (``run``); the stage worker pulls it (``next_op``) and
reports (``op_done``); tokens go to their requests by the stop rules of
:mod:`raycolo.generation`, and a training op's end to the ledger. Out-of-band payloads run
with the node's scheduled ops held back (``paused``).

A role of the online controller (``ctl.<role>``, see :mod:`.state`)."""
from __future__ import annotations

import asyncio
import time
from typing import Optional

import ray

from raycolo.generation import FinishReason
from raycolo.online.stages.stage_ops import DropActivations, ReleaseKV, StageResult, StageWork
from raycolo.online.scheduling.node_commands import OutOfBand
from raycolo.online.serving.token_wire import token_events
from raycolo.online.driver import OpLost
from raycolo.online.scheduling.node_types import Op, OpKind
from raycolo.online.scheduling.node_events import OpResult
from raycolo.online.stage_messages import TrainingShare, stage_message, take_token, training_share

from raycolo.actors.online.state import LiveRequest


class OpRunner:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        cfg = self.ctl.config
        # (node, stage) -> seqs of its sends that their receivers consumed: told to it with
        # its next op, so it lets go of them (gloo's isend reports completion only to wait())
        self.received: dict[tuple[int, int], list[int]] = {}
        self.background: set[asyncio.Task] = set()   # checkpoints under way
        self.losses: list[tuple[float, int, float]] = []    # (time, task, loss)
        self.waiting: dict[tuple[int, int, int], asyncio.Future] = {}
        self.trained_steps = [0] * cfg.nodes
        self.inflight = [0] * cfg.nodes
        self.last_trained_node = 0
        self.adapter_changed_s = time.time()          # the served adapter last changed

    def fail_waiting(self, node: int, reason: str) -> None:
        """Node ``node`` is lost: every op of it this actor waits for fails with OpLost."""
        for key in [k for k in self.waiting if k[0] == node]:
            future = self.waiting.pop(key)
            if not future.done():
                future.set_exception(OpLost(reason))

    def in_background(self, task: asyncio.Task) -> None:
        """A checkpoint under way: drain() waits for it."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def forget_received(self, node: int) -> None:
        """Node ``node``'s stages start over: what their receivers consumed is moot."""
        for s in range(self.ctl.config.stages):
            self.received.pop((node, s), None)

    @ray.method(enable_task_events=False)   # per op and stage: kept out of the GCS's task-event store
    async def next_op(self, node: int, stage: int, epoch: int,
                      done: Optional[StageResult] = None) -> Optional[StageWork]:
        """The stage's next op; None tells a worker of an old group to stop. ``done``: the
        result of the op the worker just ran, reported in the same call (one actor call
        per op rather than two)."""
        self.ctl.reports.hop()
        if done is not None:
            self._op_done(node, stage, epoch, done)
        if epoch != self.ctl.workers.epochs[node]:
            return None
        return await self.ctl.workers.queues[(node, stage)].get()

    @ray.method(enable_task_events=False)   # per op and stage: kept out of the GCS's task-event store
    async def op_done(self, node: int, stage: int, epoch: int, result: StageResult) -> None:
        self.ctl.reports.hop()
        self._op_done(node, stage, epoch, result)

    def _op_done(self, node: int, stage: int, epoch: int, result: StageResult) -> None:
        if epoch != self.ctl.workers.epochs[node]:
            return           # an op of a worker group that is gone: its node was reset
        self.ctl.reports.note_readings(node, stage, result.device, result.sends)
        future = self.waiting.pop((node, stage, result.seq), None)
        if future is not None and not future.done():
            future.set_result(result)

    async def op_failed(self, node: int, stage: int, epoch: int, seq: int, error: str) -> None:
        """An op raised on its stage (the worker then exits and Ray Train restarts the
        group, up to ``max_failures``): the node is reset now rather than at the new
        group's registration, and its work is placed again."""
        self.ctl.note_error(f"node-{node}/stage-{stage} op {seq}: {error}")
        if epoch == self.ctl.workers.epochs[node]:
            self.ctl.workers.node_lost(node, f"node-{node}/stage-{stage} op {seq} failed: {error}")

    async def run(self, op: Op):
        if op.kind == OpKind.SYNC:   # every stage of a serving node waits for the exported adapter
            await self.ctl.adapters.export_for_sync(op.version)
        await self.ctl.gates[op.node].wait()
        if op.generation != self.ctl.cluster.nodes[op.node].generation:
            raise OpLost("its node was reset")
        payload = self._payload(op)
        future = asyncio.get_running_loop().create_future()
        self.waiting[(op.node, op.stage, op.seq)] = future
        self.inflight[op.node] += 1
        try:
            self.ctl.workers.queues[(op.node, op.stage)].put_nowait(payload)
            result = await future
        except OpLost:
            raise            # its requests were placed again
        except Exception as exc:
            self._fail_requests(op, f"node-{op.node}/stage-{op.stage}: {exc}")
            raise
        finally:
            self.inflight[op.node] -= 1
        if op.generation != self.ctl.cluster.nodes[op.node].generation:
            raise OpLost("its node was reset as it finished")
        if op.after is not None:      # this op received what its neighbour sent
            sender = op.stage + 1 if op.kind == OpKind.TRAIN_B else op.stage - 1
            self.received.setdefault((op.node, sender), []).append(op.after)
        return self._absorb_result(op, result)

    def _fail_requests(self, op: Op, why: str) -> None:
        """The requests ``op`` carried get a clear error in their streams."""
        if op.kind in (OpKind.PREFILL, OpKind.DECODE):
            for r in op.tasks:
                req = self.ctl.desk.requests.get(r.task_id)
                if req is not None and req.finish_reason is None:
                    req.fail(why)

    def _payload(self, op: Op) -> StageWork:
        return stage_message(op, self.ctl.config.stages, self.ctl.desk.requests, self._samples_of,
                             lambda v: str(self.ctl.adapters.version_dir(v)), lambda v: str(self.ctl.adapter_dir / f"v{v}"),
                             self.ctl.config.lora.dpo_beta, self.received.pop((op.node, op.stage), ()))

    def _samples_of(self, op: Op) -> TrainingShare:
        """A training op's task: its root task id, its samples and its share of the root's loss."""
        return training_share(op, self.ctl.cluster.nodes[op.node].micro, self.ctl.pump.train_tasks.__getitem__,
                              self.ctl.config.lora.max_len)

    def run_failed(self, exc: BaseException) -> None:
        """An op failed and the driver stopped: no request may wait for ever, so every one
        still running ends with the error in its stream."""
        why = f"the run stopped: {exc!r}"
        self.ctl.note_error(why)
        for req in self.ctl.desk.requests.values():
            if req.finish_reason is None:
                req.fail(why)

    def training_aborted(self, aborted: list) -> None:
        """SIRIUS took memory back from training micro-batches: every stage of their node
        drops their activations now (they run again from their first forward)."""
        for node, task_id in aborted:
            for s in range(self.ctl.config.stages):
                self.ctl.workers.queues[(node, s)].put_nowait(DropActivations(seq=-1, tasks=(task_id,)))

    def _absorb_result(self, op: Op, result: StageResult) -> OpResult:
        if op.kind in (OpKind.PREFILL, OpKind.DECODE) and op.stage == self.ctl.config.stages - 1:
            finished = set()
            logprobs = result.logprobs or [None] * len(op.tasks)
            prompts = result.prompt_logprobs or [None] * len(op.tasks)
            for r, token, logprob, prompt in zip(op.tasks, result.tokens, logprobs, prompts):
                req = self.ctl.desk.requests[r.task_id]
                kept, reason = take_token(req, token)     # raycolo.generation's stop rules
                if self.deliver(req, token, kept, reason, logprob, prompt):
                    finished.add(r.task_id)
                    for s in range(self.ctl.config.stages):
                        self.ctl.workers.queues[(op.node, s)].put_nowait(ReleaseKV(seq=-1, requests=(r.task_id,)))
            return OpResult(frozenset(finished))
        return self.training_done(op, result.loss)

    @staticmethod
    def deliver(req: LiveRequest, token: int, kept: bool, reason: Optional[FinishReason], logprob,
                prompt: Optional[list] = None) -> bool:
        """A token the request got (``kept``: it is the request's; ``reason``: it ended it;
        ``prompt``: its prompt's log-probabilities, with its first token) goes to its
        stream, unless its node sent it to the request's HTTP replica itself
        (``req.front``); returns whether the request ended."""
        if req.front is None:
            for event in token_events(token, kept, reason, logprob, prompt):
                req.events.put_nowait(event)
        if reason:
            req.finish_reason = reason
        return bool(reason)

    def training_done(self, op: Op, loss: Optional[float]) -> OpResult:
        """A training op ended (before its node's scheduler takes it in): a last-stage
        forward's loss; a backward reaching stage 0 that takes the optimizer step."""
        if op.kind == OpKind.TRAIN_F and op.stage == self.ctl.config.stages - 1:   # the node's stage rule takes the loss
            self.losses.append((time.time(), op.tasks[0].task_id, loss))
            return OpResult(loss=loss)
        if op.kind == OpKind.TRAIN_B and op.stage == 0:
            if not op.step:           # a micro-batch of a task whose last one is still to come
                return OpResult()
            root = self._samples_of(op).root
            self.ctl.ledger.train(op.node, self.ctl.pump.trained(root))
            self.last_trained_node = op.node
            self.trained_steps[op.node] += 1
            self.adapter_changed_s = time.time()
            if self.ctl.pump.auto_train or self.ctl.pump.backlog:
                self.ctl.pump.pump_training()
            if self.trained_steps[op.node] % self.ctl.config.lora.checkpoint_every == 0:
                task = asyncio.get_running_loop().create_task(self.ctl.adapters.checkpoint(op.node))
                self.in_background(task)
        return OpResult()

    async def paused(self, node: int, payloads: list) -> list:
        """Run out-of-band payloads, one per stage, with the node's scheduled ops held back
        and none in flight (so no stage waits on a neighbour busy with something else).
        ``payloads`` may be a function, called once nothing is in flight."""
        gate = self.ctl.gates[node]
        while not gate.is_set():
            await asyncio.sleep(0.001)
        gate.clear()
        try:
            if self.ctl.links.node_loops:         # the node's loop holds its ops back itself
                await self.ctl.links.pause_node(node)
            while self.inflight[node] > 0:
                await asyncio.sleep(0.001)
            if callable(payloads):
                payloads = payloads()
            futures = []
            for s, payload in enumerate(payloads):
                fut = asyncio.get_running_loop().create_future()
                self.waiting[(node, s, payload.seq)] = fut
                futures.append(fut)
            if self.ctl.links.node_loops:
                self.ctl.links.send(node, OutOfBand(list(payloads)))
            else:
                for s, payload in enumerate(payloads):
                    self.ctl.workers.queues[(node, s)].put_nowait(payload)
            return await asyncio.gather(*futures)
        finally:
            gate.set()
