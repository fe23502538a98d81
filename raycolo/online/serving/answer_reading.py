"""How a chat's choices are read before they are answered: reasoning split off first
(:mod:`.reasoning`, the deployment's ``serve.reasoning_parser``), then tool calls read from
the content (:mod:`.tool_calls`). One :class:`AnswerReader` per choice, fed its text
deltas, serves streamed answers; :func:`whole_message` reads a non-streamed choice the
same way (pure: no Ray, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.reasoning import (ReasoningDelta, ReasoningParserKind, ReasoningReader, reasoning_ended,
                                              think_token_ids)
from raycolo.online.serving.tool_calls import ToolDelta, ToolParserKind, ToolReading, answer_content, join
from raycolo.online.serving.tool_protocol import ToolChoiceKind


@dataclass(frozen=True)
class AnswerReading:
    """What a request's choices are read for (both None: nothing; no reader is made)."""

    tools: Optional[ToolReading] = None
    reasoning: Optional[ReasoningParserKind] = None
    include_reasoning: bool = True       # vLLM's include_reasoning: false drops the reasoning
    constraint_after: Optional[int] = None   # the constraint binds after this token (bind_after_reasoning)

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    def reader(self) -> "AnswerReader":
        return AnswerReader(self)

    def sampling(self, params):
        """The request's SamplingParams as this reading needs them: a tool-call parser reads
        the model's call tokens (special or not, they stay in the text); a constraint binds
        after the reasoning (:func:`bind_after_reasoning`)."""
        update = {}
        if self.tools is not None and self.tools.parser is not None:
            update["skip_special_tokens"] = False
        if self.constraint_after is not None:
            update["structured_after_token"] = self.constraint_after
        return params.model_copy(update=update) if update else params

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
        self.reasoning = ReasoningReader(reading.reasoning) if reading.reasoning is not None else None
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
    if reading.reasoning is not None:       # vLLM's: "" for an empty reasoning, null for none
        thought = reader.reasoning.thought and reading.include_reasoning
        message["reasoning"] = "".join(d.reasoning for d in deltas) if thought else None
        if reading.tools is None or not reading.tools.kind.forces_a_call:
            content = content or None            # vLLM: no content after the reasoning is null (a forced call's: "")
    if reading.tools is not None:
        content = answer_content(reading.tools.kind, content, calls)
        message["tool_calls"] = calls
    message["content"] = content
    return message, bool(calls)


def chat_reading(body, tool_parser: Optional[ToolParserKind],
                 reasoning_parser: Optional[ReasoningParserKind]) -> Optional[AnswerReading]:
    """How a chat request's choices are read (None: as they are), given the deployment's
    parsers (``serve.tool_call_parser``, ``serve.reasoning_parser``); a 400 for what they
    cannot serve."""
    kind = body.tool_kind
    if kind == ToolChoiceKind.AUTO and tool_parser is None:
        raise OpenAIError(400, 'tool_choice: "auto" (the default when tools are given) needs the deployment\'s '
                          "serve.tool_call_parser (hermes, llama3_json or pythonic); this one reads no calls from "
                          'free text: ask for "none", "required" or a named function', param="tool_choice",
                          code="invalid_parameter")
    tools = None
    if kind != ToolChoiceKind.NONE:
        named = body.tool_choice.function.name if kind == ToolChoiceKind.NAMED else None
        tools = ToolReading(kind, tool_parser if kind == ToolChoiceKind.AUTO else None, named, body.parallel_tool_calls)
    reading = AnswerReading(tools, reasoning_parser, body.include_reasoning)
    return reading if reading.active else None


def constraint_param(body) -> str:
    """The field that carries a chat request's constraint (for its errors)."""
    if body.tool_kind.forces_a_call:
        return "tool_choice"
    return "response_format" if body.response_format is not None else "structured_outputs"


def bind_after_reasoning(reading: Optional[AnswerReading], body, tokenizer, ids) -> Optional[AnswerReading]:
    """``reading`` with where the request's constraint (a forced call's included) starts to
    bind, given its prompt ``ids``. With a reasoning parser, as vLLM does: after the reply's
    first ``</think>`` token, or from the start where the prompt ended the reasoning
    (:func:`~.reasoning.reasoning_ended`); the reasoning itself is never constrained. A
    400 naming the constraint's field where the tokenizer has no ``<think>``/``</think>``
    tokens."""
    if reading is None or reading.reasoning is None or body.constraint() is None:
        return reading
    try:
        open_id, close_id = think_token_ids(tokenizer)
    except ValueError as exc:
        param = constraint_param(body)
        raise OpenAIError(400, f"{param}: a constraint on a reasoning deployment (serve.reasoning_parser "
                          f"{reading.reasoning.value}) binds after </think>, and {exc}", param=param,
                          code="invalid_parameter") from None
    if reasoning_ended(ids, open_id, close_id):
        return reading
    return replace(reading, constraint_after=close_id)
