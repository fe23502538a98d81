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

As in vLLM, the grammar's end accepts the request's stop tokens (the model's EOS set and
``stop_token_ids``, with ``ignore_eos`` too); once a matcher has accepted one, the row is no
longer constrained. A token the grammar did not allow (only possible where another rule
masked every allowed token, e.g. ``min_tokens`` hiding the only stop token the finished
grammar allows) ends the constraint for that request, with a warning; so does a constraint
that does not compile for the model's vocabulary (it parsed when the request was made, so
this is xgrammar failing, not the request): a warning, never the batch's failure.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from raycolo.generation.rows import SamplingRow
from raycolo.generation.structured import StructuredOutputs, grammar

log = logging.getLogger(__name__)

MAX_MATCHERS = 4096          # requests whose matchers are kept between steps (least recently used dropped)
MAX_COMPILED = 256           # compiled constraints kept (least recently used dropped)
# A constraint's compiled grammar for the model's vocabulary at most this big (the HTTP front
# refuses larger ones before they reach a stage): compile time grows with it. On a 128k
# vocabulary json_object took 0.04 s and 0.5 MB; a 30-field schema 0.05 s and 0.5 MB; the
# regex [A-Za-z ,.]{1,100} 1.5 s and 27 MB, {1,400} 3.0 s and 38 MB (2-core CPU, 2026-11-30).
MAX_COMPILED_BYTES = 8 << 20


@dataclass
class _Track:
    constraint_key: tuple
    matcher: object
    consumed: list = field(default_factory=list)
    done: bool = False       # the grammar accepted a stop token, or refused a token: no mask any more


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's ``TokenizerInfo`` for a raycolo tokenizer (:mod:`raycolo.engine.models`):
    a checkpoint's transformers tokenizer, or one that lists its ids' bytes
    (``token_bytes``: the byte tokenizer)."""
    import xgrammar as xgr

    stops = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = tokenizer.token_bytes()[:vocab_size]
    return xgr.TokenizerInfo(vocab + [b""] * (vocab_size - len(vocab)), xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stops)


class GrammarMasks:
    """Allowed-token masks of the constrained rows of each batch, for one model."""

    def __init__(self, tokenizer, vocab_size: int, max_matchers: int = MAX_MATCHERS):
        import xgrammar as xgr

        self.vocab = vocab_size
        self.eos = frozenset(tokenizer.eos_token_ids)
        # raycolo keeps the compiled grammars (MAX_COMPILED, by use): xgrammar's own cache off,
        # or it would keep every grammar ever compiled (it is unbounded by default)
        self.compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1,
                                            cache_enabled=False)
        self.tracks: OrderedDict = OrderedDict()
        self.waiting: OrderedDict = OrderedDict()    # rows whose structured_after_token has not come: scanned
        self.compiled: OrderedDict = OrderedDict()
        self.lock = threading.Lock()     # compiled is shared with the threads that check sizes (the front's)
        self.max_matchers = max_matchers
        self.rebuilt = 0             # matchers built (a first step, or a replay): what tests watch

    def bitmask(self, rows: Sequence[SamplingRow]) -> Optional[tuple[torch.Tensor, list[int]]]:
        """The rows still constrained, and their masks: ((live rows, ceil(vocab / 32)) int32
        on the host, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed;
        the rows' indices in ``rows``); None where no row is constrained."""
        import xgrammar as xgr

        live = [(i, self._track(r)) for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        live = [(i, t) for i, t in live if t is not None and not t.done]
        if not live:
            return None
        mask = xgr.allocate_token_bitmask(len(live), self.vocab)
        # one row after another: xgrammar's BatchGrammarMatcher (rows on 2 threads) was slower on
        # this 2-core machine for every constraint of bench/structured.py (2026-11-30, docs/benchmarks.md)
        for j, (_, track) in enumerate(live):
            track.matcher.fill_next_token_bitmask(mask, j)
        return mask, [i for i, _ in live]

    def _track(self, row: SamplingRow) -> Optional[_Track]:
        """``row``'s matcher, fed its output (None: the constraint does not bind yet)."""
        constraint: StructuredOutputs = row.params.structured_outputs
        if row.key is None:
            raise ValueError("structured_outputs: a row without its request's key (SamplingRow.of(..., key=))")
        start = self._start(row)
        if start is None:
            return None
        # vLLM's: the grammar ends at the EOS set and the request's stop_token_ids, ignore_eos or not
        stops = tuple(sorted(self.eos | set(row.params.stop_token_ids)))
        identity = (constraint.key, stops, start)
        track = self.tracks.get(row.key)
        output = list(row.output[start:])
        if (track is None or track.constraint_key != identity or len(track.consumed) > len(output)
                or output[:len(track.consumed)] != track.consumed):
            track = self._new(row, constraint, identity, stops)
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

    def _start(self, row: SamplingRow) -> Optional[int]:
        """Where in ``row``'s output its constraint starts: 0, or with
        ``structured_after_token`` just past that token's first occurrence; None while it
        has not occurred (the row is not constrained yet). vLLM's rule with a reasoning
        parser: the grammar neither masks nor consumes the reasoning or its end token.
        Each step looks only at the tokens it has not looked at (a reasoning may be long)."""
        after = row.params.structured_after_token
        if after is None:
            return 0
        output = row.output
        track = self.tracks.get(row.key)
        if track is not None:       # found before: a resumed request's output keeps that prefix, or is shorter
            start = track.constraint_key[2]
            if 0 < start <= len(output) and output[start - 1] == after:
                return start
        scanned = self.waiting.pop(row.key, 0)
        try:
            return output.index(after, scanned if scanned <= len(output) else 0) + 1
        except ValueError:
            self.waiting[row.key] = len(output)
            while len(self.waiting) > self.max_matchers:
                self.waiting.popitem(last=False)
            return None

    def _new(self, row: SamplingRow, constraint: StructuredOutputs, identity: tuple, stops: tuple) -> _Track:
        import xgrammar as xgr

        try:        # checked when the request was made (structured.grammar, the front's vocabulary checks)
            matcher = xgr.GrammarMatcher(self.compile(constraint),
                                         override_stop_tokens=[t for t in stops if t < self.vocab] or None)
        except (RuntimeError, ValueError) as exc:    # never the batch's failure: this request goes unconstrained
            log.error("request %s: its %s constraint cannot be built for this vocabulary (%s); not constrained",
                      row.key, constraint.kind.value, exc)
            return _Track(identity, None, done=True)
        self.rebuilt += 1
        return _Track(identity, matcher)

    def compile(self, constraint: StructuredOutputs):
        """``constraint`` compiled for the vocabulary (kept: the :data:`MAX_COMPILED` last used)."""
        with self.lock:
            compiled = self.compiled.get(constraint.key)
            if compiled is None:
                compiled = self.compiled[constraint.key] = self.compiler.compile_grammar(grammar(constraint))
                while len(self.compiled) > MAX_COMPILED:
                    self.compiled.popitem(last=False)
            self.compiled.move_to_end(constraint.key)
            return compiled

    def check_size(self, constraint: StructuredOutputs, limit: int = MAX_COMPILED_BYTES) -> None:
        """ValueError where ``constraint`` compiles to more than ``limit`` bytes."""
        size = self.compile(constraint).memory_size_bytes
        if size > limit:
            raise ValueError(f"its grammar takes {size / 2 ** 20:.1f} MiB for this model's vocabulary, over the "
                             f"{limit / 2 ** 20:g} MiB it may (large counted repeats: prefer + or *)")


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bool on ``bitmask``'s device: the bits of :meth:`GrammarMasks.bitmask`
    (read a byte at a time: a byte per token in between, not four)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1     # little-endian words
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
