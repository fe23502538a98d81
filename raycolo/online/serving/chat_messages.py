"""Text a request tokenizes, and chat messages: the parts every generation, tokenizer and
training body shares (strict: a field raycolo does not take is a 400 naming it). The chat
route's messages, which may also carry tool calls and their results, extend
:class:`ChatMessage` (:class:`raycolo.online.serving.tool_protocol.ChatTurn`)."""
from __future__ import annotations

import functools
import inspect
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


def unicode_text(text: str) -> str:
    """Text a tokenizer can take: JSON's ``"\\ud800"`` parses to a lone UTF-16 surrogate,
    which no tokenizer encodes (it was a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(unicode_text)]      # what is tokenized: prompts, messages, samples


MAX_TEMPLATE_KWARGS = 32
# transformers' apply_chat_template's own parameters and the variables it sets: a request's
# chat_template_kwargs are template variables, never a change to how the chat is rendered or tokenized
TEMPLATE_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@functools.cache
def renderer_parameters() -> frozenset:
    """:data:`TEMPLATE_PARAMETERS` and whatever parameters the installed transformers'
    ``apply_chat_template`` and template renderer take besides (a newer release's too)."""
    names = set(TEMPLATE_PARAMETERS)
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return frozenset(names)
    for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        names.update(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self")
    return frozenset(names)


def _texts(value) -> None:
    """Every string in a JSON value (keys too) checked as :func:`unicode_text` does."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            unicode_text(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def template_kwargs(kwargs: Optional[dict]) -> Optional[dict]:
    """A request's ``chat_template_kwargs`` (vLLM's): at most :data:`MAX_TEMPLATE_KWARGS`
    variables, each named as a template variable is and none of the renderer's own
    parameters (:func:`renderer_parameters`), whose texts a tokenizer can take."""
    if kwargs is None:
        return None
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} template variables")
    for key in kwargs:
        if not key.isidentifier():
            raise ValueError(f"{key[:40]!r} is not a template variable's name")
        if key in renderer_parameters():
            raise ValueError(f"{key!r} is the chat route's or the template renderer's own, not a template variable")
    _texts(kwargs)
    return kwargs


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(template_kwargs)]
TEMPLATE_KWARGS_HELP = ("variables the chat template sees besides the messages (vLLM's), e.g. "
                        '{"enable_thinking": false} for Qwen3')


class Closed(BaseModel):
    """A generation request's parts: a field raycolo does not support is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(Closed):
    type: Literal["text"]
    text: Text


def content_form(content) -> Optional[str]:
    """The union tag of a text-or-list field: ``{text}`` or ``[parts]`` (tags no error names)."""
    return "{text}" if isinstance(content, str) else "[parts]" if isinstance(content, list) else None


# tagged by the form it has, so an error names the part at fault (the tags are no parameter)
Content = Annotated[Union[Annotated[Text, Tag("{text}")], Annotated[list[TextPart], Tag("[parts]")]],
                    Discriminator(content_form, custom_error_type="invalid_content",
                                  custom_error_message="must be a text or a list of text parts")]


class ChatMessage(Closed):
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_dict(self) -> dict:
        """The message as a chat template gets it."""
        return {"role": self.role, "content": self.text()}


class ChatRendering(Closed):
    """How a chat becomes its prompt (vLLM's fields, defaults and rule; the chat route's and
    ``/tokenize``'s): with ``add_generation_prompt`` the prompt ends with the assistant's
    turn opened; with ``continue_final_message`` it ends inside the last message, left
    open for the model to continue (an assistant's prefill: transformers'
    ``apply_chat_template(continue_final_message=True)``). The two exclude each other. A
    subclass has ``messages``."""

    add_generation_prompt: bool = Field(default=True, description="end with the assistant's turn opened")
    continue_final_message: bool = Field(default=False, description=(
        "end inside the last message, left open for the model to continue (a prefill); needs "
        "add_generation_prompt: false"))

    @model_validator(mode="after")
    def _continue_rule(self):
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message: needs add_generation_prompt: false (vLLM's rule)")
            if not self.messages[-1].text():
                raise ValueError("continue_final_message: the last message has no text to continue")
        return self
