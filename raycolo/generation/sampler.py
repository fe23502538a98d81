"""The next token of each row of a batch's logits: one sampler for every backend that
runs raycolo's own model code (the offline torch engine and the online stage pipeline).

Per row, in vLLM v1's order: the raw log-probabilities (when asked for), the repetition
penalty over prompt and output tokens (positive logits divided by it, negative ones
multiplied), the presence and frequency penalties over output tokens, the ``min_tokens``
mask of stop tokens, then greedy argmax, or temperature, top-k, top-p and a draw.

A draw depends only on the request's seed and its position in the output
(:func:`position_seed`), never on the batch it ran in or on how often it was preempted
or moved: the same request gives the same text on any replica, stage layout or restart.
Rows with nothing but plain greedy decoding take one argmax over the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from raycolo.generation.params import SamplingParams

SEED_STRIDE = 1_000_003
SEED_MASK = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw for output token ``position`` of a request."""
    return (int(seed) * SEED_STRIDE + int(position)) & SEED_MASK


@dataclass
class SamplingRow:
    """What the sampler needs for one row: the params, the request's seed and how many
    tokens it generated so far (the position of this draw); where a penalty asks for
    them, the prompt and the output so far; where ``min_tokens`` does, the stop tokens."""

    params: SamplingParams
    seed: int
    position: int = 0
    output: Sequence[int] = ()
    prompt: Sequence[int] = ()
    stop_ids: frozenset = field(default_factory=frozenset)

    @classmethod
    def of(cls, params: SamplingParams, seed: int, output: Sequence[int], prompt: Sequence[int] = (),
           stop_ids: frozenset = frozenset()) -> "SamplingRow":
        """A row carrying only what its params need (it crosses process boundaries)."""
        history = params.penalized
        return cls(params, seed, len(output), list(output) if history else (),
                   list(prompt) if params.repetition_penalty != 1.0 else (),
                   stop_ids if params.min_tokens > len(output) else frozenset())


@dataclass
class TokenLogprob:
    """The sampled token's log-probability under the raw model distribution and the
    ``logprobs`` most likely tokens' (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[Optional[TokenLogprob]]


def plain(params: SamplingParams) -> bool:
    """Rows of these params need nothing but the argmax of the raw logits."""
    return params.plain_greedy and params.logprobs is None


@torch.inference_mode()
def sample_plain(logits: torch.Tensor) -> Sampled:
    """:func:`sample` for a batch whose rows are all :func:`plain`: one argmax, no rows
    built (the common greedy batch costs nothing per row)."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    return Sampled(tokens, [None] * len(tokens))


def _penalize(x: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt) | set(row.output)), dtype=torch.long)
        if len(seen):
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(row.output):
        ids, counts = torch.unique(torch.tensor(list(row.output), dtype=torch.long), return_counts=True)
        x[ids] -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty


def _draw(x: torch.Tensor, row: SamplingRow) -> int:
    p = row.params
    x = x / p.temperature
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    gen = torch.Generator().manual_seed(position_seed(row.seed, row.position))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Sampled:
    """The next token of each row of ``logits`` (rows x vocabulary)."""
    if all(plain(r.params) for r in rows):
        return sample_plain(logits)
    logits = logits.float().cpu()
    tokens = torch.argmax(logits, dim=-1).tolist()        # plain greedy rows, in one op
    asked = [r.params.logprobs for r in rows]
    raw = torch.log_softmax(logits, -1) if any(a is not None for a in asked) else None
    for i, row in enumerate(rows):
        p = row.params
        if p.plain_greedy:
            continue
        x = logits[i].clone()
        _penalize(x, row)
        if row.position < p.min_tokens and row.stop_ids:
            masked = [t for t in row.stop_ids if t < x.numel()]
            x[torch.tensor(masked, dtype=torch.long)] = float("-inf")
        tokens[i] = int(torch.argmax(x)) if p.greedy else _draw(x, row)
    logprobs: list[Optional[TokenLogprob]] = [None] * len(rows)
    if raw is not None:
        for i, k in enumerate(asked):
            if k is None:
                continue
            top = torch.topk(raw[i], k) if k else None
            logprobs[i] = TokenLogprob(tokens[i], float(raw[i, tokens[i]]),
                                       [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))
    return Sampled(tokens, logprobs)
