"""The OpenAI-compatible request and response bodies, and raycolo's own routes' bodies.

Requests are validated strictly (a string where a number belongs is a 400 naming the
parameter, NaN and infinities are refused, bounds are explicit). No request field is
silently ignored: a generation request takes what vLLM's OpenAI server takes of
:class:`raycolo.generation.SamplingParams` (``max_tokens``, ``min_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``skip_special_tokens``, the repetition, presence and frequency
penalties, ``min_p``, ``logit_bias``, ``logprobs``/``top_logprobs``, ``n``, ``bad_words``,
``allowed_token_ids``, ``structured_outputs`` and OpenAI's ``response_format``), ``stream``
and ``stream_options``, vLLM's ``return_token_ids`` and ``return_tokens_as_token_ids``, and
``user`` (recorded nowhere, as in vLLM); any other field is a 400 naming it. Bounds are
the generation module's (declared once there); ``temperature`` keeps OpenAI's [0, 2].
Response models are what the routes return, so ``/openapi.json`` describes them truthfully.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      ValidationInfo, field_validator, model_validator)

from raycolo.generation import SamplingParams
# the parts of messages every body shares, where they were before (raycolo.online.serving.chat_messages)
from raycolo.online.serving.chat_messages import ChatMessage, Closed, Text, TextPart, unicode_text  # noqa: F401
from raycolo.online.serving.chat_messages import TEMPLATE_KWARGS_HELP, ChatRendering, TemplateKwargs
from raycolo.generation.structured import StructuredOutputs
from raycolo.online.serving.structured_protocol import ResponseFormat, one_constraint
from raycolo.online.serving.tool_protocol import (MAX_TOOLS, ChatTurn, Tool, ToolChoice, ToolChoiceKind,
                                                  check_tool_choice, choice_kind, distinct_names,
                                                  forced_call_constraint)
# the generation routes' responses, where they were before (raycolo.online.serving.generation_responses)
from raycolo.online.serving.generation_responses import (  # noqa: F401
    AssistantMessage, ChatChoice, ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionResponse, FinishReason, TopLogprob, Usage)
# raycolo's own routes' bodies, where they were before (raycolo.online.serving.training_protocol)
from raycolo.online.serving.training_protocol import (  # noqa: F401
    MAX_TRAIN_SAMPLES, SAMPLES_LIST, SAMPLES_OBJECT, EvalResponse, Health, TrainSample, TrainSamplesBody,
    TrainSamplesRequest, TrainSamplesResponse, TrainStatus)
from raycolo.generation.params import (MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS_TOKENS, MAX_SEED, MAX_STOP_TOKEN_IDS,
                                       MAX_TOKENS_LIMIT, LogitBias, LogprobCount, MinP, MinTokens, Penalty,
                                       RepetitionPenalty, TopK, TopP, bad_word_list, no_min_tokens_with_a_grammar,
                                       nonnegative_ids, stop_strings)

MAX_CHOICES = 16                              # n
MAX_PROMPTS = 64                              # prompts of one completions request (a batch)
MAX_BATCH_CHOICES = 128                       # a completions batch's choices: prompts x n
ModelName = Annotated[str, Field(min_length=1, max_length=512)]     # a served model's (or adapter's) name


def _whole(v):
    """JSON Schema counts 5.0 as an integer; so do we (5.5 and "5" stay errors)."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63 else v


WholeInt = Annotated[int, BeforeValidator(_whole)]


# raycolo.generation's int fields (their bounds declared there once), taking 5.0 as 5
WholeMinTokens = Annotated[MinTokens, BeforeValidator(_whole)]
WholeTopK = Annotated[TopK, BeforeValidator(_whole)]
WholeLogprobCount = Annotated[LogprobCount, BeforeValidator(_whole)]


class StreamOptions(Closed):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: ModelName
    max_tokens: Optional[WholeInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    min_tokens: WholeMinTokens = Field(default=0, description="vLLM's extension: no stop before this many tokens")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)    # OpenAI's range
    top_p: TopP = 1.0
    top_k: WholeTopK = Field(default=0, description="vLLM's extension: 0 or -1 for all tokens")
    seed: Optional[WholeInt] = Field(default=None, ge=0, le=MAX_SEED)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[WholeInt]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS,
                                                     description="vLLM's extension")
    n: WholeInt = Field(default=1, ge=1, le=MAX_CHOICES, description="choices per request (each with its own "
                        "seed: seed + i; streamed, their chunks interleave under their index)")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = Field(default=False, description="vLLM's extension: keep generating past every EOS id")
    skip_special_tokens: bool = Field(default=True, description="vLLM's extension")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM's extension: the text ends after "
                                                                        "the stop string that ended it")
    repetition_penalty: RepetitionPenalty = Field(default=1.0, description="vLLM's extension")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    min_p: MinP = Field(default=0.0, description="vLLM's extension: a drawn token's probability must be at "
                                                 "least this times the most likely token's (0: off)")
    logit_bias: Optional[dict[str, LogitBias]] = Field(
        default=None, max_length=MAX_LOGIT_BIAS_TOKENS,
        description="token id (its decimal string, as OpenAI's) -> a bias in [-100, 100], added to the logits "
                    "before anything else; -100 bans a token, 100 all but forces it")
    bad_words: Optional[list[str]] = Field(default=None, description="vLLM's extension: words the text never "
                                           "contains")
    allowed_token_ids: Optional[list[WholeInt]] = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
                                                        description="vLLM's extension: the only ids the output takes")
    return_token_ids: Optional[bool] = Field(default=None, description="vLLM's extension: the prompt's and "
                                             "each choice's token ids in the answer")
    return_tokens_as_token_ids: Optional[bool] = Field(default=None, description="vLLM's extension: log-"
                                                       "probabilities name tokens as 'token_id:<id>'")
    response_format: Optional[ResponseFormat] = Field(default=None, description="json_object or json_schema: "
                                                      "the text follows it (text: no constraint)")
    structured_outputs: Optional[StructuredOutputs] = Field(default=None, description="vLLM's extension: exactly "
                                                            "one of json, regex, choice, grammar, json_object")
    prompt_logprobs: Optional[WholeLogprobCount] = Field(default=None, description="vLLM's extension: each prompt "
                                                         "token's log-probability and rank, and this many most "
                                                         "likely tokens' at each position (not with stream)")
    user: Optional[str] = Field(default=None, max_length=512, description="accepted, recorded nowhere")

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stop_strings(stop)
        return stop

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _stop_ids(cls, ids):
        return nonnegative_ids(ids)

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, words):
        bad_word_list(words)
        return words

    @model_validator(mode="after")
    def _constraints(self):
        no_min_tokens_with_a_grammar(self.min_tokens, self.constraint() is not None)
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream (vLLM's rule)")
        return self

    def constraint(self) -> Optional[StructuredOutputs]:
        """The one constraint on the request's text (None: none)."""
        return one_constraint(self.response_format, self.structured_outputs)

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, bias):
        for key in bias or ():
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise ValueError(f"keys are token ids (decimal integers >= 0), not {key[:20]!r}")
        return bias

    def bias_ids(self) -> dict[int, float]:
        """``logit_bias`` keyed by token id."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def top_logprobs_asked(self) -> Optional[int]:
        """How many top log-probabilities per token (None: no log-probabilities)."""
        return None

    def prompt_logprobs_asked(self) -> Optional[int]:
        """How many top log-probabilities per prompt token (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, seed: int) -> SamplingParams:
        """The one SamplingParams of this request (raycolo.generation)."""
        return SamplingParams(max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=seed, stop=self.stop_list(),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logprobs=self.top_logprobs_asked(),
                              prompt_logprobs=self.prompt_logprobs_asked(),
                              min_p=self.min_p, logit_bias=self.bias_ids(), bad_words=self.bad_words,
                              allowed_token_ids=self.allowed_token_ids,
                              structured_outputs=self.constraint())


def _is_batch(prompt) -> bool:
    """Whether a (non-empty) ``prompt`` field is a list of prompts, not one prompt."""
    return isinstance(prompt, list) and isinstance(prompt[0], (str, list))


def _prompt_form(prompt) -> Optional[str]:
    if isinstance(prompt, str):
        return "{text}"
    if not isinstance(prompt, list):
        return None
    first = prompt[0] if prompt else 0
    return "[texts]" if isinstance(first, str) else "[[ids]]" if isinstance(first, list) else "[ids]"


# tagged by the form it has, so an error names the prompt and the place at fault (the tags are no parameter)
Prompt = Annotated[Union[Annotated[str, Tag("{text}")], Annotated[list[WholeInt], Tag("[ids]")],
                         Annotated[list[str], Tag("[texts]")], Annotated[list[list[WholeInt]], Tag("[[ids]]")]],
                   Discriminator(_prompt_form, custom_error_type="invalid_prompt",
                                 custom_error_message="must be a text, token ids, or a list of texts or of "
                                                      "token-id lists")]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (a text or token ids), or a batch of them (a list of
    texts or of token-id lists), as OpenAI's and vLLM's: each prompt gets ``n`` choices,
    prompt ``p``'s choice ``j`` at index ``p * n + j``."""

    prompt: Prompt = Field(description=f"a text or token ids, or a list of up to {MAX_PROMPTS} of either")
    echo: bool = Field(default=False, description="the prompt's text before the completion's; with logprobs, "
                       "the prompt tokens' log-probabilities before the completion's (the first token's null)")
    max_tokens: Optional[WholeInt] = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT, description="0: with echo, "
                                           "the prompt alone (its log-probabilities: an eval's log-likelihood)")
    logprobs: Optional[WholeLogprobCount] = Field(default=None, description="the sampled tokens' "
                                                  "log-probabilities and this many most likely tokens' per position")

    @model_validator(mode="after")
    def _nothing_to_answer(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 only with echo (the prompt alone)")
        return self

    def top_logprobs_asked(self) -> Optional[int]:
        return self.logprobs

    def prompt_logprobs_asked(self) -> Optional[int]:
        """vLLM's: echo with logprobs scores the prompt with as many top tokens."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt, info: ValidationInfo):
        if isinstance(prompt, str):
            return unicode_text(prompt)
        if not prompt:
            raise ValueError("must not be empty")
        batch = _is_batch(prompt)
        if batch and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        n = info.data.get("n", 1)
        if batch and len(prompt) * n > MAX_BATCH_CHOICES:
            raise ValueError(f"{len(prompt)} prompts x n = {n} choices; at most {MAX_BATCH_CHOICES} in one request")
        for i, one in enumerate(prompt if batch else [prompt]):
            where = f"prompt {i}: " if batch else ""
            if isinstance(one, str):
                try:
                    unicode_text(one)
                except ValueError as exc:
                    raise ValueError(f"{where}{exc}") from None
            elif not one:
                raise ValueError(f"{where}must not be empty")
            elif any(t < 0 for t in one):
                raise ValueError(f"{where}token ids must be >= 0")
        return prompt

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts: texts and token-id lists, in order (one, or a batch)."""
        return list(self.prompt) if _is_batch(self.prompt) else [self.prompt]


class ChatCompletionRequest(SamplingFields, ChatRendering):
    """POST /v1/chat/completions (function calling: :mod:`.tool_protocol`; how the chat is
    rendered: :class:`~.chat_messages.ChatRendering`)."""

    messages: list[ChatTurn] = Field(min_length=1)
    tools: Optional[list[Tool]] = Field(default=None, min_length=1, max_length=MAX_TOOLS,
                                        description="functions the model may call")
    tool_choice: Optional[ToolChoice] = Field(default=None, validate_default=True, description=(
        "none, auto (the default with tools: needs the deployment's serve.tool_call_parser), required, "
        "or {\"type\": \"function\", \"function\": {\"name\": ...}}"))
    parallel_tool_calls: Optional[bool] = Field(default=None, description="false: at most one call")
    chat_template_kwargs: Optional[TemplateKwargs] = Field(default=None, description=TEMPLATE_KWARGS_HELP)
    include_reasoning: bool = Field(default=True, description="vLLM's: false leaves the reasoning out of the answer "
                                    "(with the deployment's serve.reasoning_parser)")
    max_completion_tokens: Optional[WholeInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    echo: bool = Field(default=False, description="vLLM's: an answer to a chat whose last message is the "
                       "assistant's starts with that message's text")
    logprobs: bool = Field(default=False, description="the sampled tokens' log-probabilities")
    top_logprobs: Optional[WholeLogprobCount] = Field(default=None, description="this many most likely tokens "
                                                      "per position (needs logprobs)")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    _distinct_tools = field_validator("tools")(lambda cls, tools: distinct_names(tools))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        given = info.data
        constrained = one_constraint(given.get("response_format"), given.get("structured_outputs")) is not None
        check_tool_choice(choice, given.get("tools"), constrained)
        return choice

    _forced: Optional[StructuredOutputs] = PrivateAttr(default=None)

    @property
    def tool_kind(self) -> ToolChoiceKind:
        return choice_kind(self.tool_choice, self.tools)

    def constraint(self) -> Optional[StructuredOutputs]:
        if self.tool_kind.forces_a_call:
            if self._forced is None:          # built once (its grammar is compiled to check it)
                self._forced = forced_call_constraint(self.tool_choice, self.tools, self.parallel_tool_calls)
            return self._forced
        return super().constraint()

    def top_logprobs_asked(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed(self) -> str:
        """What the answer shows before its text (``echo``: the last message's text, when it
        is the assistant's, as vLLM does; the answer's role is always the assistant's)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


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
    adapter: Literal["latest", "base", "version", "loaded"] = Field(
        description="'latest' follows retraining; 'base' is the model without the adapter "
                    "(<model>@base); 'version' is a saved adapter checkpoint (<model>@v<k>); 'loaded' "
                    "is an adapter loaded with POST /v1/load_lora_adapter (its root: the path it was "
                    "loaded from)")
    adapter_version: Optional[int] = Field(default=None, description="k of <model>@v<k>")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter: vLLM's body."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: ModelName = Field(description="the model name requests will use")
    lora_path: str = Field(min_length=1, max_length=4096, description="a peft LoRA adapter directory "
                           "(adapter_config.json, adapter_model.safetensors) the deployment can read; "
                           "a relative path is taken from the controller's directory")
    load_inplace: bool = Field(default=False, description="replace an adapter loaded under this name")


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter: vLLM's body."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: ModelName
    lora_int_id: Optional[WholeInt] = Field(default=None, description="vLLM's; accepted and not used "
                                            "(adapters are named)")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
