"""How a chat's choices are read before they are answered: reasoning split off first
(:mod:`.reasoning`, the deployment's ``serve.reasoning_parser``), then tool calls read from
the content (:mod:`.tool_calls`). One :class:`AnswerReader` per choice, fed its text
deltas, serves streamed answers; :func:`whole_message` reads a non-streamed choice the
same way (pure: no Ray, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.reasoning import (ReasoningDelta, ReasoningParserKind, ReasoningReader, reasoning_ended,
                                              think_tokens)
from raycolo.online.serving.tool_calls import (XML_PARSERS, ToolDelta, ToolParserKind, ToolReading, answer_content,
                                               join)
from raycolo.online.serving.tool_protocol import ToolChoiceKind


@dataclass(frozen=True)
class AnswerReading:
    """What a request's choices are read for (both None: nothing; no reader is made)."""

    tools: Optional[ToolReading] = None
    reasoning: Optional[ReasoningParserKind] = None
    include_reasoning: bool = True       # vLLM's include_reasoning: false drops the reasoning
    thinking: bool = True                # the reply begins in its reasoning (qwen3: enable_thinking)

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    def reader(self) -> "AnswerReader":
        return AnswerReader(self)

    def sampling(self, params):
        """The request's SamplingParams as this reading needs them: a tool-call parser reads
        the model's call tokens (special or not, they stay in the text)."""
        if self.tools is not None and self.tools.kind == ToolChoiceKind.AUTO:
            return params.model_copy(update={"skip_special_tokens": False})
        return params

    def finish_reason(self, called: bool, finish: Optional[str]) -> Optional[str]:
        return self.tools.finish_reason(called, finish) if self.tools is not None else finish


@dataclass
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)


class AnswerReader:
    def __init__(self, reading: AnswerReading):
        self.reading = reading
        self.reasoning = ReasoningReader(reading.reasoning, reading.thinking) if reading.reasoning is not None else None
        self.tools = reading.tools.reader() if reading.tools is not None else None

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> AnswerDelta:
        return self._on(self.reasoning.feed(text) if self.reasoning is not None else ReasoningDelta(content=text))

    def finish(self) -> AnswerDelta:
        out = self._on(self.reasoning.finish() if self.reasoning is not None else ReasoningDelta())
        if self.tools is not None:
            last = self.tools.finish()
            out.content += last.content
            out.calls += last.calls
        return out

    def _on(self, piece: ReasoningDelta) -> AnswerDelta:
        read = self.tools.feed(piece.content) if self.tools is not None else ToolDelta(piece.content)
        return AnswerDelta(piece.reasoning if self.reading.include_reasoning else "", read.content, read.calls)


def whole_message(reading: AnswerReading, text: str) -> tuple[dict, bool]:
    """A non-streamed chat choice's message fields (``content``, and ``reasoning`` and
    ``tool_calls`` where they are read) and whether it called a tool."""
    reader = reading.reader()
    deltas = [reader.feed(text), reader.finish()]
    content, calls = join(deltas)
    message: dict = {}
    if reading.reasoning is not None:
        thought = reader.reasoning.thought
        reasoning = "".join(d.reasoning for d in deltas)
        if reading.reasoning == ReasoningParserKind.QWEN3:
            reasoning = reasoning or None        # vLLM 0.32's: qwen3's empty reasoning is null, deepseek_r1's ""
        message["reasoning"] = reasoning if thought and reading.include_reasoning else None
        if thought and (reading.tools is None or not reading.tools.kind.forces_a_call):
            content = content or None            # vLLM: no content after the reasoning is null (a forced call's: "")
    if reading.tools is not None:
        content = answer_content(reading.tools.kind, content, calls)
        message["tool_calls"] = calls
    message["content"] = content
    return message, bool(calls)


def chat_reading(body, tool_parser: Optional[ToolParserKind], reasoning_parser: Optional[ReasoningParserKind],
                 tokenizer=None, ids=None) -> Optional[AnswerReading]:
    """How a chat request's choices are read (None: as they are), given the deployment's
    parsers (``serve.tool_call_parser``, ``serve.reasoning_parser``); a 400 for what they
    cannot serve. ``tokenizer`` and the prompt's ``ids``: a continued last message
    (``continue_final_message``) whose prompt ended the reasoning (Qwen3's template closes
    it before the assistant's text) is continued as content, as vLLM tells from the
    prompt (``is_reasoning_end``)."""
    kind = body.tool_kind
    if kind == ToolChoiceKind.AUTO and tool_parser is None:
        raise OpenAIError(400, 'tool_choice: "auto" (the default when tools are given) needs the deployment\'s '
                          f"serve.tool_call_parser ({', '.join(p.value for p in ToolParserKind)}); this one reads "
                          "no calls from "
                          'free text: ask for "none", "required" or a named function', param="tool_choice",
                          code="invalid_parameter")
    tools = None
    if kind != ToolChoiceKind.NONE:
        named = body.tool_choice.function.name if kind == ToolChoiceKind.NAMED else None
        # the deployment's parser for every kind: a forced call is read as JSON, but its id is the parser's
        # (mistral's templates take back only their own ids)
        schemas = {t.function.name: t.function.parameters for t in body.tools} if tool_parser in XML_PARSERS else None
        tools = ToolReading(kind, tool_parser, named, body.parallel_tool_calls, schemas)
    thinking = thinks(reasoning_parser, body)
    if thinking and reasoning_parser is not None and getattr(body, "continue_final_message", False) and ids:
        try:
            thinking = not reasoning_ended(ids, think_tokens(tokenizer, reasoning_parser), True)
        except ValueError:        # no <think> tokens: the reply is read as before
            pass
    reading = AnswerReading(tools, reasoning_parser, body.include_reasoning, thinking)
    return reading if reading.active else None


def constraint_param(body) -> str:
    """The field that carries a request's constraint (for its errors)."""
    if getattr(body, "tool_kind", ToolChoiceKind.NONE).forces_a_call:
        return "tool_choice"
    return "response_format" if body.response_format is not None else "structured_outputs"


def constraint_after(kind: Optional[ReasoningParserKind], body, tokenizer, ids) -> Optional[int]:
    """The token after whose first occurrence in the reply a request's constraint (a
    forced call's included) binds; None: from the start. With a reasoning parser, as
    vLLM 0.32 does: after the reply's first ``</think>``, unless the prompt ``ids`` ended
    the reasoning (:func:`~.reasoning.reasoning_ended`; Qwen3's parser also reads
    ``chat_template_kwargs.enable_thinking``) or the chat asked ``include_reasoning:
    false`` (then from the start); the reasoning itself is never constrained.
    Completions count as thinking chats. A 400 naming the constraint's field where the
    tokenizer has no ``<think>``/``</think>`` tokens."""
    if kind is None or not getattr(body, "include_reasoning", True):
        return None
    try:
        tags = think_tokens(tokenizer, kind)
    except ValueError as exc:
        param = constraint_param(body)
        raise OpenAIError(400, f"{param}: a constraint on a reasoning deployment (serve.reasoning_parser "
                          f"{kind.value}) binds after </think>, and {exc}", param=param,
                          code="invalid_parameter") from None
    return None if reasoning_ended(ids, tags, thinks(kind, body)) else tags.close


def thinks(kind: Optional[ReasoningParserKind], body) -> bool:
    """Whether a reply begins in its reasoning: always with ``deepseek_r1``; with ``qwen3``
    unless the chat's ``chat_template_kwargs.enable_thinking`` is false (vLLM 0.32's
    Qwen3 parser reads it so)."""
    return kind != ReasoningParserKind.QWEN3 or \
        (getattr(body, "chat_template_kwargs", None) or {}).get("enable_thinking", True) is not False
