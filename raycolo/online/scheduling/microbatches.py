"""SIRIUS's elastic training micro-batches on one node (SIRIUS §4: the training batch
adapts to the memory inference leaves; gradient accumulation keeps the effective batch).

A training task of ``C`` samples normally runs as one micro-batch: a forward through the
stages, a backward back, an optimizer step on each stage. Under an elastic stage rule
(:class:`~raycolo.online.scheduling.stage_rules.SiriusRule`), a task whose first forward does not fit
the stage's memory is *split*: the largest micro-batch that fits starts now, and the rest
waits as another micro-batch of the same task (it may be split again, or run whole once
memory came back: the micro-batch "grows at its next one"). Each micro-batch is a *piece*,
a training task of its own id (negative, so it never meets a real task id) that carries a
slice of the root task's samples. Every stage accumulates the pieces' gradients and takes
its one optimizer step on the last piece's backward; the root task is trained when its
last piece's backward reaches stage 0. Pure Python, no clock.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from raycolo.online.tasks import OnlineTask, TaskKind

MAX_NODES = 4096            # piece ids encode their node, so nodes never hand out the same id


@dataclass
class Piece:
    root: int                 # the task it is a micro-batch of
    first: int                # its first sample in the root's samples
    samples: int


@dataclass
class Split:
    root: OnlineTask
    total: int                # pieces so far
    unstarted: int            # pieces whose first forward has not started
    done: list = field(default_factory=list)    # per stage: pieces whose backward ended there


class MicroBatches:
    def __init__(self, node: int, stages: int):
        if not 0 <= node < MAX_NODES:
            raise ValueError(f"micro-batches: node index {node} outside [0, {MAX_NODES})")
        self.node, self.stages = node, stages
        self.pieces: dict[int, Piece] = {}
        self.splits: dict[int, Split] = {}
        self.split_roots: set[int] = set()     # roots ever split (their pieces' timings are partial)
        self.count = 0                         # splits so far
        self._ids = itertools.count()

    def piece(self, task_id: int) -> Optional[Piece]:
        return self.pieces.get(task_id)

    def root_of(self, task: OnlineTask) -> OnlineTask:
        piece = self.pieces.get(task.task_id)
        return task if piece is None else self.splits[piece.root].root

    def split(self, task: OnlineTask, samples: int) -> tuple[OnlineTask, OnlineTask]:
        """``task`` (a root or a piece, about to start its first forward) becomes a piece of
        ``samples`` that starts now and a piece of the rest, which waits."""
        if not 0 < samples < task.batch:
            raise ValueError(f"split: {samples} samples of a micro-batch of {task.batch}")
        old = self.pieces.pop(task.task_id, None)
        root_id, first = (task.task_id, 0) if old is None else (old.root, old.first)
        state = self.splits.get(root_id)
        if state is None:
            state = self.splits[root_id] = Split(task, 1, 1, [0] * self.stages)
            self.split_roots.add(root_id)
        state.total += 1
        state.unstarted += 1
        self.count += 1
        return (self._new(root_id, first, samples, task),
                self._new(root_id, first + samples, task.batch - samples, task))

    def _new(self, root: int, first: int, samples: int, like: OnlineTask) -> OnlineTask:
        pid = -(1 + next(self._ids) * MAX_NODES + self.node)
        self.pieces[pid] = Piece(root, first, samples)
        return OnlineTask(pid, TaskKind.TRAIN, like.arrival_s, like.length, samples, 0)

    def forward_started(self, task: OnlineTask) -> None:
        """A first forward (stage 0) starts."""
        piece = self.pieces.get(task.task_id)
        if piece is not None:
            self.splits[piece.root].unstarted -= 1

    def restarted(self, task: OnlineTask) -> None:
        """A piece's work was aborted and it waits to start again from its first forward."""
        piece = self.pieces.get(task.task_id)
        if piece is not None:
            self.splits[piece.root].unstarted += 1

    def steps(self, task: OnlineTask, stage: int) -> bool:
        """Whether the backward of ``task`` now starting on ``stage`` is the task's last
        there: the stage then takes its optimizer step."""
        piece = self.pieces.get(task.task_id)
        if piece is None:
            return True
        state = self.splits[piece.root]
        return state.unstarted == 0 and state.done[stage] + 1 == state.total

    def backward_done(self, task: OnlineTask, stage: int) -> Optional[OnlineTask]:
        """A backward ended on ``stage``: the root task, when it is now trained (stage 0)."""
        piece = self.pieces.get(task.task_id)
        if piece is None:
            return task if stage == 0 else None
        state = self.splits[piece.root]
        state.done[stage] += 1
        if stage != 0 or state.unstarted or state.done[0] < state.total:
            return None
        self._drop(piece.root)
        return state.root

    def lost(self, tasks: list) -> list:
        """A reset lost ``tasks``: each piece stands for its root, once; their state goes."""
        out, seen = [], set()
        for t in tasks:
            piece = self.pieces.get(t.task_id) if isinstance(t, OnlineTask) else None
            root = t if piece is None else self.splits[piece.root].root
            if root.task_id not in seen:
                seen.add(root.task_id)
                out.append(root)
        for root_id in [r for r in self.splits if r in seen]:
            self._drop(root_id)
        return out

    def _drop(self, root_id: int) -> None:
        self.splits.pop(root_id, None)
        for pid in [p for p, piece in self.pieces.items() if piece.root == root_id]:
            del self.pieces[pid]
