"""The OpenAI response bodies the HTTP front sends: choices, usage, log-probabilities and
server-sent-event chunks (pure: the ingress fills them with what generation produced).

* ``usage`` counts every generated token, the stop token included (vLLM's accounting,
  raycolo.generation.stops).
* Log-probabilities come in OpenAI's two shapes: the legacy completions one
  (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat one
  (``content[]`` of ``token``, ``logprob``, ``bytes``, ``top_logprobs``); a token's text as
  vLLM shows it (:mod:`.token_texts`); vLLM's ``prompt_logprobs`` (:func:`prompt_logprobs`).
* vLLM's extensions: every choice's ``stop_reason`` (the stop string, or the id of a stop
  token other than the tokenizer's own EOS, that ended it; None otherwise) and, with
  ``return_token_ids``, the ``prompt_token_ids`` and each choice's generated ``token_ids``
  (the stop token included); streamed, the prompt's ids come with a choice's first chunk
  and each chunk carries the ids its text came from.
"""
from __future__ import annotations

import json
from typing import NamedTuple, Optional, Sequence, Union

from raycolo.generation import FinishReason
from raycolo.online.serving.answer_reading import AnswerReading, whole_message
from raycolo.online.serving.token_texts import TokenTexts

StopReason = Union[int, str, None]


class ChoiceEvent(NamedTuple):
    """What one choice's generation gives the answer at a time: the text since the last
    event, the finish reason (None: not finished), tokens so far, the log-probabilities and
    token ids since the last event, and the stop reason once finished; on its first event,
    the prompt's log-probabilities where asked for (:mod:`raycolo.generation.prompt_scores`)."""

    delta: str
    finish: Optional[FinishReason]
    count: int
    lps: list
    ids: tuple = ()
    stop_reason: StopReason = None
    prompt: Optional[list] = None


class TokenFields(NamedTuple):
    """What an answer adds about tokens (vLLM's ``return_token_ids``,
    ``return_tokens_as_token_ids``)."""

    prompt_ids: Optional[list] = None      # None: no token ids in the answer
    as_ids: bool = False

    @property
    def asked(self) -> bool:
        """Whether the answer carries token ids."""
        return self.prompt_ids is not None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


LEAST_LOGPROB = -9999.0      # what an answer shows for -inf (vLLM's, as OpenAI's)


def _shown(logprob: float) -> float:
    return max(logprob, LEAST_LOGPROB)


def completion_logprobs(texts: TokenTexts, entries: Optional[Sequence]) -> Optional[dict]:
    """``entries``: raycolo.generation.sampler.TokenLogprob per token, or a token id alone
    (an echoed prompt's first token: no log-probability); None: not asked. A position's
    ``top_logprobs`` hold its token and the most likely ones (vLLM's, as OpenAI's)."""
    if entries is None:
        return None
    tokens, offsets, chosen, tops = [], [], [], []
    for e in entries:
        if isinstance(e, int):
            tokens.append(texts.alone(e))
            chosen.append(None)
            tops.append(None)
        else:
            rows = texts.entry(e, prompt=e.rank is not None)
            tokens.append(rows[0][1])
            chosen.append(_shown(e.logprob))
            tops.append({name: _shown(lp) for _, name, lp in rows})
        offsets.append(texts.place(tokens[-1]))
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(tokenizer, entries: Optional[Sequence]) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), its id's and the most
    likely ids' ``{"logprob", "rank", "decoded_token"}``, its own first."""
    if entries is None:
        return None
    texts, out = TokenTexts(tokenizer), []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {}
        for (t, name, lp), rank in zip(texts.entry(e, prompt=True), [e.rank, *range(1, len(e.top) + 1)]):
            ranked.setdefault(str(t), {"logprob": _shown(lp), "rank": rank, "decoded_token": name})
        out.append(ranked)
    return out


def chat_logprobs(texts: TokenTexts, entries: Optional[Sequence]) -> Optional[dict]:
    if entries is None:
        return None
    content = []
    for e in entries:
        one = [{"token": name, "logprob": _shown(lp), "bytes": list(name.encode("utf-8"))}
               for _, name, lp in texts.entry(e, prompt=False)]
        content.append({**one[0], "top_logprobs": one[1:]})
    return {"content": content}


def choice(tokenizer, chat: bool, index: int, whole: ChoiceEvent, tokens: TokenFields = TokenFields(),
           reading: Optional[AnswerReading] = None, echoed: str = "") -> dict:
    """One choice of a non-streamed answer (``whole``: its events joined; ``reading``: how
    a chat's text is read for reasoning and tool calls, None: it is not; ``echoed``: a
    chat's echo, put before the content as read)."""
    finish, texts = whole.finish, TokenTexts(tokenizer, tokens.as_ids)
    if chat:
        message = {"role": "assistant", "content": whole.delta}
        if reading is not None:
            fields, called = whole_message(reading, whole.delta)
            message.update(fields)
            finish = reading.finish_reason(called, finish)
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        out = {"index": index, "message": message, "logprobs": chat_logprobs(texts, whole.lps)}
    else:
        out = {"index": index, "text": whole.delta, "logprobs": completion_logprobs(texts, whole.lps)}
        if whole.prompt is not None:
            out["prompt_logprobs"] = prompt_logprobs(tokenizer, whole.prompt)
    out.update(finish_reason=finish, stop_reason=whole.stop_reason)
    if tokens.asked:
        out["token_ids"] = list(whole.ids)
        if not chat:
            out["prompt_token_ids"] = tokens.prompt_ids
    return out


class StreamInterval:
    """vLLM's ``--stream-interval`` rule for one streamed answer: the first tokens go out
    at once, then a chunk once ``every`` more tokens have come, and what is held at the
    end goes with the last chunk. ``every`` 1: a chunk per arrival, as before."""

    def __init__(self, every: int):
        self.every, self.sent = every, 0
        self.text: list[str] = []
        self.lps: list = []
        self.ids: list = []

    def add(self, delta: str, count: int, lps, final: bool = False, ids=()) -> Optional[tuple[str, list, list]]:
        """Hold ``delta``, ``lps`` and ``ids`` (``count``: tokens so far); the (text,
        log-probabilities, token ids) to send now, or None to keep holding."""
        self.text.append(delta)
        self.lps.extend(lps)
        self.ids.extend(ids)
        if not (final or self.sent == 0 or count - self.sent >= self.every):
            return None
        out = "".join(self.text), self.lps, self.ids
        self.text, self.lps, self.ids, self.sent = [], [], [], count
        return out


_HOLE = "\x00raycolo-text\x00"     # where a chunk's text goes in its pre-built line


class SseChunks:
    """The ``data: ...`` lines of one streamed answer (one choice). A text chunk, the
    line sent per token, is built once per answer: the line around its text is encoded
    ahead, and each chunk JSON-encodes only its text (the same bytes as encoding the whole
    line each time)."""

    def __init__(self, tokenizer, out_id: str, chat: bool, model: str, created: int, index: int = 0,
                 tokens: TokenFields = TokenFields()):
        """``index``: the choice's (n > 1 streams every choice in one answer); ``tokens``:
        the token ids asked for (the prompt's go with the first chunk after the role)."""
        self.tokenizer, self.out_id, self.chat, self.model, self.created = tokenizer, out_id, chat, model, created
        self.index, self.tokens, self.prompt_sent = index, TokenFields(), True
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        parts = self._build(_HOLE, None).split(json.dumps(_HOLE))      # the text chunk without token ids
        self._around = parts if len(parts) == 2 else None     # (a model name holding the hole: build)
        self.tokens, self.prompt_sent = tokens, not tokens.asked
        self.texts = TokenTexts(tokenizer, tokens.as_ids)    # the choice's log-probabilities, chunk after chunk

    def text(self, delta: str) -> str:
        """A chunk of text alone (no log-probabilities, not the last): ``chunk(delta, None)``."""
        if self._around is None:
            return self._build(delta, None)
        return self._around[0] + json.dumps(delta) + self._around[1]

    def _line(self, choices: list, extra: Optional[dict] = None) -> str:
        out = {"id": self.out_id, "object": self.kind, "created": self.created, "model": self.model,
               "choices": choices, **(extra or {})}
        return f"data: {json.dumps(out)}\n\n"

    def chunk(self, delta: Optional[str], finish: Optional[str], role: bool = False, lps=None, ids=None,
              stop_reason: StopReason = None, calls: Optional[list] = None, reasoning: str = "") -> str:
        """``calls``: tool call pieces (:class:`~.tool_calls.CallDelta`) of a chat;
        ``reasoning``: its reasoning text."""
        if delta and finish is None and not role and not lps and not self.tokens.asked and not calls \
                and not reasoning:
            return self.text(delta)
        return self._build(delta, finish, role, lps, ids, stop_reason, calls, reasoning)

    def _build(self, delta: Optional[str], finish: Optional[str], role: bool = False, lps=None, ids=None,
               stop_reason: StopReason = None, calls: Optional[list] = None, reasoning: str = "") -> str:
        extra = {}
        if self.chat:
            d = {"role": "assistant"} if role else ({} if delta is None else {"content": delta})
            if calls or reasoning:           # only what this piece holds
                d = {**({"reasoning": reasoning} if reasoning else {}), **({"content": delta} if delta else {}),
                     **({"tool_calls": [c.as_json() for c in calls]} if calls else {})}
            c = {"index": self.index, "delta": d,
                 "logprobs": chat_logprobs(self.texts, lps) if lps else None, "finish_reason": finish}
        else:
            c = {"index": self.index, "text": delta or "",
                 "logprobs": completion_logprobs(self.texts, lps) if lps else None,
                 "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        if self.tokens.asked and not role:
            c["token_ids"] = list(ids or ())
            if not self.prompt_sent:        # the prompt's ids once, with the choice's first chunk after the role
                self.prompt_sent = True
                if self.chat:
                    extra["prompt_token_ids"] = self.tokens.prompt_ids
                else:
                    c["prompt_token_ids"] = self.tokens.prompt_ids
        return self._line([c], extra)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        return self._line([], {"usage": usage(prompt_tokens, completion_tokens)})

    @staticmethod
    def error(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    DONE = "data: [DONE]\n\n"
