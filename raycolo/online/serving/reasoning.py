"""Reasoning read from a choice's text as it streams (vLLM's ``--reasoning-parser``): the
model's thinking, between ``<think>`` and ``</think>``, goes to the message's
``reasoning``; the rest is the content (pure: no Ray, no torch). One reader serves
streamed and whole answers, so both split the text the same way.

* ``deepseek_r1`` (DeepSeek-R1 and its distills, whose chat template opens ``<think>`` in
  the prompt): the reply is reasoning until ``</think>``; a ``<think>`` that opens the
  reply is dropped. A reply that never closes it is all reasoning (``content`` null).
* ``qwen3`` (Qwen3 and QwQ, which open ``<think>`` themselves): a reply that begins with
  ``<think>`` is reasoning until ``</think>``; any other reply is all content (Qwen3 with
  thinking off).

Content after ``</think>`` is kept as written. Streamed, a possible start of a tag is
held back until it is clear (no client sees half a tag). The tags must be in the text:
they are ordinary added tokens of these tokenizers (not special ones), so the default
``skip_special_tokens`` keeps them.

vLLM differences: a ``<think>`` in the middle of a ``deepseek_r1`` reply is text (vLLM's
whole-reply reader drops what precedes it, its streaming reader does not).
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def __init__(self, kind: ReasoningParserKind):
        self.kind = kind
        self.text = ""
        self.phase = "start"          # start: the reply's opening not read yet; then thinking or content
        self.thought = False          # the reply had a reasoning part (vLLM's reasoning "" rather than null)

    def _read(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self.phase == "start":
            if not final and THINK_OPEN.startswith(self.text):
                return out                         # perhaps the opening tag, not whole yet
            if self.text.startswith(THINK_OPEN):
                self.text, self.phase = self.text[len(THINK_OPEN):], "thinking"
            else:
                self.phase = "thinking" if self.kind == ReasoningParserKind.DEEPSEEK_R1 else "content"
        if self.phase == "thinking":
            self.thought = True
            at = self.text.find(THINK_CLOSE)
            if at < 0:
                keep = 0 if final else held_prefix(self.text, THINK_CLOSE)
                out.reasoning, self.text = self.text[:len(self.text) - keep], self.text[len(self.text) - keep:]
                return out
            out.reasoning, self.text, self.phase = self.text[:at], self.text[at + len(THINK_CLOSE):], "content"
        out.content, self.text = self.text, ""
        return out


def think_token_ids(tokenizer) -> tuple[int, int]:
    """The ids of ``<think>`` and ``</think>``; ValueError unless each is one token of
    ``tokenizer`` (vLLM's parsers need them so too)."""
    ids = []
    for tag in (THINK_OPEN, THINK_CLOSE):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"the tokenizer has no {tag} token (it is {len(encoded)} tokens)")
        ids.append(encoded[0])
    return ids[0], ids[1]


def reasoning_ended(ids, open_id: int, close_id: int) -> bool:
    """Whether ``ids`` end outside a reasoning block: the last of ``open_id`` and
    ``close_id`` in them is ``close_id`` (vLLM's ``is_reasoning_end``). A prompt that ends
    so (Qwen3 with ``enable_thinking`` off writes ``<think></think>`` into it) has its
    constraint bind the whole reply; any other binds only what follows the reply's first
    ``</think>``."""
    backwards = list(ids)[::-1]

    def last(token: int) -> int:        # counted from the end (C speed: prompts may be long)
        return backwards.index(token) if token in backwards else len(backwards)
    return last(close_id) < last(open_id)
