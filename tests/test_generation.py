"""raycolo.generation against hand-worked cases, transformers' logits processors and a
brute force: the EOS set, the stop checker's order, stop strings, penalties, min_tokens,
top-k/top-p and log-probabilities."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper)

from raycolo.engine.models import ByteTokenizer
from raycolo.generation import SamplingParams, StopChecker, check_stop, eos_token_ids, stop_token_set
from raycolo.generation.sampler import SamplingRow, position_seed, sample

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


def test_params_bounds():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])
    assert SamplingParams(stop="x").stop == ("x",)
