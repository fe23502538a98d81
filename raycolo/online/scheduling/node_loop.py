"""A node's loop: its scheduler next to its stages, and the report its mirror replays.

The live runtime's data plane. A :class:`NodeLoop` owns one node's
:class:`~raycolo.online.scheduling.node.NodeScheduler` and what the node serves (its requests'
prompts, tokens and sampling settings; its training tasks' samples). It takes the tasks
the cluster sends it, the results its stages answer and the time, and produces:

* the typed messages its stages run (:mod:`raycolo.online.stages.stage_ops`), built by the
  same rule as the controller's (:mod:`raycolo.online.stage_messages`);
* the timers it must wake up for;
* a :class:`NodeReport`: every event it applied, in order and with its times
  (:mod:`raycolo.online.scheduling.node_events`), and every token its requests got. A mirror of the
  node (the cluster's ``NodeScheduler`` for it) that applies the report's events gives
  the same ops and timers (:func:`replay`), so the control plane keeps the cluster's state
  of record one report behind, with no call per op.

It reads no clock (each entry point takes ``now``) and runs nothing itself: an executor
(:class:`~raycolo.online.stages.node_pipeline.NodePipeline` over a node's stage processes)
does. Pure: no torch, no Ray.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional

from raycolo.online.stages.stage_ops import DropActivations, ReleaseKV, StageResult, StageWork
from raycolo.generation import FinishReason
from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.node_types import NodeStep, Op, OpKind, Timer
from raycolo.online.scheduling.node_commands import Adopt, Cancel, NodeCommand, Serve, Sync, Train
from raycolo.online.scheduling.node_events import (Dispatched, NodeEvent, Synced, TimerFired, action_key, apply, check_in_step,
                                        op_done_event)
from raycolo.online.stage_messages import ServedRequest, TrainingShare, stage_message, take_token, training_share
from raycolo.online.tasks import OnlineTask


@dataclass(frozen=True, slots=True)
class TokenOut:
    """A token the request ``task_id`` got (``kept``: it is the request's; False: the
    request was cancelled and ends without it), and why the request ended with it;
    ``position``: its index in the completion (kept or not: the tokens before it)."""

    task_id: int
    token: int
    kept: bool = True
    finish_reason: Optional[FinishReason] = None
    logprob: object = None
    position: int = 0
    prompt_logprobs: Optional[list] = None      # the prompt's, with the request's first token


@dataclass(slots=True)
class NodeReport:
    """What a node loop did since its last report: the events it applied (each with the
    action keys of the ops it started and timers it armed, so its mirror can check that
    it is in step) and the tokens its requests got."""

    node: int
    events: list = field(default_factory=list)     # (NodeEvent, [action_key, ...])
    tokens: list = field(default_factory=list)     # TokenOut
    paused: Optional[int] = None                   # the Pause it is now paused for
    devices: dict = field(default_factory=dict)    # stage -> its device's last reading
    sends: dict = field(default_factory=dict)      # stage -> (sends it holds, sends it posted)
    era: int = 0                                   # the scheduler it reports on (NodeSetup.era)

    def __bool__(self) -> bool:
        return bool(self.events or self.tokens or self.paused is not None)   # figures come with events

    def extend(self, later: "NodeReport") -> None:
        """Append ``later`` (the same node's next report, of the same era) to this one."""
        self.events += later.events
        self.tokens += later.tokens
        self.devices.update(later.devices)
        self.sends.update(later.sends)
        if later.paused is not None:
            self.paused = later.paused


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message for ``stage`` to run."""

    stage: int
    message: StageWork


class NodeLoop:
    """One node's scheduling next to its stages (see the module docstring)."""

    def __init__(self, node: NodeScheduler, dpo_beta: float, max_len: int,
                 version_dir: Optional[Callable[[object], str]] = None, sync_dir: Callable[[int], str] = str,
                 era: int = 0):
        self.node = node
        self.stages = len(node.stages)
        self.dpo_beta, self.max_len = dpo_beta, max_len
        self.pinned: dict = {}           # adapter version -> its directory (told with each Serve)
        self.version_dir = version_dir if version_dir is not None else self.pinned.__getitem__
        self.sync_dir = sync_dir
        self.requests: dict[int, ServedRequest] = {}
        self.samples: dict[int, list] = {}         # training task -> its samples
        self.running: dict[tuple[int, int], Op] = {}   # (stage, seq) -> op started there
        self.timers: list[tuple[float, int]] = []  # heap of (at_s, number)
        self.received: dict[int, list] = {}        # stage -> its sends since consumed
        self.outbox: list[Outgoing] = []
        self.era = era
        self.report = NodeReport(node.index, era=era)

    # -- inputs ----------------------------------------------------------------------------
    def serve(self, request: ServedRequest, now: float) -> None:
        """An inference request reaches the node."""
        self.requests[request.task.task_id] = request
        self._apply(Dispatched(request.task, now))

    def train(self, task: OnlineTask, samples: list, now: float) -> None:
        """A training task (its samples: (prompt, completion) or preference triples) reaches the node."""
        self.samples[task.task_id] = samples
        self._apply(Dispatched(task, now))

    def command(self, command: NodeCommand, now: float) -> None:
        """What the control plane asked of the node (:mod:`raycolo.online.scheduling.node_commands`;
        the pipeline carries out Pause and OutOfBand itself)."""
        kind = type(command)
        if kind is Serve:
            if command.pinned_dir is not None:
                self.pinned[command.request.version] = command.pinned_dir
            self.serve(command.request, now)
        elif kind is Train:
            self.train(command.task, command.samples, now)
        elif kind is Cancel:
            req = self.requests.get(command.task_id)
            if req is not None and req.cancelled is None:
                req.cancelled = command.reason
        elif kind is Sync:
            self._apply(Synced(command.version, now))
        elif kind is Adopt:
            if not self.idle:
                raise RuntimeError(f"node {self.node.index}: told to adopt a new scheduler with work in flight")
            self.take_report()       # the old scheduler's last words: its mirror is gone
            self.node, self.timers, self.era = command.setup.node, [], command.setup.era
            self.report = NodeReport(self.node.index, era=self.era)
        else:
            raise TypeError(f"not a node command: {command!r}")

    def end_requests(self, reason) -> None:
        """End every request at its next token, as :class:`Cancel` ends one (the node's
        control plane restarted: the replicas admit them again)."""
        for req in self.requests.values():
            if req.cancelled is None:
                req.cancelled = reason

    def next_timer(self) -> Optional[float]:
        """When the earliest armed timer is due (None: none armed)."""
        while self.timers and self.timers[0][1] not in self.node.armed:
            heapq.heappop(self.timers)        # void: its node was reset
        return self.timers[0][0] if self.timers else None

    def fire_due(self, now: float) -> None:
        """Fire every timer due by ``now``, earliest first."""
        while (at := self.next_timer()) is not None and at <= now:
            _, number = heapq.heappop(self.timers)
            self._apply(TimerFired(number, max(now, at)))

    def done(self, stage: int, result: StageResult, now: float) -> None:
        """``stage`` answered ``result`` for the op it ran."""
        op = self.running.pop((stage, result.seq))
        if result.device is not None:
            self.report.devices[stage] = result.device
        if result.sends is not None:
            self.report.sends[stage] = result.sends
        finished = set()
        if op.kind in (OpKind.PREFILL, OpKind.DECODE) and stage == self.stages - 1:
            logprobs = result.logprobs or [None] * len(op.tasks)
            prompts = result.prompt_logprobs or [None] * len(op.tasks)
            for r, token, logprob, prompt in zip(op.tasks, result.tokens, logprobs, prompts):
                req = self.requests[r.task_id]
                kept, reason = take_token(req, int(token))
                self.report.tokens.append(TokenOut(r.task_id, int(token), kept, reason, logprob,
                                                   len(req.generated) - kept, prompt))
                if reason:
                    req.finish_reason = reason
                    finished.add(r.task_id)
        if op.after is not None:      # this op received what its neighbour sent
            sender = op.stage + 1 if op.kind == OpKind.TRAIN_B else op.stage - 1
            self.received.setdefault(sender, []).append(op.after)
        loss = result.loss if op.kind == OpKind.TRAIN_F and stage == self.stages - 1 else None
        self._apply(op_done_event(stage, op.seq, now, finished, loss))

    def take_outbox(self) -> list[Outgoing]:
        out, self.outbox = self.outbox, []
        return out

    def take_report(self) -> NodeReport:
        out, self.report = self.report, NodeReport(self.node.index, era=self.era)
        return out

    @property
    def idle(self) -> bool:
        return not self.running and not self.node.active

    # -- internals -------------------------------------------------------------------------
    def _apply(self, event: NodeEvent) -> None:
        step = apply(self.node, event)
        self.report.events.append((event, [action_key(a) for a in step.actions]))
        self._carry_out(step)

    def _training(self, op: Op) -> TrainingShare:
        return training_share(op, self.node.micro, self.samples.__getitem__, self.max_len)

    def _carry_out(self, step: NodeStep) -> None:
        # every stage frees a finished request's KV blocks before it runs the step's new ops:
        # the scheduler may have started a prefill on the blocks that request gave back
        for r in step.finished:
            for s in range(self.stages):
                self.outbox.append(Outgoing(s, ReleaseKV(seq=-1, requests=(r.task_id,))))
        for action in step.actions:
            if type(action) is Timer:
                heapq.heappush(self.timers, (action.at_s, action.number))
                continue
            message = stage_message(action, self.stages, self.requests, self._training, self.version_dir,
                                    self.sync_dir, self.dpo_beta, self.received.pop(action.stage, ()))
            self.running[(action.stage, action.seq)] = action
            self.outbox.append(Outgoing(action.stage, message))
        for r in step.finished:
            self.requests.pop(r.task_id, None)
        for task_id in step.aborted:     # SIRIUS took memory back: the stages drop activations
            for s in range(self.stages):
                self.outbox.append(Outgoing(s, DropActivations(seq=-1, tasks=(task_id,))))
        for task in step.trained:        # its backward reached stage 0
            self.samples.pop(task.task_id, None)


def replay(mirror: NodeScheduler, report: NodeReport) -> list[NodeStep]:
    """Apply a node loop's report to the node's mirror, checking each event started the
    same ops and armed the same timers on both sides
    (:class:`~raycolo.online.scheduling.node_events.MirrorDiverged` otherwise)."""
    steps = []
    for event, keys in report.events:
        step = apply(mirror, event)
        check_in_step(report.node, event, keys, step.actions)
        steps.append(step)
    return steps
