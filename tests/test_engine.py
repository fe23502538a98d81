"""The torch engine against real (tiny, seeded-random) transformers models.

No mocks: every test runs a real LlamaForCausalLM on the CPU. The reference for greedy
decoding is transformers' own ``model.generate``; float64 keeps the arithmetic of the
engine's batched, left-padded decode steps and of recompute-after-preemption equal to
the reference's up to rounding far below any argmax margin.
"""
from __future__ import annotations

import contextlib
import math
import random
import signal

import pytest
import torch
from pydantic import ValidationError

from raycolo.engine import SamplingParams, create_engine
from raycolo.engine.models import (BOS_ID, BYTE_OFFSET, EOS_ID, ByteTokenizer, build_tiny_model,
                                    save_tiny_checkpoint)
from raycolo.errors import ConfigError

MODEL = "tiny-llama-s"
SEED = 0


def make_engine(model_id: str = MODEL, dtype: str = "float64", seed: int = SEED, **engine_kwargs):
    return create_engine({"model_loading_config": {"model_id": model_id, "seed": seed, "dtype": dtype},
                          "engine_kwargs": engine_kwargs})


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine
    OpenMP spin-waiting makes them many times slower; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def deadline(seconds: int = 60):
    """Turn an engine that never finishes (e.g. a scheduler stuck idle) into a failure."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"the engine did not finish within {seconds} s (stuck scheduler?)")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def generate(engine, prompts, params):
    with deadline():
        return engine.generate(prompts, params)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding of ``n`` tokens, EOS disabled so the length is fixed."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                           bos_token_id=BOS_ID)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def total_new_tokens(iterations) -> int:
    return sum(r.new_tokens for r in iterations)


TOK = ByteTokenizer(512)
# Different lengths on purpose: the decode batch is left-padded to the longest.
PROMPTS = [TOK.encode(s) for s in ("Hi", "The quick brown fox jumps", "raycolo batches requests, "
                                   "one iteration at a time.")]
MAX_TOKENS = [16, 12, 14]  # the batch shrinks as requests finish


# -- engines built once per module ------------------------------------------------------
@pytest.fixture(scope="module")
def e64():
    engine = make_engine(dtype="float64")
    yield engine
    engine.release()


@pytest.fixture(scope="module")
def ref64():
    model, _ = build_tiny_model(MODEL, SEED, "float64")
    return model


@pytest.fixture(scope="module")
def greedy64(e64):
    """Greedy outputs of PROMPTS, run together in the float64 engine."""
    start = len(e64.stats.iterations)
    outs = generate(e64, PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return outs, e64.stats.iterations[start:]


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
    params = SamplingParams(max_tokens=16, ignore_eos=True)
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


# -- 7. errors ------------------------------------------------------------------------------
def test_prompt_plus_max_tokens_beyond_positions_is_a_config_error():
    engine = make_engine(dtype="float32")
    positions = engine.model.config.max_position_embeddings
    assert positions == 1024
    with pytest.raises(ConfigError, match="positions"):
        engine.add_request("too-long", [BOS_ID] * 1000, SamplingParams(max_tokens=25))
    with pytest.raises(ConfigError, match="positions"):
        engine.add_request("too-long-2", [BOS_ID] * 1025, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished()
    # Exactly at the limit is accepted.
    engine.add_request("fits", [BOS_ID] * 1000, SamplingParams(max_tokens=24))
    assert engine.has_unfinished()
    engine.release()


def test_request_needing_more_kv_blocks_than_the_engine_has_is_a_config_error():
    engine = make_engine(dtype="float32", block_size=4, kv_cache_tokens=16)  # 4 blocks
    assert engine.memory().kv_blocks_total == 4
    prompt = [BOS_ID, 10, 11, 12, 13]
    with pytest.raises(ConfigError, match="kv_cache_tokens"):
        engine.add_request("big", prompt, SamplingParams(max_tokens=12, ignore_eos=True))  # 17 tokens
    assert not engine.has_unfinished()
    # 16 tokens fit in 4 blocks and the request runs to completion alone.
    out = generate(engine, [prompt], SamplingParams(max_tokens=11, ignore_eos=True))[0]
    assert out.output_len == 11
    assert engine.memory().kv_blocks_used == 0
    engine.release()


def test_empty_prompt_is_a_config_error(e64):
    with pytest.raises(ConfigError):
        e64.add_request("empty", [], SamplingParams())
    assert not e64.has_unfinished()


@pytest.mark.parametrize("model_id", ["no-such-model", "/nonexistent/raycolo/checkpoint"])
def test_unknown_model_id_is_a_config_error(model_id):
    with pytest.raises(ConfigError):
        make_engine(model_id=model_id)


def test_directory_without_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        make_engine(model_id=str(tmp_path))


def test_cuda_device_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        engine = make_engine(device="cuda")
        assert next(engine.model.parameters()).is_cuda
        engine.release()
    else:
        with pytest.raises(ConfigError, match="device"):
            make_engine(device="cuda")


def test_a_tensor_parallel_size_that_cannot_split_the_model_is_a_config_error():
    """tp > 1 runs (tests/test_tensor_parallel.py); one that does not divide the model's
    heads is refused before any rank starts, naming the field."""
    import torch.distributed as dist

    with pytest.raises(ConfigError, match="^engine_kwargs.tensor_parallel_size: 3 does not divide"):
        make_engine(tensor_parallel_size=3)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -0.1},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"max_token": 5}])
def test_invalid_sampling_params_are_validation_errors(kwargs):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("config", [
    {"model_loading_config": {"model_id": MODEL, "dtype": "int8"}},
    {"model_loading_config": {"model_id": MODEL}, "engine_kwargs": {"max_num_seqs": 0}},
    {"model_loading_config": {"model_id": MODEL}, "engine_kwargs": {"watermark": 1.0}},
    {"model_loading_config": {"model_id": MODEL}, "engine_kwargs": {"no_such_kwarg": 1}},
    {"backend": "tgi", "model_loading_config": {"model_id": MODEL}},
])
def test_invalid_engine_configs_are_validation_errors(config):
    with pytest.raises(ValidationError):
        create_engine(config)


# -- 8. memory ------------------------------------------------------------------------------
def test_memory_tracks_kv_while_running_and_frees_it_after(e64):
    mem = e64.memory()
    n_params = sum(p.numel() for p in e64.model.parameters())
    assert mem.weight_bytes == 8 * n_params > 0  # float64
    assert mem.kv_blocks_total == 65536 // 16
    assert mem.kv_blocks_used == 0 and mem.kv_bytes == 0
    prompts = [TOK.encode("x" * 20), TOK.encode("memory")]  # 21 and 7 tokens
    for i, p in enumerate(prompts):
        e64.add_request(f"mem-{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
    assert e64.step() == []  # prefill of both
    mem = e64.memory()
    assert mem.kv_blocks_used == math.ceil(21 / 16) + math.ceil(7 / 16) > 0
    cfg = e64.model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8
    assert mem.kv_bytes == per_token * (21 + 7)
    e64.step()  # one decode
    assert e64.memory().kv_bytes == per_token * (22 + 8)
    with deadline():
        outs = e64.run_until_done()
    assert sorted(o.request_id for o in outs) == ["mem-0", "mem-1"]
    mem = e64.memory()
    assert mem.kv_blocks_used == 0 and mem.kv_bytes == 0
    assert e64.step() == []  # idle


# -- 9. byte tokenizer ------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "hello, world", "tab\tnewline\n", "héllo wörld ✓ 日本語 🚀"])
def test_byte_tokenizer_round_trips(text):
    ids = TOK.encode(text)
    assert ids[0] == BOS_ID
    assert ids[1:] == [b + BYTE_OFFSET for b in text.encode("utf-8")]
    assert all(BYTE_OFFSET <= i < BYTE_OFFSET + 256 for i in ids[1:])
    assert TOK.decode(ids) == text
    # Specials and ids beyond the bytes decode to nothing.
    assert TOK.decode([EOS_ID] + ids + [0, 300, 511, EOS_ID]) == text


def test_byte_tokenizer_needs_room_for_all_bytes():
    with pytest.raises(ConfigError):
        ByteTokenizer(BYTE_OFFSET + 255)
    assert ByteTokenizer(BYTE_OFFSET + 256).vocab_size == BYTE_OFFSET + 256


def test_text_prompts_equal_their_token_ids(e64):
    text = "héllo ✓"
    a, b = generate(e64, [text, TOK.encode(text)], SamplingParams(max_tokens=6, ignore_eos=True))
    assert a.prompt_token_ids == b.prompt_token_ids == TOK.encode(text)
    assert a.token_ids == b.token_ids
    assert a.text == TOK.decode(a.token_ids).rstrip("\ufffd")


def test_take_hands_back_the_least_advanced_and_they_continue_exactly(e64):
    """``take`` removes the requests with the least work (not started first, then the
    fewest tokens), frees their KV, and returns them with their tokens; continued
    elsewhere from prompt + tokens (greedy), every request ends with exactly the tokens
    an uninterrupted run gives. ``reset`` then leaves an empty engine that serves anew."""
    rng = random.Random(11)
    prompts = [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(6)] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = {str(i): list(o.token_ids) for i, o in enumerate(generate(e64, prompts, params))}
    engine = make_engine(dtype="float64", max_num_seqs=3)    # 3 run, 3 wait
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    for _ in range(4):
        engine.step()
    taken = engine.take(4)
    assert [len(r.generated) > 0 for r in taken] == [False, False, False, True]    # waiting first
    assert {r.request_id for r in taken[:3]} == {"3", "4", "5"}
    assert len(engine.requests) == 2
    finished = {o.request_id: list(o.token_ids) for o in engine.run_until_done()}
    assert engine.memory().kv_blocks_used == 0
    other = make_engine(dtype="float64")
    for r in taken:
        other.add_request(r.request_id, list(r.prompt) + list(r.generated),
                          SamplingParams(max_tokens=12 - len(r.generated), ignore_eos=True))
    prior = {r.request_id: list(r.generated) for r in taken}
    for o in other.run_until_done():
        finished[o.request_id] = prior[o.request_id] + list(o.token_ids)
    assert finished == expected
    engine.add_request("again", prompts[0], params)
    engine.step()
    assert engine.reset() and not engine.requests and engine.memory().kv_blocks_used == 0
    assert list(generate(engine, [prompts[0]], params)[0].token_ids) == expected["0"]
    engine.release()
    other.release()


def test_a_slept_engine_frees_its_kv_cache_and_wakes_to_the_same_outputs(greedy64):
    """``sleep`` drops the running requests and frees the preallocated KV cache (no tensor
    left), keeping the model; after ``wake_up`` the engine answers exactly as before
    (greedy against the module's reference run, which a fresh engine produced) and a
    seeded sample as a fresh engine does."""
    engine = make_engine(dtype="float64")
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=5)
    fresh = make_engine(dtype="float64")
    expected_sample = generate(fresh, [PROMPTS[1]], sampled)[0].token_ids
    fresh.release()
    engine.add_request("left", PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.memory().kv_blocks_used > 0
    cache = engine.executor.cache
    assert engine.sleep() is True
    assert not engine.requests and not cache.allocated and cache.keys == [] and cache.values == []
    engine.wake_up()
    assert cache.allocated and all(float(k.abs().sum()) == 0 for k in cache.keys)
    outs, _ = greedy64
    again = generate(engine, PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert generate(engine, [PROMPTS[1]], sampled)[0].token_ids == expected_sample
    engine.release()
