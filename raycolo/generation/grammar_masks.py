"""The per-token masks of structured outputs (:mod:`.structured`): which tokens each
constrained row of a batch may take next.

One :class:`GrammarMasks` per model, in the process that samples (the offline engine, an
online pipeline's last stage; :class:`~.vocab_rules.VocabRules` holds it). It compiles each constraint once for the model's
vocabulary (xgrammar's ``GrammarCompiler``, cached) and keeps a grammar matcher per
request. A matcher is derived from the row alone: the request's key, its constraint and
its output so far. It consumes the output tokens it has not seen, and is rebuilt and
replayed from the output where it is missing or disagrees (a request preempted, moved to
another stage process or resumed after a crash gets the same masks as one that never
left), so nothing about a request's grammar state has to travel or be saved.

As in vLLM, the grammar's end accepts the request's stop tokens (the model's EOS set unless
``ignore_eos``, and ``stop_token_ids``); once a matcher has accepted one, the row is no
longer constrained. A token the grammar did not allow (only possible where another rule
masked every allowed token, e.g. ``min_tokens`` hiding the only stop token the finished
grammar allows) ends the constraint for that request, with a warning; so does a constraint
that does not compile for the model's vocabulary (it parsed when the request was made, so
this is xgrammar failing, not the request): a warning, never the batch's failure.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from raycolo.generation.rows import SamplingRow
from raycolo.generation.structured import StructuredOutputs, grammar

log = logging.getLogger(__name__)

MAX_MATCHERS = 4096          # requests whose matchers are kept between steps (least recently used dropped)
MAX_COMPILED = 256           # compiled constraints kept (least recently used dropped)
BITS = 32                    # tokens per word of a bitmask (xgrammar's int32 words, lowest bit first)


@dataclass
class _Track:
    constraint_key: tuple
    matcher: object
    consumed: list = field(default_factory=list)
    done: bool = False       # the grammar accepted a stop token, or refused a token: no mask any more


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's ``TokenizerInfo`` for a raycolo tokenizer (:mod:`raycolo.engine.models`):
    a checkpoint's transformers tokenizer, or the byte tokenizer (its byte ids as raw
    bytes, its specials and unused ids matching nothing)."""
    import xgrammar as xgr

    stops = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
    from raycolo.engine.models import BYTE_OFFSET
    vocab = [b""] * vocab_size
    for b in range(256):
        vocab[BYTE_OFFSET + b] = bytes([b])
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)


class GrammarMasks:
    """Allowed-token masks of the constrained rows of each batch, for one model."""

    def __init__(self, tokenizer, vocab_size: int, max_matchers: int = MAX_MATCHERS):
        import xgrammar as xgr

        self.vocab = vocab_size
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1)
        self.tracks: OrderedDict = OrderedDict()
        self.compiled: OrderedDict = OrderedDict()
        self.max_matchers = max_matchers
        self.rebuilt = 0             # matchers built (a first step, or a replay): what tests watch

    def bitmask(self, rows: Sequence[SamplingRow]) -> Optional[torch.Tensor]:
        """(rows, ceil(vocab / 32)) int32 on the host: bit ``t % 32`` of word ``t // 32``
        set where token ``t`` is allowed (every bit of a row without a live constraint);
        None where no row is constrained."""
        import xgrammar as xgr

        live = [(i, self._track(r)) for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        live = [(i, t) for i, t in live if not t.done]
        if not live:
            return None
        mask = xgr.allocate_token_bitmask(len(rows), self.vocab)      # all allowed
        # one row after another: xgrammar's BatchGrammarMatcher (rows on 2 threads) was slower on
        # this 2-core machine for every constraint of bench/structured.py (2026-11-30, docs/benchmarks.md)
        for i, track in live:
            track.matcher.fill_next_token_bitmask(mask, i)
        return mask

    def _track(self, row: SamplingRow) -> _Track:
        constraint: StructuredOutputs = row.params.structured_outputs
        track = self.tracks.get(row.key)
        output = list(row.output)
        if (track is None or track.constraint_key != constraint.key or len(track.consumed) > len(output)
                or output[:len(track.consumed)] != track.consumed):
            track = self._new(row, constraint)
        self.tracks[row.key] = track
        self.tracks.move_to_end(row.key)
        while len(self.tracks) > self.max_matchers:
            self.tracks.popitem(last=False)
        for token in output[len(track.consumed):]:
            track.consumed.append(token)
            if track.done:
                continue
            if not track.matcher.accept_token(token):
                log.warning("request %s: token %d is outside its %s constraint; no longer constrained",
                            row.key, token, constraint.kind.value)
                track.done = True
            elif track.matcher.is_terminated():
                track.done = True
        return track

    def _new(self, row: SamplingRow, constraint: StructuredOutputs) -> _Track:
        import xgrammar as xgr

        stops = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else self.eos)
        compiled = self.compiled.get(constraint.key)
        if compiled is None:
            try:        # checked when the request was made (structured.grammar); only the vocabulary is new here
                compiled = self.compiler.compile_grammar(grammar(constraint))
            except (RuntimeError, ValueError) as exc:    # never the batch's failure: this request goes unconstrained
                log.error("request %s: its %s constraint does not compile for this vocabulary (%s); "
                          "not constrained", row.key, constraint.kind.value, exc)
                return _Track(constraint.key, None, done=True)
            self.compiled[constraint.key] = compiled
            while len(self.compiled) > MAX_COMPILED:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(constraint.key)
        self.rebuilt += 1
        return _Track(constraint.key, xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stops) or None))


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bool on ``bitmask``'s device: the bits of :meth:`GrammarMasks.bitmask`."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
