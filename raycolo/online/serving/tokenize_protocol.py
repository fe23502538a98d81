"""The bodies of vLLM's ``POST /tokenize`` and ``POST /detokenize`` (its names, fields and
defaults; ``vllm/entrypoints/serve/tokenize/protocol.py``).

``/tokenize`` takes a prompt (``add_special_tokens`` true by default: the ids the
completions route prefills) or a chat (``add_generation_prompt`` true, ``continue_final_message`` false and
``add_special_tokens`` false by default: the ids the chat route prefills, its template's
BOS included once, and its ``tools`` as the template shows them) and answers ``count``, ``max_model_len`` (the context raycolo
enforces), ``tokens`` and, with ``return_token_strs``, each token's string as the
tokenizer spells it. ``/detokenize`` takes ``tokens`` and answers the ``prompt`` they decode
to, special tokens included (as vLLM does). As on every route, a field raycolo does not
take is a 400 naming it.
"""
from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import BaseModel, Discriminator, Field, RootModel, Tag, field_validator

from raycolo.bounds import MAX_TOKENS
from raycolo.online.serving.chat_messages import TEMPLATE_KWARGS_HELP, ChatRendering, TemplateKwargs
from raycolo.online.serving.protocol import Closed, ModelName, Text
from raycolo.online.serving.tool_protocol import MAX_TOOLS, ChatTurn, Tool, distinct_names

PROMPT, CHAT = '{"prompt": ...}', '{"messages": [...]}'      # the body's forms (union tags)


class TokenizeCompletionRequest(Closed):
    model: Optional[ModelName] = None
    prompt: Text
    add_special_tokens: bool = Field(default=True, description="the tokenizer's special tokens (a BOS) too")
    return_token_strs: bool = False


class TokenizeChatRequest(ChatRendering):
    model: Optional[ModelName] = None
    messages: list[ChatTurn] = Field(min_length=1)
    tools: Optional[list[Tool]] = Field(default=None, min_length=1, max_length=MAX_TOOLS,
                                        description="the tools the chat template shows the model")
    _distinct_tools = field_validator("tools")(lambda cls, tools: distinct_names(tools))
    chat_template_kwargs: Optional[TemplateKwargs] = Field(default=None, description=TEMPLATE_KWARGS_HELP)
    add_special_tokens: bool = Field(default=False, description="the tokenizer's special tokens on top of "
                                                                "what the chat template writes")
    return_token_strs: bool = False


def _form(body) -> Optional[str]:
    if not isinstance(body, dict):
        return None
    return CHAT if "messages" in body else PROMPT


TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag(PROMPT)],
                                  Annotated[TokenizeChatRequest, Tag(CHAT)]],
                            Discriminator(_form, custom_error_type="invalid_body",
                                          custom_error_message='the body must be a JSON object with "prompt" '
                                                               'or "messages"')]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="the longest prompt plus output this deployment takes")
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(Closed):
    model: Optional[ModelName] = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: Text


class TokenizeBody(RootModel):
    """POST /tokenize: a prompt or a chat."""

    root: TokenizeRequest
