"""Reasoning read from a choice's text as it streams (vLLM's ``--reasoning-parser``): the
model's thinking, between ``<think>`` and ``</think>``, goes to the message's
``reasoning``; the rest is the content (pure: no Ray, no torch). One reader serves
streamed and whole answers, so both split the text the same way. Both parsers follow
vLLM 0.32's:

* ``deepseek_r1`` (DeepSeek-R1 and its distills, whose chat template opens ``<think>`` in
  the prompt): the reply is reasoning until ``</think>``; a ``<think>`` that opens the
  reply is dropped. A reply that never closes it is all reasoning (``content`` null); an
  empty reasoning is ``""``.
* ``qwen3`` (Qwen3, QwQ; their templates open ``<think>`` in the prompt or let the model
  write it): with thinking on (the default) the reply is reasoning until ``</think>``,
  every ``<think>`` in it dropped; an empty reasoning is null. With the chat's
  ``chat_template_kwargs.enable_thinking`` false, the whole reply is content, as written.

Content after ``</think>`` is kept as written. Streamed, a possible start of a tag is
held back until it is clear (no client sees half a tag). The tags must be in the text:
they are ordinary added tokens of these tokenizers (not special ones), so the default
``skip_special_tokens`` keeps them.

vLLM differences: a ``<think>`` in the middle of a ``deepseek_r1`` reply is text (vLLM's
whole-reply reader drops what precedes it, its streaming reader does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raycolo.online.serving.tool_calls import TextReader, held_prefix
from raycolo.text_enum import TextEnum

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParserKind(TextEnum):
    """How a reply's reasoning is told from its content (vLLM's parser names)."""

    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningReader(TextReader):
    """One choice's text split into reasoning and content: :meth:`feed` each delta, then
    :meth:`finish`."""

    def __init__(self, kind: ReasoningParserKind, thinking: bool = True):
        self.kind = kind
        self.text = ""
        # deepseek_r1 starts by reading the reply's opening; qwen3 thinks, or with thinking off is all content
        self.phase = "start" if kind == ReasoningParserKind.DEEPSEEK_R1 else "thinking" if thinking else "content"
        self.thought = False          # the reply had a reasoning part (deepseek_r1's "" rather than null)

    def _read(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        qwen3 = self.kind == ReasoningParserKind.QWEN3
        if self.phase == "start":
            if not final and THINK_OPEN.startswith(self.text):
                return out                         # perhaps the opening tag, not whole yet
            self.text, self.phase = self.text.removeprefix(THINK_OPEN), "thinking"
        if self.phase == "thinking":
            self.thought = True
            if qwen3:
                self.text = self.text.replace(THINK_OPEN, "")
            at = self.text.find(THINK_CLOSE)
            if at < 0:
                keep = 0 if final else max(held_prefix(self.text, THINK_CLOSE),
                                           held_prefix(self.text, THINK_OPEN) if qwen3 else 0)
                out.reasoning, self.text = self.text[:len(self.text) - keep], self.text[len(self.text) - keep:]
                return out
            out.reasoning, self.text, self.phase = self.text[:at], self.text[at + len(THINK_CLOSE):], "content"
        out.content, self.text = self.text, ""
        return out


# where vLLM 0.32's qwen3 parser stops looking back through a prompt for the reasoning's state
TURN_BOUNDARIES = {ReasoningParserKind.QWEN3: ("<|im_start|>", "<|im_end|>")}


@dataclass(frozen=True)
class ThinkTokens:
    """A tokenizer's reasoning tags and its parser's turn boundaries, as token ids."""

    open: int
    close: int
    boundaries: frozenset = frozenset()


def _token_id(hf, tag: str) -> Optional[int]:
    token = hf.convert_tokens_to_ids(tag)
    return token if isinstance(token, int) and hf.convert_ids_to_tokens(token) == tag else None


def think_tokens(tokenizer, kind: ReasoningParserKind) -> ThinkTokens:
    """``<think>``, ``</think>`` (and the kind's turn boundaries, where the vocabulary has
    them) as the vocabulary's token ids, as vLLM's parsers look them up; ValueError where
    a tag is no token of ``tokenizer``."""
    hf = getattr(tokenizer, "tok", None)
    ids = []
    for tag in (THINK_OPEN, THINK_CLOSE):
        token = _token_id(hf, tag) if hf is not None else None
        if token is None:
            raise ValueError(f"the tokenizer has no {tag} token")
        ids.append(token)
    boundaries = [_token_id(hf, tag) for tag in TURN_BOUNDARIES.get(kind, ())]
    return ThinkTokens(ids[0], ids[1], frozenset(b for b in boundaries if b is not None))


def reasoning_ended(ids, tags: ThinkTokens, thinking: bool = True) -> bool:
    """Whether ``ids`` (a prompt) end outside a reasoning block, as vLLM 0.32's parsers
    tell (``is_reasoning_end``): looking back, ``</think>`` first says ended, ``<think>``
    first says not, and a turn boundary first (or neither) says ended only where the
    model is not ``thinking`` (Qwen3's ``enable_thinking: false``). A prompt that ended its
    reasoning (Qwen3's template with thinking off writes ``<think></think>`` into it) has
    its constraint bind the whole reply; any other binds only what follows the reply's
    first ``</think>``."""
    backwards = list(ids)[::-1]

    def last(token: int) -> int:        # counted from the end (C speed: prompts may be long)
        return backwards.index(token) if token in backwards else len(backwards)
    close, opened = last(tags.close), last(tags.open)
    boundary = min((last(b) for b in tags.boundaries), default=len(backwards))
    first = min(close, opened, boundary)
    if first < len(backwards) and first in (close, opened):
        return first == close
    return not thinking                    # a turn boundary first, or no tag at all
