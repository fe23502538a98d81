"""What one executor step runs: the sequences, their new tokens and their KV blocks,
turned into the index tensors attention needs (vLLM calls this attention metadata).

A step is a list of :class:`SeqChunk`: for each sequence, the new tokens (a whole prompt
for a prefill, one token for a decode step, any number in between) starting at position
``start``, with the sequence's block table. Tokens of all sequences are packed into one
row of ``num_tokens`` for the projections and the MLP. Attention runs per *group* of
sequences of similar length, each padded only to its own longest context, so that a
batch of short and long requests does not pay the longest one's context for all.
The native CPU kernel (:mod:`raycolo.engine.executor.native`) needs no groups: it reads each
token's keys through ``tables`` at ``table_start``, up to the token's position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

# Attention groups: sequences are sorted by context and cut into at most this many groups
# of at least MIN_GROUP rows each (each group is one SDPA call per layer).
MAX_GROUPS = 4
MIN_GROUP = 16
# The Triton kernel's query tiles: up to this many consecutive tokens of one sequence.
TILE_TOKENS = 16


@dataclass
class SeqChunk:
    tokens: Sequence[int]        # new token ids (ignored by a slice that takes hidden states)
    start: int                   # position of the first new token; KV before it is cached
    table: Sequence[int]         # the sequence's KV blocks, in token order
    num_tokens: Optional[int] = None  # when tokens are not given (later slices)
    every_logit: bool = False    # the last slice returns every new token's logits, not only the last's

    @property
    def length(self) -> int:
        return len(self.tokens) if self.num_tokens is None else self.num_tokens

    @property
    def logit_rows(self) -> int:
        """How many rows of the last slice's logits are this chunk's."""
        return self.length if self.every_logit else 1


@dataclass
class AttentionGroup:
    rows: int
    query_len: int               # Lq: queries per row, padded
    tables: torch.Tensor         # (rows, blocks) long
    query_index: torch.Tensor    # (rows * Lq,) packed token of each padded query
    query_pos: torch.Tensor      # (rows, Lq) its position
    out_index: Optional[torch.Tensor]  # (valid,) where valid padded queries go in the packed row
    out_src: Optional[torch.Tensor]    # (valid,) their index in the padded layout
    masks: dict = field(default_factory=dict)  # sliding window -> (rows, 1, Lq, T) bool

    def mask(self, window: Optional[int], kv_len: int) -> torch.Tensor:
        if window not in self.masks:
            keys = torch.arange(kv_len, device=self.query_pos.device)
            q = self.query_pos.unsqueeze(-1)
            allowed = keys <= q
            if window is not None:
                allowed &= keys > q - window
            self.masks[window] = allowed.unsqueeze(1)
        return self.masks[window]


@dataclass
class StepBatch:
    num_seqs: int
    num_tokens: int
    input_ids: Optional[torch.Tensor]   # (num_tokens,) long
    positions: torch.Tensor             # (num_tokens,) long
    slots: torch.Tensor                 # (num_tokens,) flat KV slot of each new token
    last_index: torch.Tensor            # packed index of each sequence's last token (of each token
    #                                     where its chunk asks for every_logit): the logits' rows
    groups: list[AttentionGroup]        # empty when built with groups=False
    tables: Optional[torch.Tensor] = None       # every sequence's block table, concatenated
    table_start: Optional[torch.Tensor] = None  # (num_tokens,) where its sequence's table starts
    # The Triton kernel's query tiles (first packed token, length) of a step with a chunk of
    # several tokens; None for a decode step (one token per sequence) or other kernels.
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu",
              with_ids: bool = True, groups: bool = True, tiles: bool = False) -> "StepBatch":
        """The step's index tensors: attention groups (``groups=True``, the torch attention
        path), or flat block tables (``groups=False``, the in-place kernels); with
        ``tiles``, also the Triton kernel's query tiles where a chunk has several tokens."""
        ids, positions, slots, last, offsets = [], [], [], [], []
        flat_tables, table_start = [], []
        offset = 0
        for c in chunks:
            n = c.length
            if n <= 0:
                raise ValueError("a sequence in a step needs at least one new token")
            end = c.start + n
            if -(-end // block_size) > len(c.table):
                raise ValueError(f"a sequence of {end} tokens needs more than its {len(c.table)} blocks")
            pos = range(c.start, end)
            positions.extend(pos)
            slots.extend(c.table[p // block_size] * block_size + p % block_size for p in pos)
            if with_ids:
                ids.extend(c.tokens)
            if not groups:
                table_start.extend([len(flat_tables)] * n)
                flat_tables.extend(c.table)
            offsets.append(offset)
            last.extend(range(offset, offset + n) if c.every_logit else (offset + n - 1,))
            offset += n

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        if not groups:
            lengths = [c.length for c in chunks]
            tiled = query_tiles(lengths, device) if tiles and offset > len(chunks) else None
            return cls(len(chunks), offset, tensor(ids) if with_ids else None, tensor(positions),
                       tensor(slots), tensor(last), [], tensor(flat_tables), tensor(table_start), tiled)
        built = [cls._group(chunks, rows, offsets, block_size, tensor)
                 for rows in _split_rows(chunks, block_size)]
        return cls(len(chunks), offset, tensor(ids) if with_ids else None, tensor(positions),
                   tensor(slots), tensor(last), built)

    @staticmethod
    def _group(chunks, rows, offsets, block_size, tensor) -> AttentionGroup:
        lq = max(chunks[r].length for r in rows)
        blocks = max(-(-(chunks[r].start + chunks[r].length) // block_size) for r in rows)
        tables, q_index, q_pos, out_index, out_src = [], [], [], [], []
        for i, r in enumerate(rows):
            c = chunks[r]
            tables.append(list(c.table[:blocks]) + [0] * (blocks - min(blocks, len(c.table))))
            for j in range(lq):
                k = min(j, c.length - 1)  # padding repeats the last query; its output is dropped
                q_index.append(offsets[r] + k)
                q_pos.append(c.start + k)
                if j < c.length:
                    out_index.append(offsets[r] + j)
                    out_src.append(i * lq + j)
        identity = lq == 1 and list(rows) == list(range(len(chunks)))
        return AttentionGroup(
            len(rows), lq, tensor(tables), tensor(q_index), tensor(q_pos).view(len(rows), lq),
            None if identity else tensor(out_index), None if identity else tensor(out_src))


def _split_rows(chunks: Sequence[SeqChunk], block_size: int) -> list[list[int]]:
    """Rows sorted by context, cut into up to MAX_GROUPS groups of >= MIN_GROUP rows."""
    n = len(chunks)
    groups = max(1, min(MAX_GROUPS, n // MIN_GROUP))
    if groups == 1:
        return [list(range(n))]
    order = sorted(range(n), key=lambda r: chunks[r].start + chunks[r].length)
    size = -(-n // groups)
    return [order[i:i + size] for i in range(0, n, size)]


def query_tiles(lengths: Sequence[int], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The first packed token and the length of every query tile of a step whose sequences
    have ``lengths`` new tokens each: up to TILE_TOKENS tokens, never across sequences."""
    starts, sizes, offset = [], [], 0
    for n in lengths:
        for t in range(0, n, TILE_TOKENS):
            starts.append(offset + t)
            sizes.append(min(TILE_TOKENS, n - t))
        offset += n
    return (torch.tensor(starts, dtype=torch.long, device=device),
            torch.tensor(sizes, dtype=torch.long, device=device))
