"""A node's inputs as typed events: what lets a node loop run apart from its mirror.

A :class:`~raycolo.online.scheduling.node.NodeScheduler` changes only when one of its entry points
is called, and it is deterministic in those calls: the same events with the same times
give the same ops, timers, tokens and memory ledger. So a node's loop can run where its
stage workers are (the data plane) and log every event it applies, while the cluster
keeps a *mirror* of it (the control plane's state of record) that applies the same log
in the same order, with the node's own times, and produces the same
:class:`~raycolo.online.scheduling.node.NodeStep` s. The cluster reads the mirror (calibration,
idleness, metrics); whatever the cluster wants of a node (a task dispatched to it,
SEPARATE's weight sync) goes to the loop as a command, and the mirror applies it only
when the loop's log says it did, so both apply it at the same point.

:func:`apply` is the one way into a node by event, on either side. Ops and timers are
named by number rather than by object: ``seq`` for an op (the node numbers its ops),
``number`` for a timer (the node numbers the timers it arms, :meth:`NodeScheduler._end`).
The simulator runs a cluster both ways (``ClusterSimulator(node_loops=True)``: a node
loop per node and the cluster's mirrors, checked op for op).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Union

from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.node_types import NodeStep, Op, OpKind
from raycolo.online.tasks import OnlineTask


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A task the cluster placed reaches the node."""

    task: OnlineTask
    now: float


@dataclass(frozen=True, slots=True)
class TimerFired:
    """A timer the node armed (its ``number``) fires."""

    number: int
    now: float


@dataclass(frozen=True, slots=True)
class OpDone:
    """The op ``seq`` running on ``stage`` ended. ``finished``: requests whose token from
    it (a last-stage prefill or decode) was their last; ``loss``: a last-stage training
    forward's loss, where the executor measures one (a stage rule may rank by it)."""

    stage: int
    seq: int
    now: float
    finished: frozenset = frozenset()
    loss: Optional[float] = None


@dataclass(frozen=True, slots=True)
class Synced:
    """SEPARATE: the weights of ``version`` training tasks reach the node."""

    version: int
    now: float


NodeEvent = Union[Dispatched, TimerFired, OpDone, Synced]


@dataclass(frozen=True, slots=True)
class OpResult:
    """What an executor learns from running an op (``OpDone`` without the names)."""

    finished: frozenset = frozenset()
    loss: Optional[float] = None


def op_done_event(stage: int, seq: int, now: float, finished: Collection[int] = (),
                  loss: Optional[float] = None) -> OpDone:
    return OpDone(stage, seq, now, frozenset(finished), loss)


class MirrorDiverged(RuntimeError):
    """A node's log names an op or timer its mirror does not have: they are out of step."""


def apply(node: NodeScheduler, event: NodeEvent) -> NodeStep:
    """Apply ``event`` to ``node`` (a node loop, or the cluster's mirror of it)."""
    kind = type(event)
    if kind is OpDone:
        stage = node.stages[event.stage]
        op = stage.busy
        if op is None or op.seq != event.seq:
            raise MirrorDiverged(f"node {node.index} stage {event.stage}: op {event.seq} is not "
                                 f"running (running: {None if op is None else op.seq})")
        if op.kind == OpKind.TRAIN_F and event.stage == len(node.stages) - 1 and event.loss is not None:
            node.rule.observe_loss(op.tasks[0].task_id, event.loss)
        elif op.kind == OpKind.TRAIN_B and event.stage == 0:
            node.rule.forget(op.tasks[0].task_id)
        return node.op_done(op, event.now, event.finished)
    if kind is Dispatched:
        return node.dispatch(event.task, event.now)
    if kind is TimerFired:
        timer = node.armed.get(event.number)
        if timer is None:        # armed before the node was reset: void
            return NodeStep()
        return node.timer(timer, event.now)
    if kind is Synced:
        return node.sync(event.version, event.now)
    raise TypeError(f"not a node event: {event!r}")


def action_key(action) -> tuple:
    """What names an op or a timer across a node loop and its mirror."""
    if isinstance(action, Op):
        return ("op", action.kind, action.stage, action.seq, action.start_s)
    return ("timer", action.kind, action.number, action.at_s)


def check_in_step(node: int, event: NodeEvent, ours: list, mirror_actions: list) -> None:
    """The node loop (the action keys ``ours``) and its mirror (``mirror_actions``)
    started the same ops and armed the same timers for ``event`` (raises
    :class:`MirrorDiverged` otherwise)."""
    theirs = [action_key(a) for a in mirror_actions]
    if ours != theirs:
        raise MirrorDiverged(f"node {node}: after {event!r} the loop did {ours} and its mirror {theirs}")
