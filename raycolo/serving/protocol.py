"""The OpenAI-compatible request and response bodies, and raycolo's own routes' bodies.

Requests are validated strictly (a string where a number belongs is a 400 naming the
parameter, NaN and infinities are refused, bounds are explicit); unknown fields that
OpenAI clients send (``user``, ``logit_bias``...) are ignored. Supported sampling
parameters: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n = 1``, and
vLLM's ``ignore_eos``. Response models are what the routes return, so ``/openapi.json``
describes them truthfully.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

# Request limits (a stop list beyond these is refused with a 400 naming ``stop``).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_SEED = (1 << 63) - 1
MAX_TOKENS_LIMIT = 1 << 31
MAX_TRAIN_SAMPLES = 1024                      # per POST /v1/train_samples


def _whole(v):
    """JSON Schema counts 5.0 as an integer; so do we (5.5 and "5" stay errors)."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63 else v


WholeInt = Annotated[int, BeforeValidator(_whole)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: str = Field(min_length=1, max_length=512)
    max_tokens: Optional[WholeInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Optional[WholeInt] = Field(default=None, ge=0, le=MAX_SEED)
    stop: Optional[Union[str, list[str]]] = None
    n: WholeInt = Field(default=1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = Field(default=False, description="vLLM's extension: keep generating past EOS")

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        if stop is None:
            return stop
        items = [stop] if isinstance(stop, str) else stop
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in items:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string needs 1 to {MAX_STOP_CHARS} characters")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt (text, a list of one text, or token ids)."""

    prompt: Union[str, list[WholeInt], list[str]] = Field(description="a text, or token ids")
    echo: Literal[False] = Field(default=False, description="not supported (only false)")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("must not be empty")
            if isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ValueError("one prompt per request (n = 1, no batches)")
                return prompt[0]
            if any(t < 0 for t in prompt):
                raise ValueError("token ids must be >= 0")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[WholeInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length", "error"]]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


BASE_SUFFIX = "@base"          # <model>@base: the base model, without the adapter
VERSION_SUFFIX = "@v"          # <model>@v<k>: adapter checkpoint k, as it was saved
LATEST, BASE = "latest", "base"


def model_variant(name: str, served: str) -> Union[str, int, None]:
    """What a request's ``model`` names: ``"latest"`` (the served model, whose adapter
    follows retraining), ``"base"`` (``<served>@base``), an adapter version ``k``
    (``<served>@v<k>``), or None when it names nothing this server serves."""
    if name == served:
        return LATEST
    if name == served + BASE_SUFFIX:
        return BASE
    prefix = served + VERSION_SUFFIX
    digits = name[len(prefix):]
    if name.startswith(prefix) and digits.isascii() and digits.isdigit() and len(digits) <= 9 \
            and str(int(digits)) == digits:
        return int(digits)
    return None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raycolo"
    root: str
    parent: Optional[str] = None
    adapter: Literal["latest", "base", "version"] = Field(
        description="'latest' follows retraining; 'base' is the model without the adapter "
                    "(<model>@base); 'version' is a saved adapter checkpoint (<model>@v<k>)")
    adapter_version: Optional[int] = Field(default=None, description="k of <model>@v<k>")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- raycolo's routes -----------------------------------------------------------------------
class TrainSample(_Strict):
    """A training sample: ``prompt`` and ``completion`` texts; chat ``messages`` whose last
    message is the assistant's (the completion); or a preference pair, ``prompt`` with the
    ``chosen`` and the ``rejected`` completion (trained with the DPO loss against the
    frozen base)."""

    prompt: Optional[str] = None
    completion: Optional[str] = None
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=2)

    @property
    def is_pair(self) -> bool:
        return self.chosen is not None or self.rejected is not None

    @model_validator(mode="after")
    def _one_form(self):
        forms = [self.completion is not None, self.is_pair, self.messages is not None]
        if sum(forms) != 1 or (self.messages is not None and self.prompt is not None):
            raise ValueError("give prompt and completion, prompt with chosen and rejected, or messages")
        if forms[0] and (self.prompt is None or not self.completion):
            raise ValueError("prompt and a non-empty completion are both required")
        if self.is_pair and (self.prompt is None or not self.chosen or not self.rejected):
            raise ValueError("a preference pair needs prompt, and non-empty chosen and rejected")
        if self.is_pair and self.chosen == self.rejected:
            raise ValueError("chosen and rejected must differ")
        if self.messages is not None and self.messages[-1].role != "assistant":
            raise ValueError("the last message must be the assistant's (the completion)")
        return self


class TrainSamplesRequest(_Strict):
    samples: list[TrainSample] = Field(min_length=1, max_length=MAX_TRAIN_SAMPLES)


class EvalResponse(BaseModel):
    loss: Optional[float] = Field(default=None, description="mean next-token loss over the samples' "
                                  "completions, no training ((prompt, completion) samples)")
    win_rate: Optional[float] = Field(default=None, description="preference pairs: the fraction where the "
                                      "chosen completion is more probable than the rejected one")
    clpd: Optional[float] = Field(default=None, description="preference pairs: the mean log-probability "
                                  "of the chosen completion minus the rejected one's")
    samples: int
    adapter_version: int


class TrainSamplesResponse(BaseModel):
    ids: list[int] = Field(description="the samples' sequence numbers in the store")
    sequence: int = Field(description="the store's sequence number after this append (samples stored)")
    persisted: bool = Field(description="always true: fsynced before this answer")


class TrainStatus(BaseModel):
    received: int
    trained: int
    pending: int
    adapter_version: int
    last_checkpoint: Optional[dict] = None
    pinned_versions: list[int] = Field(default_factory=list,
                                       description="adapter versions servable as <model>@v<k>")
    resumed: Optional[dict] = Field(default=None, description="what this deployment took up from an earlier "
                                    "one on the same storage: adapter_version, samples_held, samples_resumed")


class Health(BaseModel):
    status: Literal["ok", "degraded", "starting"]
    nodes_alive: int
    nodes: int
    nodes_restarting: int = Field(default=0, description="nodes whose worker group is being restarted: "
                                  "alive, but given no new work until it is back")
