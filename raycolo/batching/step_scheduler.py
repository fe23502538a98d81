"""The FCFS continuous-batching scheduler, shared by the reference simulator and the
torch engine, so the simulator predicts the policy the engine really runs.

It only decides and keeps the KV-block books (docs/simulator.md); the caller executes
each decision and reports back with :meth:`prefilled`, :meth:`decoded` and
:meth:`finished`. Requests are integer handles.

Blocks are allocated when a decision is made, before it runs: a prefill's prompt blocks,
and the block a decode step's new token spills into. The engine writes the step's KV
into exactly those blocks (``alloc.tables``); the counts at every :meth:`schedule` call
are the same as if blocks were taken after the step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from raycolo.batching.blocks import BlockAllocator
from raycolo.batching.limits import SchedulerLimits, ceil_div
from raycolo.text_enum import TextEnum


class StepKind(TextEnum):
    """What one engine step runs (vLLM's prefill and decode phases), or nothing."""

    PREFILL = "prefill"
    DECODE = "decode"
    IDLE = "idle"


@dataclass
class ScheduledStep:
    kind: StepKind
    seqs: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)


class FcfsBlockScheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.alloc = BlockAllocator(limits.num_blocks)
        self.waiting: deque[int] = deque()
        self.running: list[int] = []        # admission order
        self.prompt_len: dict[int, int] = {}  # tokens a (re-)admission prefills
        self.stored: dict[int, int] = {}    # KV tokens held by running requests

    @property
    def free(self) -> int:
        return self.alloc.free

    def add(self, req: int, prompt_len: int) -> None:
        self.prompt_len[req] = prompt_len
        self.waiting.append(req)

    def add_running(self, req: int, stored: int) -> None:
        """A request that already holds ``stored`` tokens of KV (continued from before)."""
        self.running.append(req)
        self.stored[req] = stored
        self.alloc.allocate(req, ceil_div(stored, self.limits.block_size))

    def add_front(self, reqs: Iterable[int], prompt_lens: Iterable[int]) -> None:
        """Put requests back at the head of the queue (a scheduled prefill that did not
        run gives its blocks back)."""
        reqs = list(reqs)
        for req, p in zip(reqs, prompt_lens):
            self.prompt_len[req] = p
            self.alloc.release(req)
        self.waiting.extendleft(reversed(reqs))

    def schedule(self) -> ScheduledStep:
        lim = self.limits
        batch, tokens, free_after = [], 0, self.free
        for req in self.waiting:
            if len(self.running) + len(batch) >= lim.max_num_seqs:
                break
            p = self.prompt_len[req]
            if batch and tokens + p > lim.max_num_batched_tokens:
                break
            need = ceil_div(p, lim.block_size)
            if free_after - need < lim.watermark_blocks:
                break
            batch.append(req)
            tokens += p
            free_after -= need
        if batch:
            for req in batch:
                self.waiting.popleft()
                self.alloc.allocate(req, ceil_div(self.prompt_len[req], lim.block_size))
            return ScheduledStep(StepKind.PREFILL, batch)
        if not self.running:
            return ScheduledStep(StepKind.IDLE)
        bs = lim.block_size
        need = sum(1 for r in self.running if self.stored[r] % bs == 0)
        preempted = []
        while need > self.free:
            victim = self.running.pop()
            self.alloc.release(victim)
            if self.stored[victim] % bs == 0:
                need -= 1
            self.prompt_len[victim] = self.stored.pop(victim) + 1  # prompt + generated so far
            self.waiting.appendleft(victim)
            preempted.append(victim)
        for req in self.running:  # the block this step's new token goes into
            if self.stored[req] % bs == 0:
                self.alloc.allocate(req, 1)
        return ScheduledStep(StepKind.DECODE, list(self.running), preempted)

    def prefilled(self, req: int) -> None:
        """``req`` was prefilled and stays running (it did not finish on its first token)."""
        self.running.append(req)
        self.stored[req] = self.prompt_len[req]

    def decoded(self, seqs: Iterable[int]) -> None:
        for req in seqs:
            self.stored[req] += 1

    def finished(self, req: int) -> None:
        if req in self.stored:
            self.running.remove(req)
            del self.stored[req]
        self.alloc.release(req)
        self.prompt_len.pop(req, None)

    def is_waiting(self, req: int) -> bool:
        return req in self.waiting

    def remove(self, req: int) -> None:
        """Forget ``req`` wherever it is, waiting or running, and free its blocks (a request
        taken away to run elsewhere)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.prompt_len.pop(req, None)
        self.stored.pop(req, None)
        self.alloc.release(req)

    def table(self, req: int) -> list[int]:
        """The KV blocks of ``req``, in token order."""
        return self.alloc.tables[req]

    @property
    def blocks_used(self) -> int:
        return self.alloc.used
