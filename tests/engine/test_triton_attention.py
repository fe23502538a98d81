"""The Triton paged-attention kernel (raycolo.engine.executor.triton_attention) on the CPU,
under Triton's interpreter: against dense softmax attention computed from each sequence's
keys and values in order (float64), and inside the executor against its torch attention
path and transformers' generate(). The same kernel runs compiled on a GPU (``make gpu-check``
adds its rows there)."""
from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from raycolo.engine.executor import ModelExecutor                                  # noqa: E402
from raycolo.engine.executor.attention import AttentionKernel                         # noqa: E402
from raycolo.engine.executor.batch import TILE_TOKENS, query_tiles                    # noqa: E402
from raycolo.engine.executor.kv_cache import PagedKVCache                             # noqa: E402
from raycolo.engine.models import build_tiny_model                                    # noqa: E402
from tests.engine.test_executor import hf_greedy, mixed_steps, random_prompts                 # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def kernel():
    """The kernel module, interpreted where there is no GPU (conftest.py sets
    TRITON_INTERPRET before triton is imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module("raycolo.engine.executor.triton_attention")
    if not torch.cuda.is_available():
        assert isinstance(module._attend_kernel, InterpretedFunction), \
            "triton was imported before TRITON_INTERPRET was set"
    return module


def scattered_cache(gen, lengths, block_size, kv_heads, head_dim):
    """A one-layer cache holding each sequence's random keys/values in blocks scattered at
    random, with the flat tables and each sequence's table start."""
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    cache = PagedKVCache(1, sum(blocks_per_seq) + 5, block_size, kv_heads, head_dim, torch.float32)
    order = torch.randperm(cache.num_blocks, generator=gen).tolist()
    keys, values, flat, starts = [], [], [], []
    for n, nb in zip(lengths, blocks_per_seq):
        table, order = order[:nb], order[nb:]
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        cache.write(0, torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)]), k, v)
        keys.append(k), values.append(v)
        starts.append(len(flat))
        flat += table
    return cache, keys, values, torch.tensor(flat), starts


def dense(q, k, v, group, scale):
    """softmax(q k^T) v of one query (heads, d) over keys (len, kv_heads, d), float64."""
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    w = torch.einsum("hd,thd->ht", q.double(), k).mul(scale).softmax(-1)
    return torch.einsum("ht,thd->hd", w, v)


@pytest.mark.parametrize("head_dim,block_size,group,window", [
    (64, 16, 4, None), (128, 16, 2, 37), (32, 16, 1, None), (48, 12, 3, 20), (16, 4, 8, None)])
def test_decode_equals_dense_attention(kernel, head_dim, block_size, group, window):
    """Decode (one query per sequence, at its last position, plus mid-sequence queries):
    GQA groups of 1 to 8, head dims and block sizes that are not powers of two, sliding
    windows, and split-K over long tables merged by the second kernel."""
    gen = torch.Generator().manual_seed(head_dim + block_size + group)
    kv_heads, lengths = 2, [1, 15, 16, 17, 83, 200]
    cache, keys, values, flat, starts = scattered_cache(gen, lengths, block_size, kv_heads, head_dim)
    queries = [(s, n - 1) for s, n in enumerate(lengths)] + [(4, 40), (5, 0), (5, 150)]
    q = torch.randn(len(queries), group * kv_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = kernel.paged_attention(q, cache.keys[0], cache.values[0], flat,
                                 torch.tensor([starts[s] for s, _ in queries]),
                                 torch.tensor([p for _, p in queries]), window, scale)
    for row, (s, p) in enumerate(queries):
        lo = 0 if window is None else max(0, p - window + 1)
        expected = dense(q[row], keys[s][lo:p + 1], values[s][lo:p + 1], group, scale)
        torch.testing.assert_close(out[row].double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("window", [None, 70])
def test_split_k_decode_equals_dense_attention(kernel, window):
    """Two decode queries over one KV head: each pair's keys split over 8 programs (some
    with no key at all: the short sequence, the window) and merged by the second kernel."""
    gen = torch.Generator().manual_seed(21)
    lengths, group, head_dim, block_size = [1100, 9], 4, 32, 16
    cache, keys, values, flat, starts = scattered_cache(gen, lengths, block_size, 1, head_dim)
    assert kernel.decode_splits(2, 1, flat.numel() // 2, block_size, head_dim, torch.device("cpu")) == 8
    q = torch.randn(2, group, head_dim, generator=gen)
    out = kernel.paged_attention(q, cache.keys[0], cache.values[0], flat, torch.tensor(starts),
                                 torch.tensor([1099, 8]), window, 0.25)
    for row, (s, p) in enumerate([(0, 1099), (1, 8)]):
        lo = 0 if window is None else max(0, p - window + 1)
        expected = dense(q[row], keys[s][lo:p + 1], values[s][lo:p + 1], group, 0.25)
        torch.testing.assert_close(out[row].double(), expected, rtol=0, atol=2e-5)


def test_decode_splits_the_blocks_where_the_batch_is_small(kernel):
    """Few (token, KV head) pairs over long tables take several split-K programs; a wide
    batch or a short table takes one."""
    cpu = torch.device("cpu")
    # (tokens, kv heads, table width in blocks, block size, head dim): the interpreter counts 8 SMs
    assert kernel.decode_splits(1, 2, 64, 16, 64, cpu) == 8            # 16 programs wanted
    assert kernel.decode_splits(64, 8, 64, 16, 64, cpu) == 1
    assert kernel.decode_splits(1, 2, 4, 16, 64, cpu) == 1             # one key tile in all
    assert kernel.decode_splits(1, 1, 10_000, 16, 64, cpu) == kernel.MAX_SPLITS


@pytest.mark.parametrize("window", [None, 9])
def test_prefill_tiles_equal_dense_attention(kernel, window):
    """Chunks of several tokens (query tiles of up to TILE_TOKENS tokens of one sequence,
    each token with its own causal limit), continuing from cached positions."""
    gen = torch.Generator().manual_seed(7)
    kv_heads, group, head_dim, block_size = 2, 3, 32, 8
    lengths = [40, 5, 23]
    cache, keys, values, flat, starts = scattered_cache(gen, lengths, block_size, kv_heads, head_dim)
    chunks = [(0, 3, 40), (1, 0, 5), (2, 20, 23)]          # (sequence, first position, end)
    assert max(e - b for _, b, e in chunks) > TILE_TOKENS
    seq_of = [(s, p) for s, b, e in chunks for p in range(b, e)]
    q = torch.randn(len(seq_of), group * kv_heads, head_dim, generator=gen)
    tiles = query_tiles([e - b for _, b, e in chunks])
    out = kernel.paged_attention(q, cache.keys[0], cache.values[0], flat,
                                 torch.tensor([starts[s] for s, _ in seq_of]),
                                 torch.tensor([p for _, p in seq_of]), window, 0.2, tiles)
    for row, (s, p) in enumerate(seq_of):
        lo = 0 if window is None else max(0, p - window + 1)
        expected = dense(q[row], keys[s][lo:p + 1], values[s][lo:p + 1], group, 0.2)
        torch.testing.assert_close(out[row].double(), expected, rtol=0, atol=2e-5)


def test_the_triton_kernel_refuses_a_dtype_it_cannot_compile_for():
    """float64 runs under the interpreter but its dot products do not compile for a GPU: an
    explicit request for it fails at once, naming the dtype; without one the CPU's
    float64 gets the native kernel."""
    from raycolo.engine.executor.attention import choose_kernel

    with pytest.raises(ValueError, match="not float64"):
        choose_kernel(AttentionKernel.TRITON, torch.float64, torch.device("cpu"))
    assert choose_kernel(AttentionKernel.TRITON, torch.float32, torch.device("cpu")) is AttentionKernel.TRITON
    assert choose_kernel(None, torch.float64, torch.device("cpu")) is AttentionKernel.NATIVE


@pytest.mark.parametrize("model_id,block_size", [("tiny-llama-s", 16), ("tiny-mistral-s", 4)])
def test_executor_with_the_triton_kernel_equals_the_torch_path(kernel, model_id, block_size):
    """The whole executor on the Triton kernel (chunked prefill, then decode steps; the
    Mistral contexts run past its sliding window) against its torch attention path."""
    model, _ = build_tiny_model(model_id, 0, "float32")
    prompts = random_prompts([3, 55, 9, 20])       # past the Mistral's window of 48, with decode
    tri = ModelExecutor(model, 256, block_size, attention=AttentionKernel.TRITON)
    assert tri.kernel is AttentionKernel.TRITON and tri.native and tri.fused    # Triton pointwise too
    torch_path = ModelExecutor(model, 256, block_size, native_attention=False)
    for a, b in zip(mixed_steps(tri, prompts, block_size), mixed_steps(torch_path, prompts, block_size)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_engine_greedy_on_the_triton_kernel_equals_transformers(kernel):
    """Greedy tokens from padded decode steps on the Triton kernel (the shapes CUDA graphs
    replay) equal transformers' generate() on the same float32 model."""
    from raycolo.batching.blocks import BlockAllocator
    from raycolo.engine.executor import SeqChunk
    from raycolo.engine.executor.graphs import enable_padded_decode

    model, _ = build_tiny_model("tiny-llama-s", 0, "float32")
    prompts, steps, bs = random_prompts([5, 20, 11]), 5, 16
    ex = ModelExecutor(model, 64, bs, attention=AttentionKernel.TRITON)
    enable_padded_decode(ex, capture=False)
    alloc = BlockAllocator(64)
    for i, p in enumerate(prompts):
        alloc.allocate(i, -(-(len(p) + steps) // bs))
    seqs = [list(p) for p in prompts]
    logits = ex.execute(ex.batch([SeqChunk(p, 0, alloc.tables[i]) for i, p in enumerate(prompts)]))
    for step in range(steps):
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
        if step + 1 < steps:
            batch = ex.batch([SeqChunk([s[-1]], len(s) - 1, alloc.tables[i]) for i, s in enumerate(seqs)])
            assert type(batch).__name__ == "DecodeBatch"
            logits = ex.execute(batch)
    for p, s in zip(prompts, seqs):
        assert s[len(p):] == hf_greedy(model, p, steps)


@pytest.fixture(scope="module", params=["triton", "native"])
def pointwise(request, kernel):
    """The Triton pointwise kernels, and the native C ones (the CPU's float32 fused
    forward): the same three functions, held to the same checks."""
    if request.param == "native":
        from raycolo.engine.executor import native
        if not native.fused_pointwise_supported(torch.float32, torch.device("cpu")):
            pytest.skip("no C compiler: the native kernels are off")
        return native
    return importlib.import_module("raycolo.engine.executor.triton_pointwise")


def test_pointwise_kernels_equal_transformers_modules(pointwise):
    """add + RMSNorm, rotary with the cache write, and SiLU * up against transformers'
    LlamaRMSNorm, apply_rotary_pos_emb, and torch, on random rows (float32; the GPU's
    gpu-check row does bfloat16); the cache holds k and v at exactly their slots."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    for rows, dim in ((1, 64), (37, 96), (5, 200)):
        norm = LlamaRMSNorm(dim, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(dim, generator=gen) * 2)
        residual, x = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen) * 3
        total = residual + x
        with torch.inference_mode():
            out = pointwise.add_rms_norm(residual, x, norm.weight, norm.variance_epsilon)
            torch.testing.assert_close(residual, total, rtol=0, atol=0)
            torch.testing.assert_close(out, norm(total), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pointwise.add_rms_norm(residual, None, norm.weight, 1e-5), out)
    block_size, blocks = 4, 6
    for tokens, heads, kv_heads, d in ((1, 4, 2, 32), (9, 6, 2, 24), (5, 2, 1, 64)):
        q, k = torch.randn(tokens, heads, d, generator=gen), torch.randn(tokens, kv_heads, d, generator=gen)
        v = torch.randn(tokens, kv_heads, d, generator=gen)
        angle = torch.rand(tokens, d // 2, generator=gen) * 100
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        eq, ek = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        cache = PagedKVCache(1, blocks, block_size, kv_heads, d, torch.float32)
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        pointwise.rope_and_write(q, k, v, cos, sin, slots, cache.keys[0], cache.values[0])
        torch.testing.assert_close(q, eq, rtol=1e-5, atol=1e-5)
        expected = PagedKVCache(1, blocks, block_size, kv_heads, d, torch.float32)
        expected.write(0, slots, ek, v)
        torch.testing.assert_close(cache.keys[0], expected.keys[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.values[0], expected.values[0], rtol=0, atol=0)
    gate, up = torch.randn(7, 300, generator=gen) * 4, torch.randn(7, 300, generator=gen)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(pointwise.silu_mul(gate.clone(), up), expected, rtol=1e-5, atol=1e-6)


def test_kernels_read_column_slices_of_a_fused_product(kernel, pointwise):
    """q/k/v as column slices of one (tokens, q+k+v) product and gate/up as the halves of
    one (rows, 2 x inter) product, as the executor's fused projections give them: the
    attention, rotary-with-cache-write and SiLU kernels equal themselves on contiguous copies."""
    gen = torch.Generator().manual_seed(11)
    tokens, heads, kv_heads, d, bs = 5, 6, 2, 32, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    assert not q.is_contiguous()
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    angle = torch.rand(tokens, d // 2, generator=gen) * 100
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    slots = torch.randperm(6 * bs, generator=gen)[:tokens]
    strided, dense_ = (PagedKVCache(1, 6, bs, kv_heads, d, torch.float32) for _ in range(2))
    pointwise.rope_and_write(q, k, v, cos, sin, slots, strided.keys[0], strided.values[0])
    pointwise.rope_and_write(qc, kc, vc, cos, sin, slots, dense_.keys[0], dense_.values[0])
    torch.testing.assert_close(q, qc, rtol=0, atol=0)
    torch.testing.assert_close(strided.keys[0], dense_.keys[0], rtol=0, atol=0)
    torch.testing.assert_close(strided.values[0], dense_.values[0], rtol=0, atol=0)
    cache, _, _, flat, starts = scattered_cache(gen, [9, 1, 30, 4, 17], 16, kv_heads, d)
    args = (cache.keys[0], cache.values[0], flat, torch.tensor(starts), torch.tensor([8, 0, 29, 3, 16]),
            None, d ** -0.5)
    torch.testing.assert_close(kernel.paged_attention(q, *args), kernel.paged_attention(qc, *args),
                               rtol=0, atol=0)
    gate_up = torch.randn(3, 2 * 1100, generator=gen) * 4
    gate, up = gate_up.split(1100, dim=-1)
    out = pointwise.silu_mul(gate, up)
    assert out.is_contiguous() and out.shape == (3, 1100)
    torch.testing.assert_close(out, pointwise.silu_mul(gate.contiguous(), up.contiguous()), rtol=0, atol=0)
