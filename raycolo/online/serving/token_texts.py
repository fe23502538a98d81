"""The text an answer shows for a token in its log-probabilities, as vLLM shows it.

A token decoded alone (special tokens kept) is its text, except where that ends in the
replacement character U+FFFD: a byte-level token holding part of a UTF-8 character. Then,
as vLLM 0.32 corrects it (``vllm/v1/engine/logprobs.py``), the token is decoded after the
1 to 4 tokens before it in its sequence, the text those tokens show already is taken off,
and what is left is its text; "" where the character is still incomplete after 4. The
sequence is the prompt's tokens for a prompt position (its first token aside) and the
completion's for a generated one: each decodes in its own context. With vLLM's
``return_tokens_as_token_ids`` every token is ``token_id:<id>``.

One :class:`TokenTexts` follows one choice through its answer, so a streamed choice's
chunks decode in the context of the chunks before, and its ``text_offset`` runs on from
one chunk to the next (vLLM's).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from raycolo.generation.rows import TokenLogprob

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4           # a UTF-8 character spans at most 4 bytes


class TokenTexts:
    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self.context: list[int] = []      # the sequence's last tokens (those the answer scored)
        self.prompt: Optional[bool] = None   # whether the context is the prompt's (None: none yet)
        self.offset = 0                   # the next token's text_offset

    def alone(self, token: int) -> str:
        """A token without a log-probability (an echoed prompt's first): decoded alone."""
        return f"token_id:{token}" if self.as_ids else self.tokenizer.decode([token], skip_special_tokens=False)

    def at(self, tokens: Sequence[int], prompt: bool) -> list[str]:
        """The texts of ``tokens``, alternatives at the sequence's next position (``prompt``:
        a prompt position's); call :meth:`advance` with the token the sequence took."""
        if prompt != self.prompt:
            self.context, self.prompt = [], prompt
        texts = [self.alone(t) for t in tokens]
        if not self.as_ids:
            texts = [self._corrected(t) if text.endswith(REPLACEMENT) else text for t, text in zip(tokens, texts)]
        return texts

    def advance(self, token: int) -> None:
        self.context = (self.context + [token])[-CONTEXT_TOKENS:]

    def entry(self, e: TokenLogprob, prompt: bool) -> list[tuple[int, str, float]]:
        """A log-probability entry's (id, text, log-probability) rows: the token the sequence
        took first, then its most likely ones; the sequence moves on past the token."""
        ids = [e.token, *(t for t, _ in e.top)]
        rows = list(zip(ids, self.at(ids, prompt), [e.logprob, *(lp for _, lp in e.top)]))
        self.advance(e.token)
        return rows

    def place(self, text: str) -> int:
        """``text``'s offset in the answer's text of tokens (the next one's starts after it)."""
        at, self.offset = self.offset, self.offset + len(text)
        return at

    def _corrected(self, token: int) -> str:
        decode = self.tokenizer.decode
        for n in range(1, len(self.context) + 1):
            context = self.context[-n:]
            full = decode(context + [token])
            if full.endswith(REPLACEMENT):
                continue
            clean = len(context)         # context tokens that are themselves incomplete bytes count as this one's
            while clean > 0 and decode([context[clean - 1]]).endswith(REPLACEMENT):
                clean -= 1
            prefix = decode(context[:clean]) if clean else ""
            return full[len(os.path.commonprefix([prefix, full])):]
        return ""
