"""What the sampler needs of the model's tokenizer, in the process that samples (the
offline engine, an online pipeline's last stage): the structured-output masks
(:class:`~.grammar_masks.GrammarMasks`, built at their first need) and the token ids of
``bad_words``.

``bad_words`` follow vLLM (``SamplingParams.update_from_tokenizer`` and
``v1/sample/ops/bad_words.py``): each word, its leading whitespace stripped, is tokenized
without special tokens, and again after a space where that gives a different first token
and as many tokens; at each step, a sequence whose tokens but the last end the output so
far (the prompt does not count) has its last token banned (a one-token word is always
banned).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

from raycolo.generation.rows import SamplingRow

MAX_CACHED_WORD_SETS = 1024


class VocabRules:
    def __init__(self, tokenizer, vocab_size: int, grammar=None):
        """``tokenizer``: a raycolo tokenizer (:mod:`raycolo.engine.models`); ``vocab_size``:
        the logits' width; ``grammar``: the GrammarMasks to use (default: built at the first
        structured request)."""
        self.tokenizer, self.vocab = tokenizer, vocab_size
        self._grammar = grammar
        self._words: OrderedDict = OrderedDict()

    @property
    def grammar(self):
        if self._grammar is None:
            from raycolo.generation.grammar_masks import GrammarMasks
            self._grammar = GrammarMasks(self.tokenizer, self.vocab)
        return self._grammar

    def bitmask(self, rows: Sequence[SamplingRow]):
        """The structured rows' allowed-token bitmask and their indices (GrammarMasks.bitmask;
        None: no row constrained)."""
        if not any(r.params.structured_outputs is not None for r in rows):
            return None
        return self.grammar.bitmask(rows)

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The token sequences ``words`` ban (vLLM's rule, module docstring)."""
        cached = self._words.get(words)
        if cached is None:
            seqs: list[tuple[int, ...]] = []
            for word in words:
                plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
                spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
                seqs += [plain] if plain else []
                if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                    seqs.append(spaced)
            cached = self._words[words] = tuple(seqs)
            while len(self._words) > MAX_CACHED_WORD_SETS:
                self._words.popitem(last=False)
        self._words.move_to_end(words)
        return cached

    def banned(self, row: SamplingRow) -> list[int]:
        """The tokens ``row``'s bad words ban at this step."""
        out = list(row.output)
        ban = []
        for seq in self.bad_word_ids(row.params.bad_words):
            k = len(seq) - 1
            if k <= len(out) and (k == 0 or out[-k:] == list(seq[:-1])):
                ban.append(seq[-1])
        return ban


def rules_needed(rows: Sequence[SamplingRow], rules: Optional[VocabRules]) -> Optional[VocabRules]:
    """``rules``, checked present where a row needs them."""
    if rules is None and any(r.params.needs_vocabulary for r in rows):
        raise ValueError("structured_outputs, bad_words: this backend was given no tokenizer rules")
    return rules


def prefetched_rules(build: Callable[[], VocabRules]) -> Callable[[], VocabRules]:
    """``build`` (what makes a model's :class:`VocabRules`: its tokenizer) started now on a
    thread of its own, with xgrammar's view of the vocabulary (seconds for a 128k
    vocabulary, which a stage would otherwise spend inside the decode step of its first
    structured request). Calling the result waits for them; a failure is raised there, for
    the request that needs them (no xgrammar: bad words still work)."""
    import concurrent.futures

    def warm() -> VocabRules:
        import os
        import threading
        try:        # the lowest CPU priority (Linux: per thread): the stage's own work comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        rules = build()
        try:
            rules.grammar          # noqa: B018 - built now, off the decode step
        except ImportError:
            pass                   # no xgrammar: bad words still work; structured requests fail then
        return rules

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vocab-rules")
    future = pool.submit(warm)
    pool.shutdown(wait=False)
    return future.result
