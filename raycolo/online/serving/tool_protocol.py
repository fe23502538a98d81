"""Function calling on ``/v1/chat/completions``: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, the chat messages that carry calls and their results, and the
constraint a forced call puts on the text (OpenAI's shapes, vLLM's rules).

* ``tool_choice`` (:class:`ToolChoiceKind`): ``"none"`` (the tools are shown to the model,
  no call is read), ``"auto"`` (the model decides; its calls are read from its text by the
  deployment's ``serve.tool_call_parser``, :mod:`.tool_calls`), ``"required"`` (at least
  one call) or a named function (exactly that one). Left out, it is ``"auto"`` when
  ``tools`` are given, else ``"none"`` (OpenAI's and vLLM's default).
* A forced call is a structured output (:mod:`raycolo.generation.structured`): a named
  function's text is a JSON object following its ``parameters``; ``"required"``'s is a
  JSON array of ``{"name", "parameters"}`` objects, one of the tools each (at most one
  with ``parallel_tool_calls: false``): the schemas vLLM builds
  (``vllm/tool_parsers/utils.py``), so greedy calls equal vLLM's.
* Refused with a 400 naming the field: an empty ``tools``, two tools of one name, a
  ``tool_choice`` other than ``"none"`` without ``tools``, a named function that is not
  among them, a forced call together with ``structured_outputs`` or a JSON
  ``response_format`` (two constraints on one text), and a forced call whose schema
  xgrammar cannot build or would not enforce, or longer than a schema may be (``auto``
  and ``none`` take any parameters object, as OpenAI's and vLLM's servers do).
* Messages: a ``tool`` message carries a result (``content``, ``tool_call_id``); an
  ``assistant`` message may carry ``tool_calls`` (its ``content`` may then be null). The
  chat template gets each call's ``arguments`` as an object, not JSON text, as vLLM and
  transformers' tool-use templates expect (``arguments`` that are not a JSON object become
  ``{}``, as vLLM does, so one malformed turn does not fail every later one).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from raycolo.generation.structured import MAX_SCHEMA_CHARS, StructuredOutputs
from raycolo.online.serving.chat_messages import ChatMessage, Closed, Content, Text
from raycolo.text_enum import TextEnum

MAX_TOOLS = 128                        # OpenAI's limit on tools per request
MAX_TOOL_DESCRIPTION_CHARS = 1 << 14
FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"      # OpenAI's (letters, digits, _ and -), and vLLM's dots
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME)]
MAX_ARGUMENTS_CHARS = 1 << 20


class ToolChoiceKind(TextEnum):
    """What a request's ``tool_choice`` asks for."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"            # {"type": "function", "function": {"name": ...}}

    @property
    def forces_a_call(self) -> bool:
        """The text is constrained to a call (a named function, or "required")."""
        return self in (ToolChoiceKind.NAMED, ToolChoiceKind.REQUIRED)


class FunctionDefinition(Closed):
    name: FunctionName
    description: Optional[str] = Field(default=None, max_length=MAX_TOOL_DESCRIPTION_CHARS)
    parameters: Optional[dict[str, Any]] = Field(default=None, description="a JSON schema object: the "
                                                 "arguments a call passes (none: an empty object)")
    strict: Optional[bool] = Field(default=None, description="accepted; a forced call follows the schema always")

    def arguments_schema(self) -> dict:
        """The schema of a call's arguments (vLLM: missing parameters are an empty object)."""
        return self.parameters if self.parameters else {"type": "object", "properties": {}}


class Tool(Closed):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Closed):
    name: FunctionName


class NamedToolChoice(Closed):
    type: Literal["function"]
    function: NamedFunction


def _choice_form(choice) -> Optional[str]:
    return "{function}" if isinstance(choice, dict) else "[text]" if isinstance(choice, str) else None


# tagged by its form, so an error names the part at fault (param_path leaves the tags out)
ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("[text]")],
                             Annotated[NamedToolChoice, Tag("{function}")]],
                       Discriminator(_choice_form, custom_error_type="invalid_tool_choice",
                                     custom_error_message='must be "none", "auto", "required" or '
                                                          '{"type": "function", "function": {"name": ...}}')]


class CalledFunction(Closed):
    name: FunctionName
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS, description="the arguments, as JSON text")


class ToolCall(Closed):
    """A call an assistant message made (a request's history)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatTurn(ChatMessage):
    """A message of ``/v1/chat/completions`` (and ``/tokenize``'s chat): a tool's result
    (role ``tool``), or an assistant's turn that made ``tool_calls``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Content] = None
    tool_calls: Optional[list[ToolCall]] = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: Optional[str] = Field(default=None, max_length=256, description="the call a tool's result answers")
    reasoning: Optional[Text] = Field(default=None, description="an assistant's reasoning (vLLM's answers carry it; "
                                      "reasoning_content: its older name), given to the template as reasoning_content")
    reasoning_content: Optional[Text] = None

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message answers a call")
        if (self.reasoning is not None or self.reasoning_content is not None) and self.role != "assistant":
            raise ValueError("reasoning: only an assistant message carries reasoning")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: is required (only an assistant message with tool_calls may leave it out)")
        return self

    def template_dict(self) -> dict:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:
            out["reasoning_content"] = thought          # the name Qwen3's and DeepSeek's templates read
        if self.name is not None:
            out["name"] = self.name
        return out


def template_arguments(text: str) -> dict:
    """A call's ``arguments`` as the chat template gets them: the JSON object (``{}`` for
    text that is not one, as vLLM does)."""
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):       # deep nesting raises RecursionError
        return {}
    return value if isinstance(value, dict) else {}


def choice_kind(choice: Optional[ToolChoice], tools: Optional[list]) -> ToolChoiceKind:
    """What ``tool_choice`` asks for, its default applied."""
    if choice is None:
        return ToolChoiceKind.AUTO if tools else ToolChoiceKind.NONE
    if isinstance(choice, NamedToolChoice):
        return ToolChoiceKind.NAMED
    return ToolChoiceKind(choice)


def distinct_names(tools: Optional[list[Tool]]) -> Optional[list[Tool]]:
    """``tools``, refused (a ValueError) where two share a name."""
    names = [t.function.name for t in tools or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two tools are named {twice[0]!r}; names must differ")
    return tools


def check_tool_choice(choice: Optional[ToolChoice], tools: Optional[list[Tool]], constrained: bool) -> None:
    """vLLM's rules on ``tool_choice`` (a ValueError in words otherwise)."""
    kind = choice_kind(choice, tools)
    if kind != ToolChoiceKind.NONE and not tools:
        raise ValueError(f"{kind.value!r} needs tools")
    if kind == ToolChoiceKind.NAMED and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"the function {choice.function.name!r} is not among the tools")
    if kind.forces_a_call and constrained:
        raise ValueError("a forced tool call constrains the text already; give it or structured_outputs "
                         "(or a JSON response_format), not both")


def forced_call_constraint(choice: Optional[ToolChoice], tools: Optional[list[Tool]],
                           parallel: Optional[bool]) -> Optional[StructuredOutputs]:
    """The constraint a forced call puts on the text (None: none is forced): vLLM's
    schemas, so greedy calls equal vLLM's."""
    kind = choice_kind(choice, tools)
    if kind == ToolChoiceKind.NAMED:
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return _forced(tool.function.arguments_schema(), f"the parameters of {tool.function.name!r}")
    if kind != ToolChoiceKind.REQUIRED:
        return None
    items, defs = [], {}
    for t in tools:
        params = dict(t.function.arguments_schema())
        for name, schema in (params.pop("$defs", None) or {}).items():
            if defs.get(name, schema) != schema:
                raise ValueError(f"tools: two tools define $defs {name!r} differently, which one schema "
                                 "of calls cannot hold")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return _forced(schema, "the schema of the calls (every tool's parameters)")


def _forced(schema: dict, what: str) -> StructuredOutputs:
    """A forced call's constraint; what cannot be one is a ValueError naming tool_choice
    (checked only for a forced call: "auto" and "none" take any parameters, as OpenAI's
    and vLLM's servers do)."""
    try:
        return StructuredOutputs(json=schema)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err.get("type") == "string_too_long":
            msg = f"it is longer than the {MAX_SCHEMA_CHARS:,} characters a JSON schema may have"
        raise ValueError(f"tool_choice: cannot force a call: {what}: {msg}") from None


def template_tools(tools: Optional[list[Tool]]) -> Optional[list[dict]]:
    """The tools as the chat template gets them (None: no tools), as vLLM hands them over:
    ``description`` and ``parameters`` always (null where not given), ``strict`` where
    given, so a template that writes the tools out gives vLLM's prompt."""
    if not tools:
        return None
    return [{"type": "function", "function": {
        "name": t.function.name, "description": t.function.description, "parameters": t.function.parameters,
        **({"strict": t.function.strict} if t.function.strict is not None else {})}} for t in tools]
