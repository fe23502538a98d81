"""What the penalties read of each request, kept on the logits' device between steps.

A repetition penalty looks at every id of a row's prompt and output; presence and
frequency penalties count its output ids. Rebuilding that from the ids at every step
costs host work and an upload proportional to prompt + output per row (at batch 256 with
2,048-token prompts, about 10 ms of host time a step). :class:`PenaltyHistory` keeps,
per request (a :class:`~.rows.SamplingRow`'s ``key``), one int32 row of the vocabulary
(plus a scratch column where padding and out-of-vocabulary ids land) on the device:
the count of each id in the output so far, with :data:`PROMPT_FLAG` set on the ids of
the prompt. A step then uploads only what is new (usually one id per row) and updates
those rows in place with one scatter-add; a request seen for the first time, or whose
history no longer matches what it carries (a reused key, a request moved here from
another replica), is built from its prompt and output in one upload.

The rows a step reads are the same whatever is cached: a step's mask and counts are
those of the row's ``prompt`` and ``output`` (tested against a history built afresh).
Rows without a key get a slot for that step only. Requests that leave are dropped with
:meth:`PenaltyHistory.forget`; where no one says (a pipeline's last stage), the least
recently used slots beyond :data:`SLOTS_PER_ROW` times the largest step are reused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import numpy as np
import torch

from raycolo.generation.rows import SamplingRow

# bit 30 of a history entry: the id is in the prompt (bits below: its count in the output)
PROMPT_FLAG = 1 << 30
# slots kept per row of the largest step (a pipeline alternates micro-batches), and at least
SLOTS_PER_ROW = 2
MIN_SLOTS = 16


@dataclass
class _Slot:
    index: int
    prompt_len: int
    seed: int
    counted: int          # output ids added so far
    last: int             # the last of them (-1: none): a key reused by another request shows
    used: int             # the step that last read it


def padded(lists: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """Token ids right-padded to one width with ``vocab``: the scratch column of the masks
    and counts (ids outside the vocabulary land there too). Built in numpy."""
    width = max(1, max((len(ids) for ids in lists), default=0))
    out = np.full((len(lists), width), vocab, dtype=np.int64)
    for i, ids in enumerate(lists):
        try:
            a = np.asarray(ids, dtype=np.int64)
        except OverflowError:                     # an id past int64: outside the vocabulary
            a = np.asarray([t if 0 <= t < vocab else vocab for t in ids], dtype=np.int64)
        out[i, :len(a)] = np.where((a >= 0) & (a < vocab), a, vocab)
    return out


class PenaltyHistory:
    """Per request, on ``device``: its prompt's ids and its output's id counts (module doc).
    One step: :meth:`plan` (host: slots and what to upload), then :meth:`update` with the
    uploaded tensors (device), then :meth:`mask` / :meth:`counts` of the step's slots."""

    def __init__(self, vocab: int = 0, device: torch.device | str = "cpu"):
        self.step = 0
        self.fit(vocab, torch.device(device))

    def fit(self, vocab: int, device: torch.device) -> "PenaltyHistory":
        """This history for logits of ``vocab`` ids on ``device``: emptied where it was
        kept for others (a first step, a model moved to another device)."""
        if getattr(self, "vocab", None) != vocab or getattr(self, "device", None) != device:
            self.vocab, self.device = vocab, device
            self.table = torch.zeros(0, vocab + 1, dtype=torch.int32, device=device)
            self.slots: dict[Hashable, _Slot] = {}
            self.free: list[int] = []
            self.largest = 0
        return self

    def forget(self, key: Hashable) -> None:
        """``key``'s request is gone: its slot is free; the last one gone gives the
        table's memory back (a batch with no penalized request holds none)."""
        self._drop(key)
        if not self.slots:
            self.table = self.table.new_empty(0, self.vocab + 1)
            self.free = []

    def _drop(self, key: Hashable) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.free.append(slot.index)

    def __len__(self) -> int:
        return len(self.slots)

    def plan(self, rows: Sequence[SamplingRow]) -> tuple[list[int], dict[str, object]]:
        """Each row's slot, and the int64 arrays :meth:`update` needs (to be uploaded with
        the step's others): ``fresh_slots`` with ``fresh_prompt`` and ``fresh_output``
        (padded ids of rows built afresh), ``new_slots`` with ``new_ids`` (output ids
        since a cached row's last step)."""
        self.step += 1
        self.largest = max(self.largest, len(rows))
        slots, fresh, new_slots, new_ids, transient = [], [], [], [], []
        for at, row in enumerate(rows):
            key, out = row.key, row.output
            slot = self.slots.get(key) if key is not None else None
            if slot is not None and slot.used == self.step:
                key = slot = None             # a key twice in one step: the second row on its own
            if slot is not None and (slot.prompt_len != len(row.prompt) or slot.seed != row.seed
                                     or slot.counted > len(out)
                                     or (slot.counted and int(out[slot.counted - 1]) != slot.last)):
                self._drop(key)               # not the request it was built for: built afresh
                slot = None
            last = int(out[-1]) if len(out) else -1
            if slot is None:
                index = self._take(len(rows) - at)
                if key is None:
                    transient.append(index)
                else:
                    self.slots[key] = _Slot(index, len(row.prompt), row.seed, len(out), last, self.step)
                fresh.append((index, row))
            else:
                extra = out[slot.counted:]
                new_slots += [slot.index] * len(extra)
                new_ids += list(extra)
                slot.counted, slot.last, slot.used, index = len(out), last, self.step, slot.index
            slots.append(index)
        self.free += transient              # device work is in stream order: reused next step
        arrays = {"fresh_slots": [i for i, _ in fresh],
                  "fresh_prompt": padded([r.prompt for _, r in fresh], self.vocab) if fresh else [],
                  "fresh_output": padded([r.output for _, r in fresh], self.vocab) if fresh else [],
                  "new_slots": new_slots,
                  "new_ids": padded([new_ids], self.vocab)[0] if new_ids else []}
        return slots, arrays

    def _take(self, rows_left: int) -> int:
        """A free slot: a freed one, else the least recently used one not in this step where
        the table holds enough, else a new one (the table grown once for the ``rows_left``
        of the step; a new slot is filled in :meth:`update` before it is read)."""
        if not self.free:
            cap = self.table.shape[0]
            if cap >= max(MIN_SLOTS, SLOTS_PER_ROW * self.largest):
                idle = [k for k, s in self.slots.items() if s.used < self.step]
                if idle:
                    self._drop(min(idle, key=lambda k: self.slots[k].used))
            if not self.free:
                grown = max(MIN_SLOTS, 2 * cap, cap + rows_left)
                table = torch.empty(grown, self.vocab + 1, dtype=torch.int32, device=self.device)
                table[:cap] = self.table
                self.table = table
                self.free += range(grown - 1, cap - 1, -1)
        return self.free.pop()

    def update(self, t: dict[str, torch.Tensor]) -> None:
        """The uploaded arrays of :meth:`plan` applied to the table, on the device."""
        table = self.table
        if t["fresh_slots"].numel():
            slots = t["fresh_slots"]
            table.index_fill_(0, slots, 0)
            rows = slots.unsqueeze(1)
            # prompt ids set (a repeated id sets the same flag), then output ids counted
            table[rows.expand_as(t["fresh_prompt"]), t["fresh_prompt"]] = PROMPT_FLAG
            ones = torch.ones_like(t["fresh_output"], dtype=torch.int32)
            table.index_put_((rows.expand_as(t["fresh_output"]), t["fresh_output"]), ones, accumulate=True)
        if t["new_slots"].numel():
            table.index_put_((t["new_slots"], t["new_ids"]),
                             torch.ones_like(t["new_ids"], dtype=torch.int32), accumulate=True)

    def mask(self, slots: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) bool: the ids in each slot's prompt or output."""
        return self.table.index_select(0, slots)[:, :self.vocab] != 0

    def counts(self, slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(rows, vocab): each slot's output count of every id."""
        return (self.table.index_select(0, slots)[:, :self.vocab] & (PROMPT_FLAG - 1)).to(dtype)


def history_for(history: Optional[PenaltyHistory], vocab: int, device: torch.device) -> PenaltyHistory:
    """``history`` fitted to this step's logits, or (None) one for this step only."""
    return history.fit(vocab, device) if history is not None else PenaltyHistory(vocab, device)
