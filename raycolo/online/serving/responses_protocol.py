"""The body of OpenAI's ``POST /v1/responses`` (the Responses API), and the chat request
it comes to.

raycolo serves a Responses request as the chat request it is equal to
(:meth:`ResponsesRequest.chat_body`), so rendering, sampling, tool calls, reasoning and
structured outputs are the chat route's, and then gives the answer in the Responses
shape (:mod:`.responses_api`). The body takes:

* ``input``: a text (one user message), or a list of items: messages (``role`` user,
  system, developer or assistant; ``content`` a text or ``input_text``/``output_text``
  parts), ``function_call`` items (an assistant's calls; consecutive ones, and one right
  after an assistant message, make one assistant turn), ``function_call_output`` items
  (the tool's result, a ``tool`` message) and ``reasoning`` items (their text goes to the
  next assistant turn as its reasoning; a call after reasoning of its own starts a new
  assistant turn; reasoning before another role's turn is dropped). Items an earlier
  response gave may be sent back as they came: their ``id``, ``annotations``,
  ``logprobs``, ``phase`` and ``encrypted_content`` are accepted and not used; a
  ``refusal`` part counts as text. An input that ends with an assistant's message whose
  ``status`` is ``in_progress`` or ``incomplete`` is continued (the chat's
  ``continue_final_message``), as vLLM does.
* ``instructions`` (a system message before the input), ``max_output_tokens``,
  ``temperature``, ``top_p``, ``tools`` (``{"type": "function", "name", "description",
  "parameters", "strict"}``), ``tool_choice`` (``auto``, ``none``, ``required`` or
  ``{"type": "function", "name"}``), ``parallel_tool_calls``, ``text.format`` (``text``,
  ``json_object`` or ``json_schema`` with ``name``, ``schema``, ``strict``,
  ``description``), ``stream``, ``metadata`` (given back in the answer), ``user``.
* ``store`` is accepted and nothing is stored (vLLM's default, too), so
  ``previous_response_id`` is a 400 naming it: send the whole conversation as ``input``.

Any other field is a 400 naming it, as on every route. Pure: no Ray.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from raycolo.generation.params import MAX_TOKENS_LIMIT
from raycolo.online.serving.chat_messages import Closed, Text, content_form
from raycolo.online.serving.openai_errors import OpenAIError, from_validation
from raycolo.online.serving.protocol import ChatCompletionRequest, ModelName, WholeInt
from raycolo.online.serving.tool_protocol import MAX_ARGUMENTS_CHARS, MAX_TOOLS, FunctionName

MAX_INPUT_ITEMS = 1024           # a conversation's items, at most
MAX_METADATA_KEYS = 16           # OpenAI's limit


class InputText(Closed):
    type: Literal["input_text", "output_text", "refusal"]
    text: Optional[Text] = None
    refusal: Optional[Text] = None          # a refusal part's text
    annotations: Optional[list] = None      # an earlier answer's, sent back: not used
    logprobs: Optional[list] = None

    @model_validator(mode="after")
    def _its_text(self):
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise ValueError(f"{field}: a {self.type} part needs its {field}")
        return self

    def value(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


Content = Annotated[Union[Annotated[Text, Tag("{text}")], Annotated[list[InputText], Tag("[parts]")]],
                    Discriminator(content_form, custom_error_type="invalid_content",
                                  custom_error_message="must be a text or a list of input_text parts")]


def _joined(content) -> str:
    return content if isinstance(content, str) else "".join(p.value() for p in content)


class MessageItem(Closed):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Optional[str] = None
    status: Optional[str] = None      # an assistant's in_progress or incomplete message is continued
    phase: Optional[str] = None       # an earlier answer's, sent back: not used

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(Closed):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: FunctionName
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(Closed):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Content
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return _joined(self.output)


class ReasoningText(Closed):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(Closed):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: Optional[list[ReasoningText]] = None
    id: Optional[str] = None
    status: Optional[str] = None
    encrypted_content: Optional[str] = None      # OpenAI's own reasoning, sent back: not used

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


def _item_type(item) -> Optional[str]:
    """The item's tag (``{type}``: a form, which an error's parameter path leaves out)."""
    if not isinstance(item, dict) or not isinstance(item.get("type", "message"), str):
        return None
    return "{" + item.get("type", "message") + "}"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("{message}")],
                            Annotated[FunctionCallItem, Tag("{function_call}")],
                            Annotated[FunctionCallOutputItem, Tag("{function_call_output}")],
                            Annotated[ReasoningItem, Tag("{reasoning}")]],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="must be a message, function_call, function_call_output "
                                                         "or reasoning item")]


# tagged by the form it has, so an error names the item at fault (the tags are no parameter)
Input = Annotated[Union[Annotated[Text, Tag("{text}")],
                        Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS), Tag("[parts]")]],
                  Discriminator(content_form, custom_error_type="invalid_input",
                                custom_error_message="must be a text or a list of items")]


class FunctionTool(Closed):
    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunctionChoice(Closed):
    type: Literal["function"]
    name: FunctionName


class TextFormat(Closed):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class TextOptions(Closed):
    format: Optional[TextFormat] = None


class ResponsesRequest(Closed):
    """POST /v1/responses (see the module docstring)."""

    model: ModelName
    input: Input
    instructions: Optional[Text] = None
    max_output_tokens: Optional[WholeInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[float] = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    tools: Optional[list[FunctionTool]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedFunctionChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    stream: bool = False
    store: Optional[bool] = Field(default=None, description="accepted; nothing is stored (vLLM's default too)")
    previous_response_id: Optional[str] = Field(default=None, description="refused: nothing is stored")
    metadata: Optional[dict[str, Annotated[str, Field(max_length=512)]]] = Field(default=None,
                                                                                 max_length=MAX_METADATA_KEYS)
    user: Optional[str] = None

    @model_validator(mode="after")
    def _nothing_stored(self):
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server stores no responses (store is off, as vLLM's "
                             "default); send the whole conversation as input")
        return self

    def messages(self) -> list[dict]:
        """The chat messages the input comes to (see the module docstring)."""
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        thought: Optional[str] = None      # reasoning items not yet given to an assistant turn
        for item in items:
            if isinstance(item, ReasoningItem):
                thought = (thought or "") + item.text()
                continue
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and not (thought is not None and "reasoning" in last):
                    last.setdefault("tool_calls", []).append(call)
                else:         # a new turn: no assistant turn before, or new reasoning after one that has its own
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                out.append({"role": item.role, "content": item.text()})
            if out[-1]["role"] == "assistant" and thought is not None:
                out[-1]["reasoning"], thought = thought, None
            elif out[-1]["role"] != "assistant":
                thought = None        # reasoning does not cross into another turn
        return out

    def continues(self) -> bool:
        """Whether the input ends with an assistant's unfinished message (``status``
        in_progress or incomplete), which the answer continues, as vLLM does."""
        last = self.input[-1] if isinstance(self.input, list) else None
        return isinstance(last, MessageItem) and last.role == "assistant" and last.status in ("in_progress",
                                                                                                "incomplete")

    def chat_body(self) -> dict:
        """The chat completions body this request is equal to."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.continues():
            body.update(add_generation_prompt=False, continue_final_message=True)
        for field, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls),
                             ("user", self.user)):
            if value is not None:
                body[field] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {k: v for k, v in (("name", fmt.name or "response"), ("schema", fmt.schema_),
                                        ("strict", fmt.strict), ("description", fmt.description)) if v is not None}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return body

    def chat_request(self) -> ChatCompletionRequest:
        """:meth:`chat_body` validated as the chat route validates it; a 400 naming this
        body's field where it breaks a rule (``messages`` is ``input``,
        ``max_completion_tokens`` is ``max_output_tokens``, ``response_format`` is
        ``text.format``)."""
        try:
            return ChatCompletionRequest.model_validate(self.chat_body())
        except ValidationError as exc:
            raise responses_error(from_validation(exc)) from None


# a chat field -> the Responses field it came from
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "structured_outputs": "text.format", "continue_final_message": "input"}


def responses_error(err: OpenAIError) -> OpenAIError:
    """A chat route's error, naming the Responses field the chat field came from."""
    head = (err.param or "").split(".")[0].split("[")[0]
    param = _RENAMED.get(head)
    if param is None:
        return err
    message = err.message.replace(err.param, param, 1) if err.message.startswith(err.param) else err.message
    return OpenAIError(err.status, message, param=param, code=err.code, headers=err.headers)


class ResponseObject(BaseModel):
    """The answer of POST /v1/responses (streamed: server-sent Responses events), as
    :mod:`.responses_api` builds it; the fields OpenAI's clients read, and more."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: Optional[dict[str, Any]] = None
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[dict[str, Any]] = None
