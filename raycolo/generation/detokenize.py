"""Token ids to text, incrementally, with stop strings: vLLM's detokenizer.

Generated text is what an incremental detokenizer emits token by token, never a
re-decode of the whole output: a checkpoint's fast tokenizer goes through ``tokenizers``'
``DecodeStream`` primed with the prompt's ids (what vLLM v1 does,
vllm/v1/engine/detokenizer.py), which holds back a decode that ends in an incomplete
character (U+FFFD) until its other bytes come, and never flushes it: an output whose last
bytes ``max_tokens`` cut off ends before them. Other tokenizers (raycolo's byte tokenizer,
slow ones) decode the whole output each time and follow the same rule: a trailing U+FFFD is
held back, and dropped at the end.

:class:`TextStream` adds stop strings: it holds back the longest tail that could still
become one, so no client ever sees a stop string or half a character, and a stop string
ends the text just before it (vLLM's default, ``include_stop_str_in_output=False``). With
``include_stop_str_in_output`` the text ends just after it, and nothing is held back (as
vLLM: the stop string is part of the text anyway).
:func:`finished_text` is the same text in one call.
"""
from __future__ import annotations

from typing import Optional, Sequence

INVALID_PREFIX = "Invalid prefix encountered"     # tokenizers' DecodeStream lost its state


class _StreamDecoder:
    """``tokenizers.decoders.DecodeStream`` over a transformers fast tokenizer."""

    def __init__(self, backend, prompt_ids: Sequence[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.backend, self.skip = backend, skip_special_tokens
        self.stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token: int) -> str:
        try:
            return self.stream.step(self.backend, int(token)) or ""
        except Exception as exc:        # as vLLM: start the stream again without the prefix
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=self.skip)
            return self.stream.step(self.backend, int(token)) or ""


class _WholeDecoder:
    """Any tokenizer with ``decode``: the whole output decoded each time, a trailing
    U+FFFD held back (what ``DecodeStream`` does, for a context-free decoder)."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.sent = 0

    def step(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd") or len(text) <= self.sent:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def decoder(tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
    """The incremental decoder of ``tokenizer`` (see the module's docstring)."""
    backend = getattr(getattr(tokenizer, "tok", None), "backend_tokenizer", None)
    if backend is not None:
        return _StreamDecoder(backend, prompt_ids, skip_special_tokens)
    return _WholeDecoder(tokenizer, skip_special_tokens)


def finished_text(tokenizer, ids: Sequence[int], prompt_ids: Sequence[int] = (),
                  skip_special_tokens: bool = True) -> str:
    """The text of a finished output ``ids``: what the incremental decoder emitted (for a
    whole-output decoder that is one decode, less a trailing U+FFFD)."""
    d = decoder(tokenizer, prompt_ids, skip_special_tokens)
    if isinstance(d, _WholeDecoder):
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
    return "".join(d.step(t) for t in ids)


class TextStream:
    """Token ids in, text deltas out, stop strings honoured."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), include_stop: bool = False):
        self.decoder = decoder(tokenizer, prompt_ids, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        # the longest tail that could still begin a stop string (nothing, when it is text anyway)
        self.hold = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.text = ""                 # what the decoder emitted so far
        self.sent = 0                  # characters of it already given out
        self.stopped: Optional[str] = None   # the stop string that ended the text

    def add(self, token: int, check: bool = True) -> str:
        """The new text that ``token`` makes safe to send ('' while held back).
        ``check=False``: no stop string may end the text yet (before ``min_tokens``)."""
        if self.stopped is not None:
            return ""
        before = len(self.text)
        self.text += self.decoder.step(token)
        if check:
            hit = self._stop_hit(before)
            if hit is not None:
                return hit
        end = len(self.text) - (self.hold if self.stop else 0)   # what could still begin a stop string
        if end <= self.sent:
            return ""
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def flush(self) -> str:
        """At the end of generation: the text held back for stop strings (a character
        still incomplete is not text). No stop string is searched here: every token's text
        was searched as it came, where ``min_tokens`` allowed."""
        if self.stopped is not None:
            return ""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta

    def _stop_hit(self, before: int) -> Optional[str]:
        """vLLM's rule (``check_stop_strings``): the first stop string, in the order given,
        with an occurrence that ends in the text added since ``before`` characters (text
        before ``min_tokens`` was never searched, and is not searched later). Returns the
        delta up to it (after it, with ``include_stop``) and the stream stops; or None."""
        for s in self.stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at < 0:
                continue
            self.stopped = s
            end = at + len(s) if self.include_stop else at
            delta = self.text[self.sent:end]
            self.sent = max(self.sent, end)
            return delta
        return None


def text_stream(tokenizer, params, prompt_ids: Sequence[int] = ()) -> TextStream:
    """The :class:`TextStream` of a request with these :class:`~.params.SamplingParams`."""
    return TextStream(tokenizer, params.stop, params.skip_special_tokens, prompt_ids,
                      params.include_stop_str_in_output)
