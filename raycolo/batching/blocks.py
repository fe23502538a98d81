"""KV-cache block allocation: which physical blocks each request's KV occupies.

This is the block accounting that :class:`raycolo.batching.step_scheduler.FcfsBlockScheduler`
keeps for the reference simulator and for the torch engine alike. The engine's paged KV
cache (:mod:`raycolo.engine.executor.kv_cache`) stores token ``t`` of a request in block
``table[t // block_size]`` at offset ``t % block_size``, so the blocks the scheduler
counts are the blocks the engine really fills.

Pure Python, deterministic: freed blocks are reused last-freed first, and blocks never
used yet are handed out in increasing order, so a request set always maps to the same
blocks. Nothing is preallocated here (paper-sized replicas have 10^5 blocks or more).
"""
from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16      # tokens per KV block: the engine's, the online stages' (vLLM's default too)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens (the last one partly filled)."""
    return -(-tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.tables: dict[int, list[int]] = {}   # request -> its blocks, in token order
        self._recycled: list[int] = []
        self._next_fresh = 0                       # blocks >= this were never handed out

    @property
    def free(self) -> int:
        return len(self._recycled) + self.num_blocks - self._next_fresh

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    def _take(self) -> int:
        if self._recycled:
            return self._recycled.pop()
        if self._next_fresh >= self.num_blocks:
            raise RuntimeError(f"KV cache out of blocks ({self.num_blocks} in all); the scheduler "
                               "must check free blocks before allocating")
        self._next_fresh += 1
        return self._next_fresh - 1

    def allocate(self, req: int, n: int) -> list[int]:
        """Give ``req`` ``n`` more blocks (appended to its table); returns its table."""
        if n > self.free:
            raise RuntimeError(f"request {req}: needs {n} KV blocks, {self.free} free")
        table = self.tables.setdefault(req, [])
        table.extend(self._take() for _ in range(n))
        return table

    def release(self, req: int) -> int:
        """Free every block of ``req``; returns how many there were."""
        table = self.tables.pop(req, [])
        self._recycled.extend(reversed(table))
        return len(table)

    def blocks_of(self, req: int) -> int:
        return len(self.tables.get(req, ()))

    def check(self) -> None:
        """Raise if the books do not balance: every block is either free or in exactly one
        table (tests call this after every run)."""
        held = [b for t in self.tables.values() for b in t]
        free = self._recycled + list(range(self._next_fresh, self.num_blocks))
        if len(set(held)) != len(held):
            raise AssertionError("a KV block is held by two requests")
        if set(held) & set(free):
            raise AssertionError("a KV block is both held and free")
        if len(held) + len(free) != self.num_blocks or len(set(free)) != len(free):
            raise AssertionError(f"KV blocks: {len(held)} held + {len(free)} free != {self.num_blocks}")
