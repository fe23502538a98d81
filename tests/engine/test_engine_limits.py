"""TorchEngine's errors (config and validation), its memory, the byte tokenizer, handing
requests back (``take``) and sleep/wake-up, against transformers and by hand.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from raycolo.engine import SamplingParams, create_engine
from raycolo.engine.models import (BOS_ID, BYTE_OFFSET, EOS_ID, ByteTokenizer)
from raycolo.errors import ConfigError
from tests.support.engine_cases import MAX_TOKENS, MODEL, PROMPTS, TOK, deadline, generate, make_engine
from tests.support.engine_cases import _one_torch_thread, e64, greedy64  # noqa: F401  (pytest fixtures)


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
    """tp > 1 runs (tests/engine/test_tensor_parallel.py); one that does not divide the model's
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
