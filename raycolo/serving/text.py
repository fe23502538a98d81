"""Text in and out: chat rendering, incremental detokenization, stop strings.

* **Chat template.** A model whose tokenizer has a chat template renders messages with it
  (``apply_chat_template(..., add_generation_prompt=True)``). Otherwise, including the tiny
  byte-tokenizer models, raycolo's plain template is used::

      <|system|>
      You are terse.
      <|user|>
      Hello
      <|assistant|>

  Each message is ``<|role|>\\n`` + its text + ``\\n``; the prompt ends with
  ``<|assistant|>\\n``. Training samples given as ``messages`` are rendered the same way:
  every message but the last is the prompt, the last (the assistant's) the completion.
* **Streaming text.** :class:`TextStream` turns generated token ids into text deltas. It
  decodes the whole output each time and emits what is new, holding back a trailing
  incomplete UTF-8 sequence (decoded as U+FFFD) and, with stop strings, the longest tail
  that could still become one, so no client ever sees a stop string or half a character.
"""
from __future__ import annotations

from typing import Optional, Sequence

PLAIN_TEMPLATE_ROLES = ("system", "developer", "user", "assistant")


def render_plain(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(tokenizer, messages: Sequence[tuple[str, str]]) -> str:
    """The prompt text of a chat: the tokenizer's template where it has one, else the plain one."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        return hf.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                      tokenize=False, add_generation_prompt=True)
    return render_plain(messages)


def chat_sample(tokenizer, messages: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(prompt text, completion text) of a chat training sample."""
    return render_chat(tokenizer, messages[:-1]), messages[-1][1]


class TextStream:
    """Token ids in, text deltas out, stop strings honoured."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0                  # characters of the decoded text already emitted
        self.stopped: Optional[str] = None   # the stop string that ended the text

    def add(self, token: int) -> str:
        """The new text that ``token`` makes safe to send ('' while held back)."""
        if self.stopped is not None:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        # an incomplete character decodes as U+FFFD until its other bytes come: not yet text
        # a stop string may match
        hit = self._stop_hit(text[:-1] if text.endswith("\ufffd") else text)
        if hit is not None:
            return hit
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1                   # an incomplete character: wait for its other bytes
        if self.stop:
            end -= self.hold           # what could still begin a stop string
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever was held back (unless a stop string hit)."""
        if self.stopped is not None:
            return ""
        text = self.tokenizer.decode(self.ids)
        hit = self._stop_hit(text)
        if hit is not None:
            return hit
        delta = text[self.sent:]
        self.sent = len(text)
        return delta

    def _stop_hit(self, text: str) -> Optional[str]:
        """The delta up to the earliest stop string in ``text`` (and the stream stops), or
        None when no stop string is there."""
        if not self.stop:
            return None
        start = max(0, self.sent - self.hold)
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, self.stopped = min(hits)
        delta = text[self.sent:at]
        self.sent = max(self.sent, at)
        return delta


def encode_completion(tokenizer, text: str) -> list[int]:
    """A training completion's ids: the text without a leading BOS, ending with EOS (so the
    adapter learns where an answer stops)."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        ids = list(hf(text, add_special_tokens=False)["input_ids"])
    else:
        ids = tokenizer.encode(text)
        bos = getattr(tokenizer, "bos_token_id", None)
        if ids and ids[0] == bos:
            ids = ids[1:]
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + ([eos] if eos is not None else [])
