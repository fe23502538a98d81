"""TorchEngine against transformers: greedy equals ``generate()`` with batched left-padded
decode, preemption by recompute, many requests in a small batch, iteration records, EOS,
seeded sampling and checkpoint directories. tests/engine/test_engine_limits.py has its
errors, memory, the byte tokenizer, take and sleep.
"""
from __future__ import annotations

import random

import pytest
import torch

from raycolo.engine import SamplingParams
from raycolo.engine.models import (BOS_ID, BYTE_OFFSET, EOS_ID, build_tiny_model, save_tiny_checkpoint)
from tests.support.engine_cases import (MAX_TOKENS, MODEL, PROMPTS, SEED, TOK, generate, hf_greedy,
                                        make_engine, total_new_tokens)
from tests.support.engine_cases import _one_torch_thread, e64, greedy64, ref64  # noqa: F401  (pytest fixtures)


# -- 1. greedy equals transformers' greedy ----------------------------------------------
def test_greedy_float64_matches_transformers_generate_with_batched_left_padded_decode(greedy64, ref64):
    outs, iterations = greedy64
    # The requests really were decoded together (left padding to the longest prompt).
    assert any(r.kind == "decode" and r.num_seqs == len(PROMPTS) for r in iterations)
    assert any(r.kind == "decode" and len(set(r.context_lens)) > 1 for r in iterations)
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(ref64, prompt, n)
        assert out.finish_reason == "length"
        assert out.output_len == n
    # The outputs are not degenerate (otherwise equality would prove little).
    assert len({t for o in outs for t in o.token_ids}) > 10


def test_greedy_float32_first_tokens_match_transformers():
    engine = make_engine(dtype="float32", max_num_seqs=8)
    model, _ = build_tiny_model(MODEL, SEED, "float32")
    n = 8
    outs = generate(engine, PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    assert any(r.kind == "decode" and r.num_seqs == len(PROMPTS) for r in engine.stats.iterations)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(model, prompt, n)
        assert out.output_len == n
        assert out.token_ids[:4] == ref[:4]
    engine.release()


# -- 2. preemption by recompute does not change greedy output -----------------------------
def test_preemption_recompute_gives_same_tokens_as_large_kv_budget(e64):
    rng = random.Random(7)
    prompts = [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(rng.randrange(3, 9))]
               for _ in range(5)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=2)    # scored once, kept
    big = generate(e64, prompts, params)
    # 10 blocks of 4 tokens: every request fits alone (<= 25 tokens, 7 blocks) but five
    # growing together do not, so running requests are preempted and recomputed.
    small = make_engine(dtype="float64", block_size=4, kv_cache_tokens=40)
    outs = generate(small, prompts, params)
    preempted = sum(r.preempted for r in small.stats.iterations)
    assert preempted > 0
    assert sum(o.preemptions for o in outs) == preempted
    assert any(o.preemptions > 0 for o in outs)
    for b, s in zip(big, outs):
        assert s.token_ids == b.token_ids
        assert s.finish_reason == "length"
        assert len(s.prompt_logprobs) == len(s.prompt_token_ids) and s.prompt_logprobs[0] is None
        for x, y in zip(s.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert (x.token, x.rank, [t for t, _ in x.top]) == (y.token, y.rank, [t for t, _ in y.top])
            assert x.logprob == pytest.approx(y.logprob, abs=1e-9)
    # Re-prefills produce new tokens, never re-produce old ones.
    assert total_new_tokens(small.stats.iterations) == sum(o.output_len for o in outs)
    assert small.memory().kv_blocks_used == 0
    small.release()


# -- 3 & 5. many requests, small batch: everything finishes; iteration records ------------
MAX_NUM_SEQS = 4
MAX_BATCHED = 48


@pytest.fixture(scope="module")
def many():
    torch.set_num_threads(2)
    engine = make_engine(dtype="float32", max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED,
                         cpu_threads=1)
    assert torch.get_num_threads() == 1  # engine_kwargs.cpu_threads took effect
    rng = random.Random(3)
    prompts, params = [], []
    for i in range(30):
        length = rng.randrange(1, 40) if i != 5 else 70  # one prompt alone exceeds the token budget
        prompts.append([BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(length)])
        params.append(SamplingParams(max_tokens=rng.randrange(1, 13), ignore_eos=True))
    outs = generate(engine, prompts, params)
    yield engine, prompts, params, outs
    engine.release()


def test_every_request_finishes_with_its_max_tokens(many):
    engine, prompts, params, outs = many
    assert len(outs) == 30
    assert len({o.request_id for o in outs}) == 30
    for prompt, p, o in zip(prompts, params, outs):
        assert o.prompt_token_ids == prompt
        assert o.output_len == p.max_tokens
        assert o.finish_reason == "length"
        assert all(0 <= t < 512 for t in o.token_ids)
        assert o.text == TOK.decode(o.token_ids).rstrip("\ufffd")    # a cut-off last character is not text
        assert o.arrival_s <= o.first_token_s <= o.finish_s
    assert not engine.has_unfinished()
    assert engine.memory().kv_blocks_used == 0


def test_iteration_records_are_consistent(many):
    engine, prompts, params, outs = many
    its = engine.stats.iterations
    assert its
    assert {r.kind for r in its} == {"prefill", "decode"}
    for r in its:
        assert r.kind in ("prefill", "decode")
        assert 0 < r.num_seqs <= MAX_NUM_SEQS
        assert len(r.context_lens) == r.num_seqs
        assert r.new_tokens == r.num_seqs
        assert all(c > 0 for c in r.context_lens)
        assert r.seconds > 0
        assert r.preempted == 0
        if r.kind == "prefill":
            assert r.tokens <= MAX_BATCHED or r.num_seqs == 1
    assert total_new_tokens(its) == sum(o.output_len for o in outs)
    # Each request is prefilled exactly once (no preemption with the default KV budget),
    # with its whole prompt as context.
    prefill_lens = sorted(c for r in its if r.kind == "prefill" for c in r.context_lens)
    assert prefill_lens == sorted(len(p) for p in prompts)
    # The over-budget prompt ran, alone.
    assert any(r.kind == "prefill" and r.num_seqs == 1 and r.tokens > MAX_BATCHED for r in its)
    # The batch was actually full at times.
    assert max(r.num_seqs for r in its if r.kind == "decode") == MAX_NUM_SEQS


def test_decode_context_lens_count_prompt_and_generated(e64):
    start = len(e64.stats.iterations)
    prompt = TOK.encode("abc")
    generate(e64, [prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    its = e64.stats.iterations[start:]
    assert [r.kind for r in its] == ["prefill"] + ["decode"] * 4
    # Decode step k attends the prompt plus the k tokens generated so far (the newest included).
    assert [r.context_lens for r in its] == [[len(prompt) + k] for k in range(5)]


# -- 3b. EOS ------------------------------------------------------------------------------
EOS_PROMPT = TOK.encode("Hi")


@pytest.fixture(scope="module")
def eos_engine(tmp_path_factory):
    """A real checkpoint whose EOS row of lm_head is 1.5x the row of the token that
    greedy decoding of EOS_PROMPT produces first, so that EOS wins wherever that token
    would (its logit is positive there): EOS becomes a frequent greedy token."""
    model, tok = build_tiny_model(MODEL, SEED, "float32")
    with torch.no_grad():
        first = int(model(torch.tensor([EOS_PROMPT])).logits[0, -1].argmax())
        assert first != EOS_ID
        model.lm_head.weight[EOS_ID] = 1.5 * model.lm_head.weight[first]
    path = tmp_path_factory.mktemp("eos-ckpt")
    model.save_pretrained(path)
    engine = make_engine(model_id=str(path), dtype="float64", max_num_seqs=4)
    yield engine
    engine.release()


def test_eos_stops_a_request_and_is_its_last_token(eos_engine):
    rng = random.Random(11)
    prompts = [EOS_PROMPT] + [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256)
                                          for _ in range(rng.randrange(1, 12))] for _ in range(7)]
    n = 16
    free = generate(eos_engine, prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    stop = generate(eos_engine, prompts, SamplingParams(max_tokens=n))
    # The prompt whose first greedy token is EOS finishes on its prefill.
    assert stop[0].token_ids == [EOS_ID]
    assert stop[0].finish_reason == "stop"
    assert stop[0].text == ""
    assert free[0].token_ids[0] == EOS_ID and free[0].output_len == n
    mid_stream = 0
    for f, s in zip(free, stop):
        assert f.output_len == n and f.finish_reason == "length"
        if EOS_ID in f.token_ids:
            k = f.token_ids.index(EOS_ID)
            mid_stream += k > 0
            assert s.finish_reason == "stop"
            assert s.token_ids == f.token_ids[:k + 1]
            assert s.token_ids[-1] == EOS_ID
            assert EOS_ID not in s.token_ids[:-1]
        else:
            assert s.finish_reason == "length"
            assert s.token_ids == f.token_ids
    assert mid_stream > 0, "the test needs a request that hits EOS after its first token"
    assert eos_engine.memory().kv_blocks_used == 0
    assert not eos_engine.has_unfinished()


# -- 4. sampling ----------------------------------------------------------------------------
def test_sampling_seeded_reproducible_across_engines_and_seeds_differ(e64):
    other = make_engine(dtype="float64")
    prompts = PROMPTS[:2]
    p1 = SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True)
    p2 = SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True)
    a = generate(e64, prompts, p1)
    b = generate(other, prompts, p1)
    c = generate(other, prompts, p2)
    for x, y, z in zip(a, b, c):
        assert x.output_len == 16
        assert x.token_ids == y.token_ids
        assert x.token_ids != z.token_ids
    other.release()


def test_sampling_is_not_greedy_and_tiny_top_p_is_greedy(e64, greedy64):
    greedy_outs, _ = greedy64
    hot = generate(e64, PROMPTS, [SamplingParams(max_tokens=n, temperature=1.0, seed=5, ignore_eos=True)
                                 for n in MAX_TOKENS])
    assert any(h.token_ids != g.token_ids for h, g in zip(hot, greedy_outs))
    nucleus = generate(e64, PROMPTS, [SamplingParams(max_tokens=n, temperature=1.0, top_p=1e-6, seed=s,
                                                    ignore_eos=True)
                                     for s, n in enumerate(MAX_TOKENS)])
    for g, t in zip(greedy_outs, nucleus):
        assert t.token_ids == g.token_ids


# -- 6. checkpoint directories ------------------------------------------------------------
def test_checkpoint_directory_gives_same_greedy_tokens_as_catalog_model(tmp_path, greedy64):
    greedy_outs, _ = greedy64
    save_tiny_checkpoint(MODEL, tmp_path, seed=SEED)
    assert (tmp_path / "config.json").exists()
    engine = make_engine(model_id=str(tmp_path), dtype="float64")
    outs = generate(engine, PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == [g.token_ids for g in greedy_outs]
    # Text prompts go through the same byte tokenizer.
    text = generate(engine, ["Hi"], SamplingParams(max_tokens=MAX_TOKENS[0], ignore_eos=True))[0]
    assert text.prompt_token_ids == PROMPTS[0]
    assert text.token_ids == greedy_outs[0].token_ids
    engine.release()


def test_checkpoint_of_another_seed_differs(tmp_path, greedy64):
    greedy_outs, _ = greedy64
    save_tiny_checkpoint(MODEL, tmp_path, seed=SEED + 1)
    engine = make_engine(model_id=str(tmp_path), dtype="float64")
    out = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS[0], ignore_eos=True))[0]
    assert out.token_ids != greedy_outs[0].token_ids
    engine.release()
