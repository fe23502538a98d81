"""Prompt log-probabilities: vLLM's ``prompt_logprobs``, and what OpenAI's ``echo`` with
``logprobs`` shows for the prompt (an eval harness's log-likelihood of a continuation).

The model's logits at prompt position ``i`` give the distribution of the token at ``i + 1``:
prompt token ``j >= 1`` gets ``log_softmax(logits[j - 1])[ids[j]]`` of the raw model
distribution (no temperature, penalty or mask applies, as in vLLM), its rank in the
vocabulary, and the ``k`` most likely tokens there; the first prompt token has nothing
before it and gets None. Positions are scored a slice at a time, so the float32 copy of
the logits stays at :data:`SCORE_ROWS` rows whatever the prompt's length; the results
leave the device in one copy per slice.
"""
from __future__ import annotations

import itertools
from typing import Mapping, Optional, Sequence

import torch

from raycolo.generation.rows import PromptScore, TokenLogprob

SCORE_ROWS = 512          # prompt positions scored per pass (rows x vocabulary float32 at a time)


@torch.inference_mode()
def score_prompt(logits: torch.Tensor, ids: Sequence[int], k: int) -> list[Optional[TokenLogprob]]:
    """Each prompt token's :class:`TokenLogprob` (the first's None). ``logits``: at least
    ``len(ids) - 1`` rows, row ``i`` the model's logits after ``ids[:i + 1]`` (rows past
    those are not read); ``k``: how many most likely tokens per position."""
    n = len(ids)
    if logits.dim() != 2 or logits.shape[0] < n - 1:
        raise ValueError(f"score_prompt: {n} prompt tokens need {n - 1} rows of logits, "
                         f"not {tuple(logits.shape)}")
    out: list[Optional[TokenLogprob]] = [None]
    if n < 2:
        return out
    vocab = logits.shape[1]
    kk = min(k, vocab)
    if max(ids[1:]) >= vocab:        # on the host: no wait for the device
        raise ValueError(f"score_prompt: a prompt token id is not below the vocabulary size {vocab}")
    targets = torch.tensor(list(ids[1:]), dtype=torch.long, device=logits.device)
    for lo in range(0, n - 1, SCORE_ROWS):
        hi = min(lo + SCORE_ROWS, n - 1)
        lp = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        chosen = lp.gather(1, targets[lo:hi].unsqueeze(1))
        ranks = (lp >= chosen).sum(dim=1)
        parts = [chosen.flatten(), ranks.float()]
        if kk:
            top = torch.topk(lp, kk, dim=-1)
            parts += [top.values.flatten(), top.indices.float().flatten()]
        host = torch.cat(parts).cpu()              # one copy per slice (ids below 2**24 are exact)
        m = hi - lo
        chosen_l, rank_l = host[:m].tolist(), host[m:2 * m].long().tolist()
        top_v = host[2 * m:2 * m + m * kk].view(m, kk).tolist() if kk else [[]] * m
        top_i = host[2 * m + m * kk:].long().view(m, kk).tolist() if kk else [[]] * m
        for j in range(m):
            out.append(TokenLogprob(int(ids[lo + j + 1]), chosen_l[j], list(zip(top_i[j], top_v[j])), rank_l[j]))
    return out


def split_scored(logits: torch.Tensor, requests: Sequence, counts: Sequence[int],
                 scored: Mapping[object, PromptScore]) -> tuple[torch.Tensor, list]:
    """A step's logits where the requests in ``scored`` (request -> its PromptScore) have a
    row per new token (``counts``) and the others one: (each request's last row, to sample
    from; per request its prompt's log-probabilities, None where it is not scored)."""
    rows = [counts[i] if r in scored else 1 for i, r in enumerate(requests)]
    ends = list(itertools.accumulate(rows))
    if not ends or ends[-1] != logits.shape[0]:
        raise ValueError(f"split_scored: {logits.shape[0]} rows of logits for {sum(rows)} expected")
    prompts = [score_prompt(logits[end - n:end], scored[r].ids, scored[r].top) if r in scored else None
               for r, n, end in zip(requests, rows, ends)]
    last = torch.tensor([end - 1 for end in ends], dtype=torch.long, device=logits.device)
    return logits.index_select(0, last), prompts
