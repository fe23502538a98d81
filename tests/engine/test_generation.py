"""raycolo.generation against hand-worked cases, transformers' logits processors and a
brute force: the EOS set, the stop checker's order, stop strings, penalties, min_tokens,
top-k/top-p, log-probabilities, the batched sampler against itself row by row, and its
counter-based random bits against a pure-Python reimplementation."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from raycolo.engine.models import ByteTokenizer
from raycolo.generation import SamplingParams, StopChecker, check_stop, eos_token_ids, stop_token_set
from raycolo.generation.params import MAX_LOGIT_BIAS_TOKENS
from raycolo.generation.random_bits import exponentials, fmix32, hash_bits, to_uniform, uniforms
from raycolo.generation.sampler import SamplingRow, _race, position_seed, processed_logits, sample

TOK = ByteTokenizer(512)


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


# -- the EOS set ---------------------------------------------------------------------------
@pytest.mark.parametrize("gen_eos, expected", [([128001, 128009], {7, 128001, 128009}), (128009, {7, 128009}),
                                               (None, {7})])
def test_eos_set_is_tokenizer_eos_plus_generation_config(tmp_path, gen_eos, expected):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    if gen_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
        assert eos_token_ids(7, tmp_path) == frozenset(expected)
    else:          # no generation config: config.json's, as transformers and vLLM read it
        assert eos_token_ids(7, tmp_path) == frozenset(expected | {5})


def test_stop_tokens_follow_ignore_eos():
    eos = {2, 9}
    assert stop_token_set(SamplingParams(stop_token_ids=(4,)), eos) == {2, 4, 9}
    assert stop_token_set(SamplingParams(stop_token_ids=(4,), ignore_eos=True), eos) == {4}


# -- the stop checker ------------------------------------------------------------------------
def test_check_stop_order_is_vllms():
    p = SamplingParams(max_tokens=3)
    stops = frozenset({9})
    assert check_stop(p, stops, [1]) is None
    assert check_stop(p, stops, [1, 9]) == "stop"
    assert check_stop(p, stops, [1, 2, 9]) == "stop"       # a stop token before the limit (vLLM v1)
    assert check_stop(p, stops, [1, 2, 3]) == "length"
    assert check_stop(SamplingParams(max_tokens=5, min_tokens=2), stops, [9]) is None
    assert check_stop(SamplingParams(max_tokens=5, min_tokens=2), stops, [1, 2, 9]) == "stop"


def test_stop_token_is_counted_but_not_text():
    c = StopChecker(SamplingParams(max_tokens=10), {2}, TOK)
    reasons = [c.append(t) for t in ids("hi") + [2]]
    assert reasons == [None, None, "stop"] and c.output == ids("hi") + [2] and c.text(TOK) == "hi"


def test_stop_token_ids_not_special_are_cut_from_text():
    c = StopChecker(SamplingParams(max_tokens=10, stop_token_ids=(ids("!")[0],)), {2}, TOK)
    for t in ids("ok!"):
        reason = c.append(t)
    assert reason == "stop" and c.text(TOK) == "ok" and len(c.output) == 3


def test_stop_string_cuts_text_and_counts_every_token():
    c = StopChecker(SamplingParams(max_tokens=50, stop=["END"]), {2}, TOK)
    reason = None
    for n, t in enumerate(ids("abcENDxyz"), 1):
        reason = c.append(t)
        if reason:
            break
    assert reason == "stop" and n == 6 and c.text(TOK) == "abc" and len(c.output) == 6


def test_min_tokens_defers_stop_strings():
    """As vLLM's detokenizer: text before min_tokens is never searched again."""
    c = StopChecker(SamplingParams(max_tokens=50, min_tokens=4, stop=["a"]), {2}, TOK)
    reasons = [c.append(t) for t in ids("aaaaba")]
    assert reasons == [None, None, None, None, None, "stop"] and c.text(TOK) == "aaaab"


def test_length_with_stop_string_pending_flushes_text():
    c = StopChecker(SamplingParams(max_tokens=3, stop=["xyz"]), {2}, TOK)
    assert [c.append(t) for t in ids("abx")] == [None, None, "length"]
    assert c.text(TOK) == "abx"


# -- the sampler -----------------------------------------------------------------------------
def _logits(seed: int = 0, rows: int = 1, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_repetition_penalty_matches_transformers():
    logits = _logits(1)
    prompt, output = [3, 5, 7], [5, 11, 40]
    p = SamplingParams(max_tokens=8, repetition_penalty=1.7)
    ours = sample(logits, [SamplingRow.of(p, 0, output, prompt)]).tokens[0]
    history = torch.tensor([prompt + output])
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(history, logits.clone()).argmax(-1).item()
    assert ours == theirs
    # the penalty changes answers (it is not a no-op), and as transformers' does
    changed = 0
    for s in range(30):
        x = _logits(s)
        top = int(x.argmax())
        ours = sample(x, [SamplingRow.of(p, 0, [top], prompt)]).tokens[0]
        theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + [top]]), x.clone()).argmax(-1).item()
        assert ours == theirs
        changed += ours != top
    assert changed >= 20


def test_presence_and_frequency_penalties_by_hand():
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0     # 3 is the argmax, seen twice in the output
    logits[0, 4] = 0.5
    p = SamplingParams(max_tokens=9, frequency_penalty=0.2, presence_penalty=0.2)
    # 3: 1.0 - 0.2*2 - 0.2 = 0.4 < 0.5: token 4 wins
    assert sample(logits, [SamplingRow.of(p, 0, [3, 3])]).tokens == [4]
    p = SamplingParams(max_tokens=9, frequency_penalty=0.1)
    assert sample(logits, [SamplingRow.of(p, 0, [3, 3])]).tokens == [3]   # 0.8 > 0.5


def test_min_tokens_masks_every_stop_token():
    logits = torch.zeros(1, 8)
    logits[0, 2] = 5.0
    logits[0, 6] = 4.0
    logits[0, 1] = 1.0
    p = SamplingParams(max_tokens=9, min_tokens=2)
    stops = frozenset({2, 6})
    assert sample(logits, [SamplingRow.of(p, 0, [], (), stops)]).tokens == [1]
    assert sample(logits, [SamplingRow.of(p, 0, [1, 1], (), stops)]).tokens == [2]   # min reached


def test_top_k_top_p_support_matches_transformers_warpers():
    """Every draw lies in the set transformers' top-k and top-p warpers keep."""
    for s in range(10):
        logits = _logits(s)
        p = SamplingParams(max_tokens=4, temperature=0.7, top_k=8, top_p=0.6)
        x = logits / 0.7
        x = TopKLogitsWarper(8)(None, x)
        x = TopPLogitsWarper(0.6)(None, x)
        allowed = set(torch.nonzero(torch.isfinite(x[0])).flatten().tolist())
        for seed in range(20):
            token = sample(logits, [SamplingRow.of(p, seed, [])]).tokens[0]
            assert token in allowed


def test_top_p_keeps_the_tokens_that_tie_with_its_last_one():
    """Hand-worked: logits [2, 1, 1, 1, 0] have probabilities .447, .164 x 3, .060. With
    top_p 0.5 the smallest sorted prefix that reaches it is token 0 and one of the 1s;
    the other two tie with that one and stay (whichever a sort puts first), the 0 goes."""
    from raycolo.generation.sampler import processed_logits

    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 2.0, 0.0]])
    rows = [SamplingRow.of(SamplingParams(max_tokens=2, temperature=1.0, top_p=0.5), 0, [])] * 2
    out = processed_logits(logits, rows)
    assert torch.isfinite(out).tolist() == [[True, True, True, True, False], [True, True, True, True, False]]
    rows = [SamplingRow.of(SamplingParams(max_tokens=2, temperature=1.0, top_p=0.4), 0, [])]
    assert torch.isfinite(processed_logits(logits[:1], rows)).tolist() == [[True, False, False, False, False]]


def test_draw_frequencies_match_the_distribution():
    """A brute force: 4,000 seeded draws over a 4-token distribution at temperature 0.5."""
    logits = torch.tensor([[0.0, 0.5, 1.0, -1.0]])
    p = SamplingParams(max_tokens=2, temperature=0.5)
    counts = [0] * 4
    for seed in range(4000):
        counts[sample(logits, [SamplingRow.of(p, seed, [])]).tokens[0]] += 1
    probs = torch.softmax(logits[0] / 0.5, -1).tolist()
    for c, q in zip(counts, probs):
        assert abs(c / 4000 - q) < 4 * math.sqrt(q * (1 - q) / 4000) + 1e-3


def test_draws_depend_only_on_seed_and_position():
    logits = _logits(3, rows=3)
    p = SamplingParams(max_tokens=9, temperature=1.0)
    alone = sample(logits[1:2], [SamplingRow(p, 42, position=5)]).tokens[0]
    batched = sample(logits, [SamplingRow(p, 1, 0), SamplingRow(p, 42, 5), SamplingRow(p, 7, 2)]).tokens[1]
    assert alone == batched
    assert position_seed(42, 5) != position_seed(42, 6)


def test_logprobs_are_the_raw_distribution():
    logits = _logits(5, rows=2)
    p = SamplingParams(max_tokens=4, logprobs=3, repetition_penalty=1.5)
    out = sample(logits, [SamplingRow.of(p, 0, [1, 2], [3]), SamplingRow.of(SamplingParams(), 0, [])])
    raw = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token == out.tokens[0] and lp.logprob == pytest.approx(float(raw[lp.token]))
    assert [t for t, _ in lp.top] == torch.topk(raw, 3).indices.tolist()
    assert out.logprobs[1] is None


def test_logit_bias_and_min_p_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    P = SamplingParams
    # greedy: +1.5 makes token 1 (2.5) beat token 0; -100 bans token 0 whatever else
    assert sample(logits, [SamplingRow.of(P(max_tokens=2, logit_bias={1: 1.5}), 0, [])]).tokens == [1]
    assert sample(logits, [SamplingRow.of(P(max_tokens=2, logit_bias={0: -100}), 0, [])]).tokens == [1]
    assert not P(max_tokens=2, logit_bias={1: 1.5}).plain_greedy
    # min-p 0.3 at temperature 1: probabilities 0.644, 0.237, 0.087, 0.032; the bar is
    # 0.3 x 0.644 = 0.193, so tokens 0 and 1 stay, renormalised 0.731 / 0.269
    rows = [SamplingRow.of(P(max_tokens=2, temperature=1.0, min_p=0.3), seed, []) for seed in range(4000)]
    x = processed_logits(logits, rows[:1])[0]
    assert torch.isinf(x[2:]).all() and torch.equal(x[:2], logits[0, :2])
    counts = torch.bincount(torch.tensor(sample(logits.expand(4000, 4), rows).tokens), minlength=4)
    assert counts[2:].sum() == 0 and abs(int(counts[0]) / 4000 - 0.731) < 0.03
    # min-p leaves greedy rows alone (the most likely token always stays)
    assert sample(logits, [SamplingRow.of(P(max_tokens=2, min_p=0.9), 0, [])]).tokens == [0]


def test_params_bounds():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])
    assert SamplingParams(stop="x").stop == ("x",)
    for bad in [dict(min_p=1.5), dict(min_p=-0.1), dict(logit_bias={1: 100.5}), dict(logit_bias={-1: 1.0}),
                dict(logit_bias={1: float("inf")}), dict(logit_bias=[(1, 1.0), (1, 2.0)]),
                dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}),
                dict(logit_bias={1: 1.0, "2": 1.0}), dict(logit_bias=[(3, 1.0), ("3", 2.0)])]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(logit_bias={9: 1, 2: -1.5}).logit_bias == ((2, -1.5), (9, 1.0))   # sorted pairs


# -- the batched sampler ---------------------------------------------------------------------
def _mixed_rows(vocab: int = 64) -> list[SamplingRow]:
    P = SamplingParams
    return [
        SamplingRow.of(P(max_tokens=9), 0, [1, 2]),                                        # plain greedy
        SamplingRow.of(P(max_tokens=9, repetition_penalty=1.3, logprobs=2), 0, [4, 4, 9], [1, 2, 3]),
        SamplingRow.of(P(max_tokens=9, temperature=0.8), 11, [5]),
        SamplingRow.of(P(max_tokens=9, temperature=1.2, top_k=5), 12, []),
        SamplingRow.of(P(max_tokens=9, temperature=0.7, top_p=0.8, logprobs=0), 13, [2, 3]),
        SamplingRow.of(P(max_tokens=9, temperature=1.0, top_k=10, top_p=0.6, logprobs=5), 14, [7]),
        SamplingRow.of(P(max_tokens=9, temperature=0.9, repetition_penalty=1.5, presence_penalty=0.5,
                         frequency_penalty=0.3), 15, [3, 3, 8, 60], [8, 20]),
        SamplingRow.of(P(max_tokens=9, min_tokens=4, temperature=0.5, top_k=3), 16, [1], (),
                       frozenset({0, 7, 33, vocab + 5})),                                 # an id past the vocab
        SamplingRow.of(P(max_tokens=9, min_tokens=2, logprobs=1), 0, [], (), frozenset(range(0, vocab, 2))),
        SamplingRow.of(P(max_tokens=9, logit_bias={0: 1.5, 9: -3.0, vocab + 2: 50.0}), 0, []),  # an id past the vocab
        SamplingRow.of(P(max_tokens=9, temperature=1.1, min_p=0.2, logit_bias={4: 2.0}), 17, [4]),
    ]


def test_batched_sample_equals_row_by_row():
    """A row's token, log-probabilities and processed logits do not depend on the batch."""
    rows = _mixed_rows()
    for s in range(5):
        logits = _logits(100 + s, rows=len(rows))
        batch = sample(logits, rows)
        alone = [sample(logits[i:i + 1], [r]) for i, r in enumerate(rows)]
        assert batch.tokens == [a.tokens[0] for a in alone]
        assert batch.logprobs == [a.logprobs[0] for a in alone]
        x = processed_logits(logits, rows)
        for i, r in enumerate(rows):
            assert torch.equal(x[i], processed_logits(logits[i:i + 1], [r])[0])
        assert [lp is not None for lp in batch.logprobs] == [r.params.logprobs is not None for r in rows]
        assert [len(lp.top) for lp in batch.logprobs if lp] == [2, 0, 5, 1]
        raw = torch.log_softmax(logits, -1)
        for i, lp in enumerate(batch.logprobs):
            if lp:
                assert lp.logprob == float(raw[i, batch.tokens[i]])
                assert [t for t, _ in lp.top] == torch.topk(raw[i], len(lp.top)).indices.tolist()
        # rows asking for no penalty are bitwise the raw logits (plain), or differ only in
        # the stop ids they mask (min_tokens, greedy)
        assert torch.equal(x[0], logits[0]) and batch.tokens[0] == int(logits[0].argmax())
        masked = torch.isinf(x[8])
        assert masked.tolist() == [t % 2 == 0 for t in range(64)]
        assert torch.equal(x[8][~masked], logits[8][~masked]) and batch.tokens[8] % 2 == 1
        assert x[7, 0] == x[7, 7] == x[7, 33] == float("-inf") and batch.tokens[7] not in (0, 7, 33)
        bias = torch.zeros(64)
        bias[0], bias[9] = 1.5, -3.0                  # the id past the vocabulary biases nothing
        assert torch.equal(x[9], logits[9] + bias) and batch.tokens[9] == int((logits[9] + bias).argmax())


def _reference(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """transformers' processors (presence/frequency and min_tokens, which it lacks, by
    hand), in vLLM v1's order: the logit bias first, min-p after temperature and before
    top-k and top-p (transformers' own generate() puts min-p last)."""
    p = row.params
    x = logits.unsqueeze(0).clone()
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in p.logit_bias])(torch.tensor([[0]]), x)
    if p.repetition_penalty != 1.0:
        history = torch.tensor([list(row.prompt) + list(row.output)])
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(history, x)
    for t in set(row.output):
        x[0, t] -= p.frequency_penalty * row.output.count(t) + p.presence_penalty
    for t in row.stop_ids if row.position < p.min_tokens else ():
        x[0, t] = float("-inf")
    if not p.greedy:
        x = TemperatureLogitsWarper(p.temperature)(None, x)
        if p.min_p > 0:
            x = MinPLogitsWarper(p.min_p)(None, x)
        if 0 < p.top_k:
            x = TopKLogitsWarper(p.top_k)(None, x)
        if p.top_p < 1.0:
            x = TopPLogitsWarper(p.top_p)(None, x)
    return x[0]


def test_processed_logits_match_transformers_processors():
    P = SamplingParams
    rows = [SamplingRow.of(P(max_tokens=9, temperature=0.7, repetition_penalty=1.4, top_k=20, top_p=0.9), 1,
                           [3, 9, 9], [1, 3, 50]),
            SamplingRow.of(P(max_tokens=9, temperature=1.3, top_p=0.5), 2, [4]),
            SamplingRow.of(P(max_tokens=9, temperature=0.5, top_k=7), 3, []),
            SamplingRow.of(P(max_tokens=9, temperature=1.0, presence_penalty=0.8, frequency_penalty=-0.4,
                             top_p=0.95), 4, [5, 5, 5, 6]),
            SamplingRow.of(P(max_tokens=9, min_tokens=3, temperature=0.9, repetition_penalty=0.8), 5, [2],
                           [7, 8], frozenset({11, 12})),
            SamplingRow.of(P(max_tokens=9, repetition_penalty=2.0, frequency_penalty=0.5), 6, [1, 1], [9]),
            SamplingRow.of(P(max_tokens=9, temperature=0.8, min_p=0.15), 7, []),
            SamplingRow.of(P(max_tokens=9, temperature=1.5, min_p=0.05, top_k=30, top_p=0.9), 8, [2]),
            SamplingRow.of(P(max_tokens=9, logit_bias={3: 2.5, 40: -100.0, 99: 1.0}), 9, []),
            SamplingRow.of(P(max_tokens=9, temperature=0.9, logit_bias={5: 3.0, 7: -2.0}, repetition_penalty=1.6,
                             min_p=0.1), 10, [5, 7], [1])]
    for s in range(20):
        logits = _logits(200 + s, rows=len(rows), vocab=100)
        ours = processed_logits(logits, rows)
        for i, row in enumerate(rows):
            theirs = _reference(logits[i], row)
            assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(theirs)), (s, i)
            assert torch.allclose(torch.softmax(ours[i], -1), torch.softmax(theirs, -1), atol=1e-6), (s, i)
            if row.params.greedy:
                assert sample(logits[i:i + 1], [row]).tokens[0] == int(theirs.argmax())


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=2.5, top_k=6, top_p=0.9),
                                    dict(temperature=2.0, top_p=0.9, repetition_penalty=1.3)])
def test_draw_frequencies_over_seeds_match_the_processed_distribution(params):
    """4,000 rows of one batch (seeds 0..3999): the draws' frequencies are the softmax of
    the processed logits (total variation < 0.05), and lie in their support."""
    logits = _logits(7, vocab=12).expand(4000, 12)
    rows = [SamplingRow.of(SamplingParams(max_tokens=9, **params), seed, [0, 1], [2]) for seed in range(4000)]
    tokens = sample(logits, rows).tokens
    probs = torch.softmax(processed_logits(logits[:1], rows[:1])[0], -1)
    freq = torch.bincount(torch.tensor(tokens), minlength=12).double() / 4000
    assert 0.5 * float((freq - probs.double()).abs().sum()) < 0.05
    assert set(tokens) <= set(torch.nonzero(probs > 0).flatten().tolist())
    assert len(set(tokens)) > 1


def test_race_chunks_do_not_change_draws():
    y = _logits(9, rows=10, vocab=50)
    seeds = torch.tensor([position_seed(s, 3) for s in range(10)])
    assert torch.equal(_race(y, seeds), _race(y, seeds, elements=120))     # chunks of 2 rows
    assert torch.equal(_race(y, seeds), torch.cat([_race(y[i:i + 1], seeds[i:i + 1]) for i in range(10)]))


# -- the counter-based random bits -------------------------------------------------------------
M32 = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _bits(seed: int, i: int) -> int:
    k1 = _fmix32((seed & M32) ^ 0x9E3779B9)
    k2 = _fmix32((seed >> 32) ^ 0x7F4A7C15)
    return _fmix32(_fmix32(((i * 0x9E3779B1) & M32) ^ k1) ^ k2)


SEEDS = [0, 1, 2**31, 2**32 - 1, 2**32, position_seed(42, 5), position_seed(2**62, 7), 2**63 - 1]


def test_hash_matches_pure_python():
    """The int64 tensor ops (products up to 2**63 in size, never overflowing) give the
    exact 32-bit arithmetic of a pure-Python reimplementation."""
    assert _fmix32(1) == 0x514E28B7 and int(fmix32(torch.tensor([1]))) == 0x514E28B7    # murmur3's
    got = hash_bits(torch.tensor(SEEDS), 1 << 17)
    for r, seed in enumerate(SEEDS):
        for i in (0, 1, 2, 1000, 65535, (1 << 17) - 1):
            assert int(got[r, i]) == _bits(seed, i), (seed, i)
    assert int(got.min()) >= 0 and int(got.max()) <= M32
    b = _bits(position_seed(42, 5), 7)
    assert to_uniform(torch.tensor([b])).item() == pytest.approx((b + 0.5) / 2**32, rel=2**-23)


def test_random_bits_depend_only_on_seed_and_index():
    seeds = torch.tensor(SEEDS)
    batch = hash_bits(seeds, 500)
    for r in range(len(SEEDS)):
        assert torch.equal(batch[r], hash_bits(seeds[r:r + 1], 500)[0])
        assert torch.equal(batch[r, :100], hash_bits(seeds[r:r + 1], 100)[0])
    assert len({tuple(row) for row in batch.tolist()}) == len(SEEDS)
    assert all(len(set(row)) == 500 for row in batch.tolist())          # a bijection in the index


def test_uniforms_strictly_inside_the_unit_interval():
    edges = to_uniform(torch.tensor([0, 1, 2**31, 2**32 - 2**8, 2**32 - 1]))
    assert edges[0].item() == 0.5 * 2.0**-32 and edges[2].item() == 0.5
    assert bool((edges > 0).all()) and bool((edges < 1).all())
    u = uniforms(torch.tensor(SEEDS), 50_000)
    assert bool((u > 0).all()) and bool((u < 1).all()) and abs(float(u.mean()) - 0.5) < 0.005
    q = exponentials(torch.tensor(SEEDS), 50_000).double()
    assert bool(torch.isfinite(q).all()) and bool((q > 0).all())
    assert abs(float(q.mean()) - 1) < 0.01 and abs(float(q.var()) - 1) < 0.03


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_draws_equal_cpu_draws():
    rows = _mixed_rows()
    for s in range(5):
        logits = _logits(300 + s, rows=len(rows))
        cpu = sample(logits, rows)
        gpu = sample(logits.cuda(), rows)
        assert gpu.tokens == cpu.tokens
        for a, b in zip(gpu.logprobs, cpu.logprobs):
            assert (a is None) == (b is None)
            if a:
                assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    seeds = torch.tensor(SEEDS)
    assert torch.equal(hash_bits(seeds.cuda(), 4096).cpu(), hash_bits(seeds, 4096))
    assert torch.equal(uniforms(seeds.cuda(), 4096).cpu(), uniforms(seeds, 4096))
