"""The next token of each row of a batch's logits: one sampler for every backend that
runs raycolo's own model code (the offline torch engine and the online stage pipeline).

Per row, in vLLM v1's order: the structured-output mask (tokens its grammar does not allow
next are ``-inf``, :mod:`.grammar_masks`), the log-probabilities (when asked for), the
``allowed_token_ids`` mask, the ``bad_words`` ban (:mod:`.vocab_rules`), the logit bias,
the repetition penalty over prompt and output tokens (positive logits divided by it,
negative ones multiplied), the presence and frequency penalties over output tokens, the
``min_tokens`` mask of stop tokens, then greedy argmax, or temperature, min-p (a token
less likely than ``min_p`` times the most likely one is out), top-k, top-p and a draw.

The whole batch is sampled on the logits' device in float32, with batched tensor ops
(no per-row loop of tensor ops): the rows' parameters go over in one int64 and one float32
copy, and everything comes back (tokens, log-probabilities) in one device-to-host copy.
Rows with nothing but plain greedy decoding take one argmax over the whole batch.

A draw is an exponential race, the Gumbel-max trick as vLLM does it: the token is
``argmax(probs / q)`` with ``q ~ Exp(1)`` independent per (row, token id), which picks
each token with its probability. The ``q`` come from :mod:`.random_bits`: a counter-based
hash of ``(position_seed(seed, position), token id)`` computed with int64 tensor ops, so
a row's draw depends only on the request's seed and its position in the output, never
on the batch it ran in, the other rows, the device or how often it was preempted or
moved: the same request gives the same text on any replica, stage layout or restart.
(Bitwise the same across devices but for the softmax and log: CPU and CUDA may round
those a last bit apart, which changes a draw only where two tokens tie to that bit.)
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from raycolo.generation.rows import Sampled, SamplingRow, TokenLogprob, plain, position_seed  # noqa: F401
from raycolo.generation.penalty_history import PenaltyHistory, history_for, padded as _padded
from raycolo.generation.random_bits import exponentials
from raycolo.generation.vocab_rules import rules_needed

@torch.inference_mode()
def sample_plain(logits: torch.Tensor) -> Sampled:
    """:func:`sample` for a batch whose rows are all :func:`plain`: one argmax, no rows
    built (the common greedy batch costs nothing per row)."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    return Sampled(tokens, [None] * len(tokens))


# Rows x vocabulary of one chunk of the race: its int64 random bits take 128 MiB.
RACE_ELEMENTS = 1 << 24
NEG_INF = float("-inf")


def _upload(arrays: dict[str, object], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Named arrays (flat lists, rectangular lists of lists, or numpy arrays) packed into
    one CPU tensor of ``dtype``, moved to ``device`` in one copy and split back there (views)."""
    np_dtype = np.int64 if dtype == torch.int64 else np.float32
    parts, shapes = [], {}
    for name, a in arrays.items():
        arr = np.asarray(a, dtype=np_dtype)
        shapes[name] = arr.shape
        parts.append(arr.reshape(-1))
    packed = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np_dtype)).to(device, non_blocking=True)
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = packed[at:at + n].view(shape)
        at += n
    return out


class _Plan:
    """Which rows each step touches and their parameters, on the device: ``t[name]`` of
    a row set is its index tensor, absent where the set holds every row (no gather, no
    scatter); ``has[name]`` whether the set has any row."""

    def __init__(self, rows: Sequence[SamplingRow], vocab: int, device: torch.device, rules=None,
                 history: Optional[PenaltyHistory] = None):
        ps = [r.params for r in rows]
        n = len(rows)
        allow = [i for i, p in enumerate(ps) if p.allowed_token_ids is not None]
        bans = [[t for t in rules.banned(r) if t < vocab] if r.params.bad_words else [] for r in rows]
        ban = [i for i in range(n) if bans[i]]
        biases = [[(t, b) for t, b in p.logit_bias if t < vocab] for p in ps]
        bias = [i for i in range(n) if biases[i]]
        rep = [i for i, p in enumerate(ps) if p.repetition_penalty != 1.0
               and (len(rows[i].prompt) or len(rows[i].output))]
        pen = [i for i, p in enumerate(ps) if (p.presence_penalty or p.frequency_penalty) and len(rows[i].output)]
        stops = [[t for t in rows[i].stop_ids if t < vocab] if rows[i].position < p.min_tokens else []
                 for i, p in enumerate(ps)]
        mask = [i for i in range(n) if stops[i]]
        drawn = [i for i, p in enumerate(ps) if not p.greedy]
        trunc = [j for j, i in enumerate(drawn) if 0 < ps[i].top_k < vocab or ps[i].top_p < 1.0 or ps[i].min_p > 0]
        ask = [i for i, p in enumerate(ps) if p.logprobs is not None]
        # the penalized rows' prompts and outputs: on the device, kept between steps by key
        penalized = sorted(set(rep) | set(pen))
        self.history = history_for(history, vocab, device) if penalized else None
        slots, hist = self.history.plan([rows[i] for i in penalized]) if penalized else ([], {})
        slot = dict(zip(penalized, slots))
        self.n, self.vocab, self.any_greedy = n, vocab, len(drawn) < n
        self.asked = [ps[i].logprobs for i in ask]
        self.kmax = max((ps[drawn[j]].top_k for j in trunc if 0 < ps[drawn[j]].top_k < vocab), default=0)
        self.any_p = any(ps[drawn[j]].top_p < 1.0 for j in trunc)
        self.any_min_p = any(ps[drawn[j]].min_p > 0 for j in trunc)
        sets = {"allow": (allow, n), "ban": (ban, n), "bias": (bias, n), "rep": (rep, n), "pen": (pen, n), "mask": (mask, n), "drawn": (drawn, n), "ask": (ask, n),
                "trunc": (trunc, len(drawn))}        # trunc: positions among the drawn rows
        self.has = {name: bool(idx) for name, (idx, _) in sets.items()}
        ints = {name: idx for name, (idx, total) in sets.items() if idx and len(idx) < total}
        width = max((len(biases[i]) for i in bias), default=0)    # padded with a bias of 0 on token 0
        ints.update(
            allow_ids=_padded([list(ps[i].allowed_token_ids) for i in allow], vocab) if allow else [],
            ban_ids=_padded([bans[i] for i in ban], vocab) if ban else [],
            bias_ids=[[t for t, _ in biases[i]] + [0] * (width - len(biases[i])) for i in bias],
            rep_slots=[slot[i] for i in rep], pen_slots=[slot[i] for i in pen], **hist,
            stop_ids=_padded([stops[i] for i in mask], vocab) if mask else [],
            seeds=[position_seed(rows[i].seed, rows[i].position) for i in drawn],
            top_k=[ps[drawn[j]].top_k if 0 < ps[drawn[j]].top_k < vocab else 0 for j in trunc])
        floats = dict(
            bias_values=[[b for _, b in biases[i]] + [0.0] * (width - len(biases[i])) for i in bias],
            repetition=[ps[i].repetition_penalty for i in rep],
            presence=[ps[i].presence_penalty for i in pen], frequency=[ps[i].frequency_penalty for i in pen],
            temperature=[ps[i].temperature for i in drawn],
            top_p=[ps[drawn[j]].top_p if ps[drawn[j]].top_p < 1.0 else math.inf for j in trunc],
            min_p=[ps[drawn[j]].min_p for j in trunc])
        self.t = {**_upload(ints, torch.int64, device), **_upload(floats, torch.float32, device)}


def _on_rows(x: torch.Tensor, idx: Optional[torch.Tensor], fn) -> torch.Tensor:
    """``fn`` of the rows ``idx`` of ``x`` (all rows where None) put back into ``x``;
    the other rows are left bitwise as they were."""
    if idx is None:
        return fn(x)
    return x.index_copy_(0, idx, fn(x.index_select(0, idx)))


def _id_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bool: the ids of each row of ``ids`` (padding falls in a scratch column)."""
    seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids, True)[:, :vocab]


def _repetition(y: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``seen``: (rows, vocab) bool, the ids in each row's prompt or output."""
    pen = penalty.unsqueeze(1)
    return torch.where(seen, torch.where(y > 0, y / pen, y * pen), y)


def _presence_frequency(y: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                        frequency: torch.Tensor) -> torch.Tensor:
    """``counts``: (rows, vocab), each id's count in each row's output."""
    return torch.where(counts > 0, y - (frequency.unsqueeze(1) * counts + presence.unsqueeze(1)), y)


def _truncate(z: torch.Tensor, t: dict, plan: "_Plan") -> torch.Tensor:
    """Min-p (a token less likely than ``min_p`` times the most likely one out; 0: none),
    top-k (values below the k-th largest out; ``top_k`` 0: none), then top-p (a token
    stays while the probability before it in the sorted order is below ``top_p``)."""
    top_k, top_p, kmax = t["top_k"], t["top_p"], plan.kmax
    if plan.any_min_p:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < probs.amax(-1, keepdim=True) * t["min_p"].unsqueeze(1), NEG_INF)
    if kmax:             # one topk of the largest k asked; ties with the k-th value stay
        kth = z.topk(kmax, dim=-1).values.gather(1, (top_k - 1).clamp_(min=0).unsqueeze(1))
        z = z.masked_fill(z < torch.where(top_k.unsqueeze(1) > 0, kth, NEG_INF), NEG_INF)
    if plan.any_p:       # the smallest prefix of the sorted tokens that reaches top_p; as with
        # top-k, tokens that tie with its last one stay (which of equal logits a sort puts
        # first differs by device and sort algorithm; bf16 logits tie often)
        sorted_z = z.sort(dim=-1, descending=True).values
        sorted_p = sorted_z.softmax(-1)
        kept = (sorted_p.cumsum(-1) - sorted_p < top_p.unsqueeze(1)).sum(-1, keepdim=True)
        z = z.masked_fill(z < sorted_z.gather(1, (kept - 1).clamp_(min=0)), NEG_INF)
    return z


def _process(x: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` (float32, the sampler's own copy, which this may overwrite) processed, and
    the drawn rows' processed logits (None where no row draws)."""
    t, vocab = plan.t, plan.vocab
    if plan.has["allow"]:
        x = _on_rows(x, t.get("allow"), lambda y: y.masked_fill(~_id_mask(t["allow_ids"], vocab), NEG_INF))
    if plan.has["ban"]:
        x = _on_rows(x, t.get("ban"), lambda y: y.masked_fill(_id_mask(t["ban_ids"], vocab), NEG_INF))
    if plan.has["bias"]:
        x = _on_rows(x, t.get("bias"), lambda y: y.scatter_add_(1, t["bias_ids"], t["bias_values"]))
    if plan.history is not None:
        plan.history.update(t)
    if plan.has["rep"]:
        x = _on_rows(x, t.get("rep"), lambda y: _repetition(y, plan.history.mask(t["rep_slots"]), t["repetition"]))
    if plan.has["pen"]:
        x = _on_rows(x, t.get("pen"), lambda y: _presence_frequency(
            y, plan.history.counts(t["pen_slots"], y.dtype), t["presence"], t["frequency"]))
    if plan.has["mask"]:
        x = _on_rows(x, t.get("mask"), lambda y: y.masked_fill(_id_mask(t["stop_ids"], vocab), NEG_INF))
    if not plan.has["drawn"]:
        return x, None
    drawn = t.get("drawn")
    y = (x if drawn is None else x.index_select(0, drawn)) / t["temperature"].unsqueeze(1)
    if plan.has["trunc"]:
        y = _on_rows(y, t.get("trunc"), lambda z: _truncate(z, t, plan))
    return (y if drawn is None else x.index_copy_(0, drawn, y)), y


def _race(y: torch.Tensor, seeds: torch.Tensor, elements: int = RACE_ELEMENTS) -> torch.Tensor:
    """The seeded draw of each row of ``y`` (processed logits): ``argmax(probs / q)``,
    ``q ~ Exp(1)`` from the row's seed, in chunks of rows (the race's memory bounded)."""
    tokens = torch.empty(y.shape[0], dtype=torch.int64, device=y.device)
    step = max(1, elements // y.shape[1])
    for a in range(0, y.shape[0], step):
        probs = torch.softmax(y[a:a + step], -1)
        tokens[a:a + step] = probs.div_(exponentials(seeds[a:a + step], y.shape[1])).argmax(-1)
    return tokens


def _grammar_masked(x: torch.Tensor, rows: Sequence[SamplingRow], rules) -> torch.Tensor:
    """``x`` with the tokens each structured row's grammar forbids next at ``-inf``
    (``rules``: the model's :class:`~.vocab_rules.VocabRules`)."""
    masks = rules.bitmask(rows) if rules is not None else None
    if masks is None:
        return x
    from raycolo.generation.grammar_masks import allowed
    bitmask, live = masks
    ok = allowed(bitmask.to(x.device, non_blocking=True), x.shape[1])
    idx = None if len(live) == x.shape[0] else torch.tensor(live, device=x.device)
    return _on_rows(x, idx, lambda y: y.masked_fill_(~ok, NEG_INF))


def _prepared(logits: torch.Tensor, rows: Sequence[SamplingRow], rules,
              history: Optional[PenaltyHistory]) -> tuple[_Plan, torch.Tensor]:
    """The batch's plan, and its logits upcast once (the sampler's own copy, which
    :func:`_process` may overwrite), masked by the rows' grammars first."""
    rules = rules_needed(rows, rules)
    plan = _Plan(rows, logits.shape[-1], logits.device, rules, history)
    return plan, _grammar_masked(logits.to(torch.float32, copy=True), rows, rules)


@torch.inference_mode()
def processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], rules=None,
                     history: Optional[PenaltyHistory] = None) -> torch.Tensor:
    """The float32 logits each row is sampled from: after the structured-output mask,
    ``allowed_token_ids``, ``bad_words``, the logit bias, the penalties and the
    ``min_tokens`` mask and, for rows that draw,
    temperature, min-p, top-k and top-p (``-inf`` where a token is excluded). A greedy row
    takes their argmax, a drawing row draws from their softmax; plain greedy rows are the
    raw logits."""
    plan, x = _prepared(logits, rows, rules, history)
    return _process(x, plan)[0]


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], rules=None,
           history: Optional[PenaltyHistory] = None) -> Sampled:
    """The next token of each row of ``logits`` (rows x vocabulary). ``rules``: the
    model's :class:`~.vocab_rules.VocabRules`, needed where a row has structured outputs
    or bad words; ``history``: the caller's :class:`~.penalty_history.PenaltyHistory`,
    which keeps penalized rows' prompts and outputs on the device between steps (None:
    built for this step from the rows)."""
    if all(plain(r.params) for r in rows):
        return sample_plain(logits)
    plan, x = _prepared(logits, rows, rules, history)
    ask = plan.t.get("ask")
    raw = None
    if plan.has["ask"]:                               # the raw distribution, before any processing
        raw = torch.log_softmax(x if ask is None else x.index_select(0, ask), -1)
    x, y = _process(x, plan)
    tokens = x.argmax(-1) if plan.any_greedy else torch.empty(plan.n, dtype=torch.int64, device=x.device)
    if y is not None:
        drawn = _race(y, plan.t["seeds"])
        tokens = drawn if plan.t.get("drawn") is None else tokens.index_copy_(0, plan.t["drawn"], drawn)
    parts = [tokens]
    kmax = min(max(plan.asked, default=0), plan.vocab)
    if raw is not None:
        # float32 values travel as their int32 bit patterns, so that ids and values share
        # one int64 tensor
        chosen = raw.gather(1, (tokens if ask is None else tokens.index_select(0, ask)).unsqueeze(1))
        parts.append(chosen.view(torch.int32).to(torch.int64).flatten())
        if kmax:
            top = torch.topk(raw, kmax, dim=-1)
            parts += [top.indices.flatten(), top.values.view(torch.int32).to(torch.int64).flatten()]
    # The one device-to-host copy of the step (it waits for the device's work): tokens,
    # then the chosen tokens' log-probabilities and the top ids and values of the rows asking.
    host = torch.cat(parts).cpu()
    n, m = plan.n, len(plan.asked)
    token_list = host[:n].tolist()
    logprobs: list[Optional[TokenLogprob]] = [None] * n
    if raw is not None:
        as_float = lambda v: v.to(torch.int32).view(torch.float32)    # noqa: E731
        chosen_lp = as_float(host[n:n + m]).tolist()
        top_ids = host[n + m:n + m + m * kmax].view(m, kmax).tolist()
        top_lp = as_float(host[n + m + m * kmax:]).view(m, kmax).tolist()
        rows_asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        for j, (i, k) in enumerate(zip(rows_asking, plan.asked)):
            logprobs[i] = TokenLogprob(token_list[i], chosen_lp[j], list(zip(top_ids[j][:k], top_lp[j][:k])))
    return Sampled(token_list, logprobs)
