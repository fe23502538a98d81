"""The generation routes' response bodies (``/v1/completions``, ``/v1/chat/completions``), as
the routes return them, so ``/openapi.json`` describes them truthfully: OpenAI's shapes and
vLLM's additions (``stop_reason``, and with ``return_token_ids`` the prompt's and each
choice's token ids). :mod:`.responses` fills them."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length", "tool_calls", "error"]]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[Optional[dict[str, float]]] = Field(description="each position's token and its most "
                                                           "likely ones (null where token_logprobs is)")
    text_offset: list[int]


class RankedLogprob(BaseModel):
    logprob: float
    rank: Optional[int] = Field(description="1: the most likely token at this position")
    decoded_token: str


PromptLogprobs = Optional[list[Optional[dict[str, RankedLogprob]]]]
PROMPT_LOGPROBS_HELP = ("vLLM's prompt_logprobs: per prompt token (the first null), token id -> its log-probability, "
                        "rank and text: the prompt's own token first, then the most likely ones")


class _Choice(BaseModel):
    """What every choice has: its index, why it ended, and vLLM's additions."""

    index: int = 0
    finish_reason: FinishReason
    stop_reason: Union[int, str, None] = Field(default=None, description="vLLM's: the stop string, or the id of a "
                                               "stop token other than the tokenizer's EOS, that ended it")
    token_ids: Optional[list[int]] = Field(default=None, description="vLLM's return_token_ids: the generated ids")


class CompletionChoice(_Choice):
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs: PromptLogprobs = Field(default=None, description=PROMPT_LOGPROBS_HELP)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, as JSON text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = Field(description="the text (null where the model only called tools)")
    tool_calls: Optional[list[ToolCallOut]] = Field(default=None, description="with tools: the calls read from "
                                                   "the text")
    reasoning: Optional[str] = Field(default=None, description="with the deployment's serve.reasoning_parser: the "
                                     "model's reasoning (vLLM's field)")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs: PromptLogprobs = Field(default=None, description=PROMPT_LOGPROBS_HELP)
