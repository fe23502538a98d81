"""One request's decoding settings: vLLM's ``SamplingParams``, same names and meanings.

Defaults and bounds are declared here once; the HTTP protocol, the offline DAG nodes and
the engines take them from here. The order in which the sampler applies them is vLLM
v1's (``vllm/v1/sample/sampler.py``): the structured-output mask (vLLM's model runner
applies it before the sampler), log-probabilities of the logits so far, ``allowed_token_ids``
and ``bad_words``, then the
logit bias, the repetition, presence and frequency penalties, the ``min_tokens`` mask of
stop tokens, then (for rows that draw) temperature, min-p, top-k, top-p, and the draw. Temperature below :data:`GREEDY_EPS` is greedy
(vLLM's ``_SAMPLING_EPS``).
"""
from __future__ import annotations

from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raycolo.generation.structured import StructuredOutputs

GREEDY_EPS = 1e-5
MAX_TOKENS_LIMIT = 1 << 31
MAX_TEMPERATURE = 100.0        # OpenAI bounds HTTP requests at 2.0 (serving/protocol.py)
MAX_PENALTY = 2.0              # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0
MAX_SEED = (1 << 63) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20              # top log-probabilities per token (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0         # a token's logit bias lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024   # tokens one request biases
MAX_BAD_WORDS = 64             # vLLM bans at most 128 token sequences: a word gives one or two
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 4096      # rebuilt into a mask each step: a few ms at most
# Offline requests sample at this temperature unless their DAG node says otherwise: the
# temperature the output-length eCDFs are measured at (raycolo profile), so the planner's
# sampled lengths are the lengths the runtime produces.
ECDF_TEMPERATURE = 1.0

MAX_TOP_K = 1 << 20

# The field types shared by SamplingParams, the offline DAG nodes (raycolo.offline.dag.NodeSpec)
# and the HTTP requests (raycolo.online.serving.protocol): each bound is declared here once.
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False, strict=True,
                                     description="0: greedy")]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False, strict=True)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)]
MinTokens = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, strict=True,
                              description="a drawn token's probability must be at least this times the "
                                          "most likely token's (0: off)")]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


def stop_strings(stop) -> tuple[str, ...]:
    """``stop`` (None, one string or a list of them) as a checked tuple of stop strings."""
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    for s in items:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise ValueError(f"each stop string needs 1 to {MAX_STOP_CHARS} characters")
    return items


def bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias (a mapping of token id to bias, or its pairs; None: none) as pairs
    sorted by token id: ids >= 0, at most :data:`MAX_LOGIT_BIAS_TOKENS` of them, each once."""
    if bias is None:
        return ()
    pairs = tuple(bias.items()) if isinstance(bias, dict) else tuple(tuple(p) for p in bias)
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
    if any(len(p) != 2 or not isinstance(p[0], int) or isinstance(p[0], bool) for p in pairs):
        raise ValueError("token ids must be integers, each with one bias")
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        raise ValueError("each token id once")
    return tuple(sorted(pairs))


def bad_word_list(words) -> tuple[str, ...]:
    """``bad_words`` (None or a list of strings) checked: each with something besides
    whitespace (vLLM tokenizes the word with its leading whitespace stripped), each once."""
    if words is None:
        return ()
    words = tuple(words)
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"at most {MAX_BAD_WORDS} words")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"each bad word needs 1 to {MAX_BAD_WORD_CHARS} characters, not all whitespace")
    return tuple(dict.fromkeys(words))


def no_min_tokens_with_a_grammar(min_tokens: int, constrained: bool) -> None:
    """A request with a structured output takes no ``min_tokens``: a grammar that ends
    early would have to break itself (its only next tokens, the stop tokens, masked)."""
    if min_tokens and constrained:
        raise ValueError("min_tokens: not with structured outputs (a grammar that ends early would have to "
                         "break itself)")


def nonnegative_ids(ids):
    """``ids`` (token ids, or None), checked."""
    if ids is not None and any(i < 0 for i in ids):
        raise ValueError("token ids must be >= 0")
    return ids


class SamplingParams(BaseModel):
    """Decoding settings of one request (vLLM's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=16, gt=0, le=MAX_TOKENS_LIMIT,
                            description="tokens to generate at most (the stop token counts)")
    min_tokens: MinTokens = Field(default=0, description="no stop token or stop string ends the output "
                                                         "before this many tokens")
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = Field(default=0, description="0 or -1: all tokens")
    seed: Optional[Seed] = Field(default=None, description="the draws of a request with a seed depend only on the seed "
                                            "and the position (not on batching or restarts)")
    repetition_penalty: RepetitionPenalty = Field(default=1.0, description="> 1 discourages tokens of the prompt "
                                                                           "and the output so far")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: tuple[str, ...] = Field(default=(), max_length=MAX_STOP_STRINGS,
                                  description="strings that end the output (not included in the text)")
    stop_token_ids: tuple[int, ...] = Field(default=(), max_length=MAX_STOP_TOKEN_IDS,
                                            description="token ids that end the output, besides the EOS set")
    ignore_eos: bool = Field(default=False, description="keep generating past the model's EOS tokens "
                                                        "(every id of its EOS set)")
    skip_special_tokens: bool = Field(default=True, description="leave special tokens out of the text")
    include_stop_str_in_output: bool = Field(default=False, description="end the text after the stop string "
                                                                        "that ended it, not before")
    logprobs: Optional[LogprobCount] = Field(default=None, description="return the sampled token's log-probability and this many "
                                                "most likely tokens' (of the raw model distribution)")
    prompt_logprobs: Optional[LogprobCount] = Field(
        default=None, description="return each prompt token's log-probability given the tokens before it (the "
                                  "first token's is None), its rank, and this many most likely tokens' (of the raw "
                                  "model distribution)")
    min_p: MinP = 0.0
    logit_bias: tuple[tuple[Annotated[int, Field(ge=0)], LogitBias], ...] = Field(
        default=(),
        description="(token id, bias) pairs, or a mapping of id to bias: added to the raw logits first")
    bad_words: tuple[str, ...] = Field(default=(), description="words the text never contains (vLLM's: each "
                                       "tokenized alone and after a space; a sequence's last token is banned "
                                       "where the output ends with the rest)")
    allowed_token_ids: Optional[tuple[Annotated[int, Field(ge=0)], ...]] = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
        description="the only token ids the output may take (None: all)")
    structured_outputs: Optional[StructuredOutputs] = Field(
        default=None, description="a JSON schema, regex, choice list or grammar the text must follow "
                                  "(raycolo.generation.structured); its mask comes before everything else")
    structured_after_token: Optional[Annotated[int, Field(ge=0)]] = Field(
        default=None, description="the constraint binds only the output after the first of this token (a "
                                  "reasoning model's </think>: vLLM's structured outputs with a reasoning parser); "
                                  "None: the whole output")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, bias):
        return bias_pairs(bias)

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words(cls, words):
        return bad_word_list(words)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop):
        return stop_strings(stop)

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, ids):
        return nonnegative_ids(ids)

    @model_validator(mode="after")
    def _min_within_max(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        no_min_tokens_with_a_grammar(self.min_tokens, self.structured_outputs is not None)
        if self.structured_after_token is not None and self.structured_outputs is None:
            raise ValueError("structured_after_token: only with structured_outputs")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs the token history (prompt and output so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw logits."""
        return (self.greedy and not self.penalized and self.min_tokens == 0 and not self.logit_bias
                and self.structured_outputs is None and not self.bad_words and self.allowed_token_ids is None)

    @property
    def needs_vocabulary(self) -> bool:
        """Whether sampling needs the model's tokenizer (a grammar, or words to tokenize):
        :class:`~raycolo.generation.vocab_rules.VocabRules`."""
        return self.structured_outputs is not None or bool(self.bad_words)

    def remaining(self, generated: int) -> "SamplingParams":
        """The same request continued after ``generated`` tokens elsewhere (a preempted or
        moved request re-prefills its output; the limits shrink by what was generated)."""
        if generated <= 0:
            return self
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs: a request continued without its output loses its grammar state")
        return self.model_copy(update={"max_tokens": self.max_tokens - generated,
                                       "min_tokens": max(0, self.min_tokens - generated)})
