"""The node scheduler's ledger of its stages' paged KV pools.

A live deployment's stage workers keep their K/V in a pool of ``blocks`` blocks of
``block_size`` tokens each (``stage.kv_cache_tokens`` / ``stage.block_size``), and every
stage holds every request's context (each holds its own layers' K/V). A request may fill
ceil((prompt + max_tokens) / block_size) blocks on each stage: the ledger reserves that
when its prefill starts and gives it back when the request ends, so a prefill starts only
with blocks that are free and no stage worker runs out of them. Without a pool
(``blocks`` None: the simulator's stages) every request fits and needs 0 blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raycolo.batching.blocks import blocks_for
from raycolo.online.scheduling.node_types import Request
from raycolo.online.tasks import OnlineTask


@dataclass(slots=True)
class KVLedger:
    blocks: Optional[int]          # each stage's pool (None: no pool)
    block_size: int
    reserved: int = 0              # blocks the running requests hold on each stage

    def need(self, task: OnlineTask) -> int:
        """The blocks an inference task may fill on each stage: for each of its ``batch``
        sequences, its prompt and every token it may generate (0 without a pool)."""
        if self.blocks is None:
            return 0
        return task.batch * blocks_for(task.length + task.token_budget, self.block_size)

    def refuse_too_long(self, task: OnlineTask) -> None:
        """Raise ValueError if ``task`` needs more blocks than a whole stage holds."""
        need = self.need(task)
        if self.blocks is not None and need > self.blocks:
            raise ValueError(f"task {task.task_id}: {task.batch} × ({task.length} prompt tokens + {task.token_budget} "
                             f"to generate) need {need} KV blocks; each stage has {self.blocks}")

    def fitting(self, requests: list[Request]) -> int:
        """How many of ``requests``, from the first, have their blocks free now."""
        if self.blocks is None:
            return len(requests)
        free, fits = self.blocks - self.reserved, 0
        for r in requests:
            free -= self.need(r.task)
            if free < 0:
                break
            fits += 1
        return fits

    def reserve(self, requests: list[Request]) -> None:
        for r in requests:
            r.kv_blocks = self.need(r.task)
            self.reserved += r.kv_blocks

    def release(self, r: Request) -> None:
        self.reserved -= r.kv_blocks
        r.kv_blocks = 0

    def clear(self, requests) -> None:
        """The stages lost their caches: nothing is reserved, by ``requests`` or any other."""
        self.reserved = 0
        for r in requests:
            if isinstance(r, Request):
                r.kv_blocks = 0
