"""How a chat's choices are read before they are answered: reasoning split off first
(:mod:`.reasoning`, the deployment's ``serve.reasoning_parser``), then tool calls read from
the content (:mod:`.tool_calls`). One :class:`AnswerReader` per choice, fed its text
deltas, serves streamed answers; :func:`whole_message` reads a non-streamed choice the
same way (pure: no Ray, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.reasoning import ReasoningDelta, ReasoningParserKind, ReasoningReader
from raycolo.online.serving.tool_calls import ToolDelta, ToolParserKind, ToolReading, answer_content, join
from raycolo.online.serving.tool_protocol import ToolChoiceKind


@dataclass(frozen=True)
class AnswerReading:
    """What a request's choices are read for (both None: nothing; no reader is made)."""

    tools: Optional[ToolReading] = None
    reasoning: Optional[ReasoningParserKind] = None
    include_reasoning: bool = True       # vLLM's include_reasoning: false drops the reasoning

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    def reader(self) -> "AnswerReader":
        return AnswerReader(self)

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
    if reading.reasoning is not None:
        message["reasoning"] = "".join(d.reasoning for d in deltas) or None
        content = content or None                # vLLM: no content after the reasoning is null
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
    if reasoning_parser is not None and body.constraint() is not None:
        param = "tool_choice" if kind.forces_a_call else (
            "response_format" if body.response_format is not None else "structured_outputs")
        raise OpenAIError(400, f"{param}: this deployment reads reasoning (serve.reasoning_parser "
                          f"{reasoning_parser.value}), and a constraint on the text would bind the reasoning too "
                          "(vLLM applies it once the reasoning ends; not built in raycolo)", param=param,
                          code="invalid_parameter")
    tools = None
    if kind != ToolChoiceKind.NONE:
        named = body.tool_choice.function.name if kind == ToolChoiceKind.NAMED else None
        tools = ToolReading(kind, tool_parser if kind == ToolChoiceKind.AUTO else None, named, body.parallel_tool_calls)
    reading = AnswerReading(tools, reasoning_parser, body.include_reasoning)
    return reading if reading.active else None
