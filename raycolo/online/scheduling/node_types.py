"""The node scheduler's data types (:mod:`raycolo.online.scheduling.node`), with no clock and no Ray.

An executor gets :class:`Op` s to start and :class:`Timer` s to arm in a :class:`NodeStep`
and hands them back when they end or fire; :class:`Request` is an inference task's
progress on its node, and :class:`Stage` one stage's ready heap and memory ledger.

"Batch" here is only :attr:`Op.batch`, the queries of one op (Σ C over its tasks, each
task's C being ``OnlineTask.batch``); the open Algorithm 3 batch (arrived inference
tasks not yet closed into a prefill) is ``NodeScheduler.batch``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raycolo.text_enum import TextEnum
from raycolo.online.tasks import OnlineTask, TaskKind

class OpKind(TextEnum):
    """What an :class:`Op` runs on its stage (a ``str`` enum: equal to, and hashed as, its value)."""

    PREFILL = "prefill"      # an inference batch's prompt
    DECODE = "decode"        # one decode iteration of the running requests
    TRAIN_F = "train_f"      # a fine-tune micro-batch's forward
    TRAIN_B = "train_b"      # its backward
    SYNC = "sync"            # load a new adapter version


FORWARD_KINDS = (OpKind.PREFILL, OpKind.TRAIN_F)
OP_KINDS = tuple(OpKind)


@dataclass(eq=False)
class Request:
    """An inference task's progress on its node."""

    task: OnlineTask
    context: int                 # tokens in the KV cache after the next op
    generated: int = 0           # tokens out of the last stage so far
    kv_bytes: float = 0.0        # reserved on each stage whose prefill kept it on the GPU
    kv_blocks: int = 0           # of each stage's KV pool, reserved from its prefill's start to its end

    @property
    def task_id(self) -> int:
        return self.task.task_id


@dataclass(eq=False)
class Op:
    kind: OpKind
    node: int
    stage: int
    ready_s: float
    seq: int
    tasks: list                  # Requests (prefill, decode), [OnlineTask] (train_f, train_b); [] (sync)
    mem_bytes: float = 0.0       # held on this stage from a forward's start
    waited_s: float = 0.0
    offloaded: bool = False      # Algorithm 2 line 10: ran with its memory on the host
    overrun: bool = False        # ran past the stage's memory (not memory-aware)
    reload: bool = False         # a backward whose activations were offloaded
    start_s: float = 0.0
    after: Optional[int] = None  # seq of the op on the neighbour stage whose output this consumes
    generation: int = 0          # the node's resets before this op was made
    step: bool = True            # train_b: the stage takes its optimizer step after it (the
                                 # last micro-batch of its task there; microbatches.py)
    version: Optional[int] = None  # sync: the training tasks whose weights it loads

    @property
    def batch(self) -> int:
        """Queries in the op (Σ C)."""
        if self.kind in (OpKind.PREFILL, OpKind.DECODE):
            return sum(r.task.batch for r in self.tasks)
        return self.tasks[0].batch if self.kind in (OpKind.TRAIN_F, OpKind.TRAIN_B) else 0


@dataclass(eq=False)
class Timer:
    """Call :meth:`NodeScheduler.timer` with this at ``at_s``."""

    at_s: float
    node: int
    kind: str                    # close_batch | memory_retry | rule_wake
    token: int = 0               # close_batch: the batch it closes
    stage: int = 0               # memory_retry, rule_wake: the stage (and the op that waits)
    op: Optional[Op] = None
    step_s: float = 0.0
    generation: int = 0          # a timer armed before the node was reset is ignored
    number: int = -1             # the node's count of timers armed before it (node_events.py)


@dataclass
class NodeStep:
    """What one call into the node produced."""

    actions: list = field(default_factory=list)    # Op (start now) or Timer (arm), in order
    observed: list = field(default_factory=list)   # (task_id, stage, "forward"|"backward", start, end)
    tokens: list = field(default_factory=list)     # Requests whose token left the last stage
    finished: list = field(default_factory=list)   # Requests that ended (after their last token)
    trained: list = field(default_factory=list)    # OnlineTasks whose backward reached stage 0
    lost: list = field(default_factory=list)       # reset: unfinished Requests and training OnlineTasks
    aborted: list = field(default_factory=list)    # training task ids whose activations the stages drop (SIRIUS)
    synced: Optional[int] = None                   # weights version the node serves from now
    activated: bool = False                        # the node went from idle to active
    idle: bool = False                             # the node has nothing left to do

    @property
    def started(self) -> list:
        return [a for a in self.actions if isinstance(a, Op)]

    @property
    def timers(self) -> list:
        return [a for a in self.actions if isinstance(a, Timer)]


@dataclass
class Stage:
    """One stage's ready ops and memory ledger."""

    ready: list = field(default_factory=list)   # heap of (ready_s, seq, op)
    busy: Optional[Op] = None
    used_bytes: float = 0.0
    held: dict = field(default_factory=dict)    # (kind, task id) -> bytes this stage holds
    busy_s: float = 0.0
    train_busy_s: float = 0.0                   # of busy_s, in training ops
    retry_pending: bool = False
    wake_at: Optional[float] = None             # a rule_wake timer armed for this time

    def release(self, key: tuple) -> None:
        """Give back what this stage holds for ``key`` (nothing if it holds none)."""
        self.used_bytes -= self.held.pop(key, 0.0)


def forward_holdings(op: Op) -> list[tuple[tuple, float]]:
    """What a forward keeps on its stage, per task, so release is exact per stage."""
    if op.kind == OpKind.PREFILL:
        return [((TaskKind.INFERENCE, r.task_id), r.kv_bytes) for r in op.tasks]
    return [((TaskKind.TRAIN, op.tasks[0].task_id), op.mem_bytes)]
