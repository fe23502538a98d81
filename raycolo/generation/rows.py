"""What the sampler is given and gives back, row by row: plain data that crosses process
boundaries (the online pipeline's messages carry it), so importing it needs no torch
(:mod:`.sampler` draws the tokens)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from raycolo.generation.params import SamplingParams

SEED_STRIDE = 1_000_003
SEED_MASK = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw for output token ``position`` of a request."""
    return (int(seed) * SEED_STRIDE + int(position)) & SEED_MASK


@dataclass
class SamplingRow:
    """What the sampler needs for one row: the params, the request's seed and how many
    tokens it generated so far (the position of this draw); where a penalty, a
    structured output or bad words ask for them, the prompt and the output so far; where
    ``min_tokens`` does, the stop tokens; where a structured output or a penalty does, the
    request's key (its grammar matcher's, :mod:`.grammar_masks`; its penalty history's,
    :mod:`.penalty_history`)."""

    params: SamplingParams
    seed: int
    position: int = 0
    output: Sequence[int] = ()
    prompt: Sequence[int] = ()
    stop_ids: frozenset = field(default_factory=frozenset)
    key: object = None

    @classmethod
    def of(cls, params: SamplingParams, seed: int, output: Sequence[int], prompt: Sequence[int] = (),
           stop_ids: frozenset = frozenset(), key: object = None) -> "SamplingRow":
        """A row carrying only what its params need (it crosses process boundaries);
        ``key``: the request's identity (a structured output's matcher and a penalty's
        history are kept under it)."""
        structured = params.structured_outputs is not None
        history = params.penalized or structured or bool(params.bad_words)
        # a prompt given as a numpy array is kept as it is (an engine converts it once)
        prompt = (prompt if isinstance(prompt, np.ndarray) else list(prompt)) \
            if params.repetition_penalty != 1.0 else ()
        return cls(params, seed, len(output), list(output) if history else (), prompt,
                   stop_ids if params.min_tokens > len(output) else frozenset(),
                   key if structured or params.penalized else None)


class PromptArray:
    """Mixed into a request record with a ``prompt`` (a list of ids): the prompt as int64,
    converted once per request, for :meth:`SamplingRow.of` (a repetition penalty reads it
    at every step; as an array it also crosses a process boundary as one buffer)."""

    @functools.cached_property
    def prompt_array(self) -> np.ndarray:
        return np.asarray(self.prompt, dtype=np.int64)


@dataclass
class TokenLogprob:
    """The sampled token's log-probability under the raw model distribution and the
    ``logprobs`` most likely tokens' (id, log-probability), most likely first; a prompt
    token's (:mod:`.prompt_scores`) also carries its ``rank`` in the vocabulary (1: the most
    likely; tokens as likely as it count ahead of it, as vLLM ranks)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: Optional[int] = None


@dataclass(frozen=True)
class PromptScore:
    """What a prefill scores of a request's prompt (its ``prompt_logprobs``): the prompt's
    ids, and how many most likely tokens per position (:mod:`.prompt_scores`)."""

    ids: Sequence[int]
    top: int


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[Optional[TokenLogprob]]


def plain(params: SamplingParams) -> bool:
    """Rows of these params need nothing but the argmax of the raw logits."""
    return params.plain_greedy and params.logprobs is None
