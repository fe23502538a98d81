"""The model executor (raycolo.engine.executor) against transformers' own forward and generate().

Real tiny models of each fast-path family (Llama, Qwen2 with a sliding-window layer,
Mistral with a sliding window shorter than the test contexts), one fallback architecture
(GPT-2), peft LoRA, layer slices. float64 keeps every comparison far below any argmax
margin, so greedy outputs must agree token for token.
"""
from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from raycolo.engine import SamplingParams, create_engine
from raycolo.engine.models import BOS_ID, BYTE_OFFSET, EOS_ID, TINY_SLIDING_WINDOW, build_tiny_model
from raycolo.errors import ConfigError
from raycolo.engine.executor import FallbackExecutor, ModelExecutor, SeqChunk, create_executor, fast_path_family
from raycolo.batching.blocks import BlockAllocator


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(n - 1)]
            for n in lengths]


def hf_greedy(model, prompt, n):
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # generate() falls back to it otherwise
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def engine_for(model_id, **kw):
    return create_engine({"model_loading_config": {"model_id": model_id, "dtype": "float64"},
                          "engine_kwargs": {"block_size": 4, **kw}})


def checked_run(engine, prompts, params):
    """Run to completion, checking the block books after every iteration against an
    independent count: each running request holds ceil(stored / block_size) blocks, every
    other request none, and every block is free or held exactly once."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    sched, bs = engine.scheduler, engine.limits.block_size
    outs, deadline = {}, time.monotonic() + 120
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine did not finish"
        for o in engine.step():
            outs[o.request_id] = o
        sched.alloc.check()
        expect = {h: -(-n // bs) for h, n in sched.stored.items()}
        assert {h: len(t) for h, t in sched.alloc.tables.items() if t} == expect
    assert sched.blocks_used == 0 and not sched.alloc.tables
    sched.alloc.check()
    return [outs[r] for r in ids]


# -- greedy equality, every family ----------------------------------------------------------
@pytest.mark.parametrize("model_id", ["tiny-llama-m", "tiny-qwen2-s", "tiny-mistral-s"])
def test_greedy_equals_transformers_generate_for_each_fast_path_family(model_id):
    model, _ = build_tiny_model(model_id, 0, "float64")
    assert fast_path_family(model) is not None
    # Contexts reach beyond the sliding window of the Mistral and the Qwen2 model.
    prompts = random_prompts([3, 20, 41, 60])
    lengths = [30, 12, 25, 20]
    assert max(len(p) + n for p, n in zip(prompts, lengths)) > TINY_SLIDING_WINDOW + 20
    engine = engine_for(model_id)
    assert isinstance(engine.executor, ModelExecutor)
    outs = checked_run(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert any(r.kind == "decode" and r.num_seqs == 4 for r in engine.stats.iterations)
    for p, n, o in zip(prompts, lengths, outs):
        assert o.token_ids == hf_greedy(model, p, n)
    assert len({t for o in outs for t in o.token_ids}) >= 8  # not degenerate


def test_sliding_window_really_changes_the_output():
    """The windowed models differ from the same weights with full attention, so the
    equality above checks the window and not just causal attention."""
    model, _ = build_tiny_model("tiny-mistral-s", 0, "float64")
    prompt = random_prompts([70])[0]
    windowed = hf_greedy(model, prompt, 20)
    model.config.sliding_window = None
    full = create_executor(model, 64, 4)
    alloc = BlockAllocator(64)
    alloc.allocate(0, 18)
    logits = full.execute(full.batch([SeqChunk(prompt, 0, alloc.tables[0])]))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, rtol=0, atol=1e-10)
    assert hf_greedy(model, prompt, 20) != windowed


def gpt2_checkpoint(path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(3)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return GPT2LMHeadModel.from_pretrained(path, dtype=torch.float64).eval()


def test_fallback_architecture_is_correct_and_says_so_once(tmp_path, caplog):
    model = gpt2_checkpoint(tmp_path)
    assert fast_path_family(model) is None
    prompts = random_prompts([4, 17, 30])
    lengths = [15, 9, 12]
    FallbackExecutor._warned.discard("GPT2LMHeadModel")
    with caplog.at_level(logging.WARNING, logger="raycolo.engine.executor"):
        engine = engine_for(str(tmp_path))
        engine_for(str(tmp_path)).release()
    assert isinstance(engine.executor, FallbackExecutor)
    warnings = [r for r in caplog.records if "GPT2LMHeadModel" in r.getMessage()]
    assert len(warnings) == 1 and "fast path" in warnings[0].getMessage()
    outs = checked_run(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert any(r.kind == "decode" and r.num_seqs == 3 for r in engine.stats.iterations)
    for p, n, o in zip(prompts, lengths, outs):
        assert o.token_ids == hf_greedy(model, p, n)
    assert not engine.executor.caches  # every finished sequence's cache was dropped
    with pytest.raises(ConfigError, match="whole models"):
        FallbackExecutor(model, 16, 4, layers=(0, 1))


# -- preemption and block accounting --------------------------------------------------------
@pytest.mark.parametrize("model_id", ["tiny-qwen2-s", "tiny-mistral-s"])
def test_preemption_recompute_gives_the_same_tokens_and_balances_the_blocks(model_id):
    prompts = random_prompts([5, 9, 7, 12, 6], seed=7)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    big = checked_run(engine_for(model_id), prompts, params)
    # 12 blocks of 4 tokens: each request fits alone (<= 28 tokens, 7 blocks), five
    # growing together do not.
    small = engine_for(model_id, kv_cache_tokens=48)
    outs = checked_run(small, prompts, params)
    assert sum(r.preempted for r in small.stats.iterations) > 0
    assert any(o.preemptions for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]


# -- layer slices ------------------------------------------------------------------------
def run_steps(executors, prompts, steps, block_size=4):
    """Prefill ``prompts`` then ``steps`` greedy decode steps through a chain of slices;
    returns the logits of every step."""
    alloc = BlockAllocator(256)
    for i, p in enumerate(prompts):
        alloc.allocate(i, -(-(len(p) + steps) // block_size))
    seqs = [list(p) for p in prompts]
    chunks = [SeqChunk(p, 0, alloc.tables[i]) for i, p in enumerate(prompts)]
    every = []
    for _ in range(steps + 1):
        hidden = None
        for ex in executors:
            out = ex.execute(ex.batch(chunks), hidden)
            hidden = out
        every.append(out)
        for i, t in enumerate(out.argmax(-1).tolist()):
            seqs[i].append(t)
        chunks = [SeqChunk([s[-1]], len(s) - 1, alloc.tables[i]) for i, s in enumerate(seqs)]
    return every, seqs


def test_chained_layer_slices_equal_the_whole_model_and_transformers():
    model, _ = build_tiny_model("tiny-llama-m", 0, "float64")  # 4 layers
    prompts = random_prompts([6, 13, 3])
    whole, seqs = run_steps([create_executor(model, 256, 4)], prompts, 6)
    slices = [create_executor(model, 256, 4, layers=r) for r in [(0, 1), (1, 3), (3, 4)]]
    assert [(s.is_first, s.is_last) for s in slices] == [(True, False), (False, False), (False, True)]
    assert [s.cache.num_layers for s in slices] == [1, 2, 1]  # each caches its own layers only
    chained, _ = run_steps(slices, prompts, 6)
    for a, b in zip(whole, chained):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with torch.no_grad():  # and the whole executor equals transformers on the full sequences
        for i, s in enumerate(seqs):
            ref = model(torch.tensor([s[:-1]])).logits[0, len(prompts[i]) - 1:]
            got = torch.stack([step[i] for step in whole])
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_slice_errors():
    model, _ = build_tiny_model("tiny-llama-s", 0, "float64")  # 2 layers
    for bad in [(0, 0), (1, 1), (0, 3), (-1, 1), (2, 3)]:
        with pytest.raises(ConfigError, match="layers"):
            ModelExecutor(model, 16, 4, layers=bad)
    second = ModelExecutor(model, 16, 4, layers=(1, 2))
    alloc = BlockAllocator(16)
    alloc.allocate(0, 1)
    with pytest.raises(ValueError, match="hidden states"):
        second.execute(second.batch([SeqChunk([5, 6], 0, alloc.tables[0])]))
    with pytest.raises(ValueError, match="blocks"):
        second.batch([SeqChunk([5] * 5, 0, alloc.tables[0])])  # 5 tokens, one 4-token block


# -- peft LoRA ------------------------------------------------------------------------------
def test_peft_lora_through_the_executor_equals_peft_forward():
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-m", 0, "float64")
    prompts = random_prompts([9, 4])
    base_logits, _ = run_steps([create_executor(model, 256, 4)], prompts, 3)
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                            "gate_proj", "up_proj", "down_proj"]))
    lora.eval()
    got, seqs = run_steps([create_executor(lora, 256, 4)], prompts, 3)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = lora(input_ids=torch.tensor([s[:-1]])).logits[0, len(prompts[i]) - 1:]
            torch.testing.assert_close(torch.stack([step[i] for step in got]), ref, rtol=0, atol=1e-10)
    # The adapter matters: the same executor code without it gives other logits.
    assert (got[0] - base_logits[0]).abs().max() > 1e-3


# -- batching pays ---------------------------------------------------------------------------
def test_throughput_at_64_concurrent_requests_beats_8_on_the_same_work():
    """The same 64 requests with max_num_seqs 64 and with 8, alternated twice in this one
    test so that machine noise hits both; best of two each."""
    prompts = random_prompts([random.Random(i).randrange(16, 64) for i in range(64)], seed=11)
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 64
    engines = {n: create_engine({"model_loading_config": {"model_id": "tiny-llama-m"},
                                 "engine_kwargs": {"max_num_seqs": n, "cpu_threads": 1}})
               for n in (8, 64)}
    for e in engines.values():
        e.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    best = {8: float("inf"), 64: float("inf")}
    outs = {}
    for _ in range(2):
        for n, e in engines.items():
            started = time.perf_counter()
            outs[n] = e.generate(prompts, params)
            best[n] = min(best[n], time.perf_counter() - started)
    tokens = 64 * 40
    ratio = (tokens / best[64]) / (tokens / best[8])
    print(f"tok/s at 8: {tokens / best[8]:.0f}, at 64: {tokens / best[64]:.0f}, ratio {ratio:.2f}")
    assert max(r.num_seqs for r in engines[64].stats.iterations) == 64
    assert max(r.num_seqs for r in engines[8].stats.iterations) == 8
    assert ratio > 1.3
    # float32, different batch compositions: the first tokens still agree
    assert [o.token_ids[:3] for o in outs[8]] == [o.token_ids[:3] for o in outs[64]]


# -- the native CPU attention kernel ---------------------------------------------------------
def mixed_steps(executor, prompts, block_size=4):
    """A prefill of ``prompts`` in two chunks per prompt (the second continues from cached
    positions), then two decode steps; returns the logits of each step."""
    alloc = BlockAllocator(256)
    for i, p in enumerate(prompts):
        alloc.allocate(i, -(-(len(p) + 2) // block_size))
    out = []
    half = [len(p) // 2 for p in prompts]
    out.append(executor.execute(executor.batch(
        [SeqChunk(p[:h], 0, alloc.tables[i]) for i, (p, h) in enumerate(zip(prompts, half))])))
    seqs = [list(p) for p in prompts]
    # the rest of the prompts, alongside nothing else; then decode steps of every row
    out.append(executor.execute(executor.batch(
        [SeqChunk(p[h:], h, alloc.tables[i]) for i, (p, h) in enumerate(zip(prompts, half))])))
    for _ in range(2):
        for s, t in zip(seqs, out[-1].argmax(-1).tolist()):
            s.append(t)
        out.append(executor.execute(executor.batch(
            [SeqChunk([s[-1]], len(s) - 1, alloc.tables[i]) for i, s in enumerate(seqs)])))
    return out


@pytest.mark.parametrize("block_size", [4, 16])   # 16 + float32: the kernel's vector body
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("model_id", ["tiny-llama-l", "tiny-mistral-s", "tiny-qwen2-s"])
def test_native_attention_equals_the_torch_path(model_id, dtype, block_size):
    """The C kernel (GQA groups, sliding windows, chunked prefill, decode) against the
    executor's torch attention (gathered K/V, masks, matmuls) on the same model."""
    model, _ = build_tiny_model(model_id, 0, dtype)
    prompts = random_prompts([3, 70, 41, 9, 64])   # beyond the tiny sliding window
    native = ModelExecutor(model, 256, block_size)
    assert native.native, "the native CPU attention kernel did not build (see the log)"
    torch_path = ModelExecutor(model, 256, block_size, native_attention=False)
    assert not torch_path.native
    tol = 1e-10 if dtype == "float64" else 1e-4
    for a, b in zip(mixed_steps(native, prompts, block_size), mixed_steps(torch_path, prompts, block_size)):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_fused_pointwise_kernels_equal_the_model_modules():
    """The native add + RMSNorm, in-place rotary and SiLU-times-up against transformers'
    own LlamaRMSNorm, apply_rotary_pos_emb and the MLP's activation (``ACT2FN["silu"]``),
    on random rows (float32); SiLU on the strided halves of one gate/up product too."""
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from raycolo.engine.executor.kv_cache import PagedKVCache
    from raycolo.engine.executor.native import add_rms_norm, rope_and_write, silu_mul

    gen = torch.Generator().manual_seed(3)
    for rows, dim in ((1, 64), (37, 384), (300, 768)):
        norm = LlamaRMSNorm(dim, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(dim, generator=gen) * 2)
        residual, x = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen) * 3
        expected_sum = residual + x
        with torch.inference_mode():
            out = add_rms_norm(residual, x, norm.weight, norm.variance_epsilon)
            torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
            torch.testing.assert_close(out, norm(expected_sum), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(add_rms_norm(residual, None, norm.weight, 1e-5), out)
    for tokens, heads, kv_heads, d in ((1, 4, 2, 32), (50, 12, 4, 64), (9, 2, 1, 128)):
        q, k = torch.randn(tokens, heads, d, generator=gen), torch.randn(tokens, kv_heads, d, generator=gen)
        angle = torch.rand(tokens, d // 2, generator=gen) * 100
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        eq, ek = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        cache, bs = PagedKVCache(1, tokens, 4, kv_heads, d, torch.float32), 4     # k goes into the cache
        slots = torch.randperm(tokens * bs, generator=gen)[:tokens]
        rope_and_write(q, k, torch.zeros_like(k), cos, sin, slots, cache.keys[0], cache.values[0])
        torch.testing.assert_close(q, eq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.keys[0][slots // bs, :, :, slots % bs], ek, rtol=1e-5, atol=1e-5)
    act = ACT2FN["silu"]
    for rows, cols in ((1, 1024), (7, 33), (300, 512)):
        gate_up = torch.randn(rows, 2 * cols, generator=gen) * 6        # saturates both tails
        gate, up = gate_up.split([cols, cols], dim=-1)
        expected, own = act(gate) * up, gate.clone()
        out = silu_mul(gate, up)          # strided halves (rows > 1): a new contiguous tensor
        assert out.is_contiguous() and (out.data_ptr() != gate.data_ptr()) == (rows > 1)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert silu_mul(own, up).data_ptr() == own.data_ptr()     # contiguous gate: in place
        torch.testing.assert_close(own, expected, rtol=1e-5, atol=1e-5)
    tails = torch.tensor([[-1e4, -200.0, -89.0, -20.0, 0.0, 20.0, 89.0, 200.0, 1e4]])   # no NaN
    torch.testing.assert_close(silu_mul(tails.clone(), torch.ones_like(tails)), act(tails), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        silu_mul(torch.randn(4, 8), torch.randn(4, 9))
    # the C kernel trusts its slots: they are checked
    q, kv = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    cache = PagedKVCache(1, 3, 4, 2, 32, torch.float32)
    cos, sin = torch.ones(2, 32), torch.zeros(2, 32)
    for bad in ([0, 12], [-1, 0]):
        with pytest.raises(ValueError, match="outside the cache"):
            rope_and_write(q, kv, kv, cos, sin, torch.tensor(bad), cache.keys[0], cache.values[0])


def test_fused_forward_equals_the_unfused_one():
    """The executor's fused float32 forward (native norms, rotary, in-place SiLU) against
    its own module-by-module forward on the same steps, and the first choice of each."""
    model, _ = build_tiny_model("tiny-llama-l", 0, "float32")
    prompts = random_prompts([5, 70, 33, 12])
    fused = ModelExecutor(model, 256, 16)
    assert fused.fused, "the fused pointwise kernels are off (see the log)"
    plain = ModelExecutor(model, 256, 16)
    plain.fused = False
    for a, b in zip(mixed_steps(fused, prompts, 16), mixed_steps(plain, prompts, 16)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


@pytest.mark.parametrize("head_dim,block_size,group,window", [
    (64, 16, 3, None), (128, 16, 2, 37), (32, 16, 1, None), (48, 16, 4, 20), (64, 8, 3, None)])
def test_native_kernel_equals_dense_attention(head_dim, block_size, group, window):
    """The kernel on its own, over blocks scattered at random through the cache, against
    dense softmax attention computed from each sequence's keys and values in order
    (float64 reference): both bodies (vector: float32, 16-slot blocks, head_dim 32/64/128;
    plain loops otherwise), GQA groups and sliding windows."""
    from raycolo.engine.executor.kv_cache import PagedKVCache
    from raycolo.engine.executor.native import paged_attention

    gen = torch.Generator().manual_seed(head_dim + block_size + group)
    kv_heads, lengths = 2, [1, 15, 16, 17, 83, 200]
    heads = kv_heads * group
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    cache = PagedKVCache(1, sum(blocks_per_seq) + 5, block_size, kv_heads, head_dim, torch.float32)
    order = torch.randperm(cache.num_blocks, generator=gen).tolist()
    seq_keys, seq_values, tables = [], [], []
    for n, nb in zip(lengths, blocks_per_seq):
        table, order = order[:nb], order[nb:]
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
        cache.write(0, slots, k, v)
        seq_keys.append(k), seq_values.append(v), tables.append(table)
    # one query at the last position of every sequence, and three mid-sequence ones
    queries = [(s, n - 1) for s, n in enumerate(lengths)] + [(4, 40), (5, 0), (5, 150)]
    q = torch.randn(len(queries), heads, head_dim, generator=gen)
    flat, starts = [], {}
    for s, table in enumerate(tables):
        starts[s] = len(flat)
        flat += table
    out = paged_attention(q, cache.keys[0], cache.values[0], torch.tensor(flat),
                          torch.tensor([starts[s] for s, _ in queries]),
                          torch.tensor([p for _, p in queries]), window, head_dim ** -0.5)
    for row, (s, p) in enumerate(queries):
        lo = 0 if window is None else max(0, p - window + 1)
        k = seq_keys[s][lo:p + 1].double().repeat_interleave(group, dim=1)   # (len, heads, d)
        v = seq_values[s][lo:p + 1].double().repeat_interleave(group, dim=1)
        w = torch.einsum("hd,thd->ht", q[row].double(), k).mul(head_dim ** -0.5).softmax(-1)
        expected = torch.einsum("ht,thd->hd", w, v)
        torch.testing.assert_close(out[row].double(), expected, rtol=0, atol=2e-5)


def test_native_kernel_build_failure_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    from raycolo.engine.executor import native

    saved = dict(native._state)
    try:
        native._state.clear()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        with caplog.at_level(logging.WARNING, logger="raycolo.engine.executor"):
            assert native.native_library() is None
            model, _ = build_tiny_model("tiny-llama-s", 0, "float64")
            ex = ModelExecutor(model, 64, 4)
        assert not ex.native
        assert [r.getMessage() for r in caplog.records if "native" in r.getMessage()] == [
            f"raycolo executor: native CPU attention unavailable (no C compiler "
            f"({tmp_path / 'no-such-compiler'}) on PATH); using the torch attention path "
            f"(correct, slower)"]
        # a fresh build into an empty cache directory lands under its content key
        native._state.clear()
        monkeypatch.delenv("CC")
        monkeypatch.setenv("RAYCOLO_KERNEL_CACHE", str(tmp_path / "cache"))
        assert native.native_library() is not None
        built = list((tmp_path / "cache").iterdir())
        assert [p.name for p in built] == [native.library_path(native._compiler()).name]
    finally:
        native._state.clear()
        native._state.update(saved)


FAULTS_ON_REUSE = """
import resource, torch
from raycolo.engine.executor.heap import keep_freed_memory
assert keep_freed_memory()
for _ in range(6):                        # allocate, touch, free until glibc has settled
    torch.ones(16 << 20)
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_step_memory_is_reused_without_new_page_faults():
    """After the heap policy, a 64 MiB temporary allocated again after being freed reuses
    the heap's pages; glibc's default would mmap it afresh and fault in 16,384 pages each
    time. Measured in a fresh process, once glibc has settled: here the first two to four
    allocations of a fresh process fault (policy or not), and in this process engines
    that earlier tests built and freed leave heap holes that move when it settles (the
    test was flaky in the full suite once KV caches became mmaps of their own)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FAULTS_ON_REUSE], capture_output=True, text=True,
                         check=True, timeout=120)
    assert all(int(faults) < 1000 for faults in out.stdout.split())


def test_loading_the_native_kernel_keeps_subnormal_floats():
    """The kernel library must not switch the process to flush-to-zero (a -ffast-math
    link does, through crtfastmath.o): subnormals must survive in every process that loads it."""
    import sys

    from raycolo.engine.executor.native import native_library

    assert native_library() is not None
    assert sys.float_info.min / 2 > 0
    assert torch.tensor(sys.float_info.min, dtype=torch.float64).div(2).item() > 0


def test_importing_the_executor_gives_onednn_room_unless_the_environment_says_otherwise():
    """packed.py sets oneDNN's primitive cache capacity before any primitive exists (oneDNN
    reads it once; at its default 1024 an engine's row counts x packed shapes thrashed it,
    docs/executor.md), and leaves a value the user set alone. Fresh interpreters: the
    variable only counts before the process's first primitive."""
    import os
    import subprocess
    import sys

    from raycolo.engine.executor.packed import ONEDNN_CACHE_VARIABLE, ONEDNN_PRIMITIVE_CACHE

    probe = f"import os, raycolo.engine.executor; print(os.environ.get({ONEDNN_CACHE_VARIABLE!r}))"
    env = {k: v for k, v in os.environ.items() if k != ONEDNN_CACHE_VARIABLE}
    for preset, expected in ((None, str(ONEDNN_PRIMITIVE_CACHE)), ("777", "777")):
        run_env = env if preset is None else {**env, ONEDNN_CACHE_VARIABLE: preset}
        out = subprocess.run([sys.executable, "-c", probe], env=run_env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == expected
