"""Token ids to text deltas, with stop strings.

:class:`TextStream` decodes the whole output each time and emits what is new, holding
back a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and, with stop strings,
the longest tail that could still become one, so no client ever sees a stop string or
half a character. A stop string ends the text just before it (vLLM's default,
``include_stop_str_in_output=False``).
"""
from __future__ import annotations

from typing import Optional, Sequence


def decode(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode`` for both tokenizer kinds raycolo loads."""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class TextStream:
    """Token ids in, text deltas out, stop strings honoured."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0                  # characters of the decoded text already emitted
        self.stopped: Optional[str] = None   # the stop string that ended the text

    def _decode(self) -> str:
        return decode(self.tokenizer, self.ids, self.skip_special_tokens)

    def add(self, token: int, check: bool = True) -> str:
        """The new text that ``token`` makes safe to send ('' while held back).
        ``check=False``: no stop string may end the text yet (before ``min_tokens``)."""
        if self.stopped is not None:
            return ""
        self.ids.append(token)
        text = self._decode()
        # an incomplete character decodes as U+FFFD until its other bytes come: not yet text
        # a stop string may match
        if check:
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
        text = self._decode()
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
