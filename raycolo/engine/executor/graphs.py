"""Decode steps replayed as CUDA graphs.

On a GPU a small model's decode step is bound by kernel launches, not by arithmetic: the
eager executor launches a few hundred kernels per step from Python (seen on an H100:
5.8 ms per step for tiny-llama-xl at batch 1, where the arithmetic takes microseconds).
A CUDA graph records one step's kernels once and replays them with one launch, as vLLM
does for its decode batches (``vllm/v1/worker/gpu_model_runner.py``, ``capture_model``).

A graph replays fixed shapes at fixed addresses. :class:`DecodeGraphs` therefore pads a
decode step (one new token per sequence) to a captured shape ``(rows, blocks)``: rows from
:data:`BATCH_BUCKETS`, the block-table width to the next power of two. The step's inputs
(token ids or the previous slice's hidden states, positions, KV slots, block tables) are
copied into static buffers, the graph replays, and the first ``num_seqs`` rows of the
static output are the step's result. Padding rows and table entries point at a scratch
block the executor's cache holds beyond ``num_blocks``, which no sequence ever owns: a
padding row writes its key/value there and attends only to it.

The step that is captured is the executor's own :meth:`ModelExecutor.forward` over a
:class:`StepBatch` built from the static buffers (flat tables for the in-place kernels,
native or Triton; an attention group for the torch path): the model code exists once. The same
padded batch runs eagerly where graphs cannot be captured (``capture=False``, the CPU),
which is how the tests check the padding on a machine without a GPU.

A graph holds the Python decisions made while it was captured: the executor drops its
graphs when it sleeps (the weights and cache move). A peft-wrapped model (an online stage
serving while its LoRA trains) is captured once per adapter state: which adapters are
active, switched off (peft's ``disable_adapter``) or merged, as
:meth:`ModelExecutor.adapter_state` reads it; the key of a graph is that state and its
shape. The LoRA weights themselves may change between replays: the optimizer steps and a
saved version swapped in for a pass (:meth:`StageModel._variant`) write into the same
tensors, which the graph reads at replay.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from raycolo.engine.executor.batch import AttentionGroup, SeqChunk, StepBatch

log = logging.getLogger("raycolo.engine.executor")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPHS = 64          # captured shapes kept; a step of another shape runs eagerly
WARMUP_RUNS = 2          # eager runs on a side stream before capture (vLLM does the same)


@dataclass
class DecodeBatch:
    """A decode step padded to a captured shape. ``packed`` (CPU, one copy to the device)
    holds every row's token id, then every row's position, KV slot, and block table
    (``rows * (3 + blocks)`` long)."""
    num_seqs: int
    rows: int
    blocks: int
    packed: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.num_seqs


def graph_attempts(executor) -> int:
    """Captures ``executor`` tried, those that failed included (a step that tried is not a
    plain step); 0 for an executor without graphs."""
    graphs = getattr(executor, "graphs", None)
    return 0 if graphs is None else graphs.captures + graphs.failures


def static_rope(rotary) -> bool:
    """Whether ``rotary``'s frequencies are fixed, as a captured CUDA graph needs: "dynamic"
    RoPE (and "longrope" in the transformers of the GPU machines) picks them step by step
    from the batch's longest position, on the host; those models decode eagerly."""
    types = getattr(rotary, "rope_type", "default")
    types = types.values() if isinstance(types, dict) else [types]
    moving = sorted(t for t in types if "dynamic" in t or t == "longrope")
    if moving:
        log.info("RoPE type %s: decode steps run eagerly (no CUDA graphs)", moving[0])
    return not moving


class _Graph:
    """One captured shape: its static buffers, its batch over them, its output."""

    def __init__(self, rows: int, blocks: int, hidden_size: int, dtype, device):
        self.rows, self.blocks = rows, blocks
        self.packed = torch.zeros(rows * (3 + blocks), dtype=torch.long, device=device)
        self.hidden = torch.zeros((rows, hidden_size), dtype=dtype, device=device)
        self.index = torch.arange(rows, device=device)
        self.table_start = self.index * blocks               # each row's table in the flat tables
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.output: Optional[torch.Tensor] = None

    def batch(self, flat: bool) -> StepBatch:
        """A fresh StepBatch over the static buffers (fresh: its masks are computed inside
        the run that uses it, so a captured graph computes them from the static positions).
        ``flat``: the in-place kernels' flat tables instead of an attention group."""
        ids, positions, slots, tables = _fields(self.packed, self.rows)
        if flat:
            return StepBatch(self.rows, self.rows, ids, positions, slots, self.index, [],
                             tables, self.table_start)
        group = AttentionGroup(self.rows, 1, tables.view(self.rows, -1), self.index,
                               positions.view(self.rows, 1), None, None)
        return StepBatch(self.rows, self.rows, ids, positions, slots, self.index, [group])


def _fields(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """Views of a packed decode step: ids, positions, slots (rows each), tables (the rest)."""
    return packed[:rows], packed[rows:2 * rows], packed[2 * rows:3 * rows], packed[3 * rows:]


def enable_padded_decode(executor, capture: bool) -> "DecodeGraphs":
    """Give ``executor`` (a fresh :class:`ModelExecutor` built without graphs, before its
    first step) padded decode steps: captured as CUDA graphs (``capture=True``, a CUDA
    device), or the same padded steps run eagerly (``capture=False``: any device, e.g. to
    check the padding on the CPU). Its cache is made anew with the scratch block, past the
    ``num_blocks`` sequences use (``ModelExecutor(cuda_graphs=True)`` builds it so at once)."""
    from raycolo.engine.executor.kv_cache import PagedKVCache

    cache = executor.cache
    if capture and torch.device(cache.device).type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    executor.cache = PagedKVCache(cache.num_layers, cache.num_blocks + 1, cache.block_size, cache.kv_heads,
                                  cache.head_dim, cache.dtype, cache.device)
    executor.graphs = DecodeGraphs(executor, cache.num_blocks, capture)
    return executor.graphs


class DecodeGraphs:
    """Captured decode steps of one :class:`ModelExecutor` (see the module docstring)."""

    def __init__(self, executor, scratch_block: int, capture: bool):
        self.executor = executor
        self.scratch = scratch_block
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}     # (adapter state, rows, blocks) -> graph
        self.pool = None
        self.captures = 0        # graphs captured so far (a step that captured took that long too)
        self.failures = 0        # captures that failed (that shape runs eagerly)

    def clear(self) -> None:
        """Forget every graph (the weights or the cache moved)."""
        self.graphs.clear()
        self.pool = None

    def decode_batch(self, chunks: Sequence[SeqChunk]) -> Optional[DecodeBatch]:
        """The step as a padded decode batch, or None where it is not a decode step that
        fits a captured shape (a prefill, a chunk of several tokens, too many rows)."""
        n = len(chunks)
        if n == 0 or n > BATCH_BUCKETS[-1] or any(c.length != 1 for c in chunks):
            return None
        rows = BATCH_BUCKETS[bisect.bisect_left(BATCH_BUCKETS, n)]
        widest = max(len(c.table) for c in chunks)
        blocks = 1 << max(0, widest - 1).bit_length()
        if self._key(rows, blocks) not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            return None
        return DecodeBatch(n, rows, blocks, self._pack(chunks, rows, blocks))

    def _key(self, rows: int, blocks: int) -> tuple:
        return (self.executor.adapter_state(), rows, blocks)

    def _pack(self, chunks: Sequence[SeqChunk], rows: int, blocks: int) -> torch.Tensor:
        """The packed inputs of ``chunks`` padded to ``rows`` x ``blocks`` (CPU)."""
        bs, scratch = self.executor.block_size, self.scratch
        ids, positions, slots, tables = [], [], [], []
        for c in chunks:
            pos = c.start
            if pos // bs >= len(c.table):
                raise ValueError(f"a sequence of {pos + 1} tokens needs more than its {len(c.table)} blocks")
            ids.append(int(c.tokens[0]) if c.num_tokens is None else 0)
            positions.append(pos)
            slots.append(c.table[pos // bs] * bs + pos % bs)
            tables.extend(c.table)
            tables.extend([scratch] * (blocks - len(c.table)))
        # padding rows: token 0 at position 0 of the scratch block, a table of scratch blocks
        pad = rows - len(chunks)
        return torch.tensor(ids + [0] * pad + positions + [0] * pad + slots + [scratch * bs] * pad
                            + tables + [scratch] * (blocks * pad), dtype=torch.long)

    def run(self, batch: DecodeBatch, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        ex = self.executor
        key = self._key(batch.rows, batch.blocks)
        g = self.graphs.get(key)
        if g is None:
            g = _Graph(batch.rows, batch.blocks, ex.config.hidden_size, ex.dtype, ex.device)
            if self.capture:
                try:
                    self._capture(g)
                except Exception as exc:    # out of memory, an op capture refuses: this shape runs eagerly
                    g.graph = None
                    self.failures += 1
                    log.warning("decode graph of %d rows x %d blocks not captured (%s); that step runs "
                                "eagerly", g.rows, g.blocks, exc)
            self.graphs[key] = g
        g.packed.copy_(batch.packed, non_blocking=True)
        if not ex.is_first:
            if hidden is None or hidden.shape[0] != batch.num_seqs:
                raise ValueError(f"layers [{ex.first}, {ex.last}): need hidden states for "
                                 f"{batch.num_seqs} tokens")
            g.hidden[:batch.num_seqs].copy_(hidden)
            g.hidden[batch.num_seqs:].zero_()
        if g.graph is None:             # no capture here: the same padded step, eagerly
            out = ex.forward(g.batch(ex.native), None if ex.is_first else g.hidden)
        else:
            g.graph.replay()
            out = g.output
        return out[:batch.num_seqs].clone()

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream, then record one step. The static buffers hold only
        padding while this runs: every write lands in the scratch block."""
        ex = self.executor
        g.packed.copy_(self._pack([], g.rows, g.blocks))      # every row a padding row
        hidden = None if ex.is_first else g.hidden
        stream = torch.cuda.Stream(device=ex.device)
        stream.wait_stream(torch.cuda.current_stream(ex.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                ex.forward(g.batch(ex.native), hidden)
        torch.cuda.current_stream(ex.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # on the executor's device, whichever device is current in this process
        with torch.cuda.device(ex.device), \
                torch.cuda.graph(graph, pool=self.pool, stream=torch.cuda.Stream(device=ex.device)):
            g.output = ex.forward(g.batch(ex.native), hidden)
        g.graph = graph
        self.captures += 1
