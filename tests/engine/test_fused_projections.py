"""Fused projections (raycolo.engine.executor.fused): q/k/v as one matmul and gate/up as
one, in inference. Against the same executor with every projection its own module, and
against peft's and transformers' forwards; the kernels that read column slices of a fused
product, against the same kernels on contiguous copies."""
from __future__ import annotations

import pytest
import torch

from raycolo.engine.executor import ModelExecutor, PagedKVCache
from raycolo.engine.executor import native
from raycolo.engine.executor.fused import FusedProjection
from raycolo.engine.models import build_tiny_model
from tests.engine.test_executor import mixed_steps, random_prompts, run_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [5, 70, 33, 12]           # beyond the tiny sliding window, chunked prefill, decode


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", ["float64", "float32"])     # float32: fused pointwise, packed
@pytest.mark.parametrize("model_id", ["tiny-llama-l", "tiny-qwen2-s", "tiny-mistral-s"])
def test_fused_projections_equal_separate_ones(model_id, dtype):
    """GQA (Llama-3 style), q/k/v biases (Qwen2) and sliding windows (Mistral): the fused
    executor's logits equal the unfused one's; the parts' weights became rows of one tensor
    without changing a value, so the model holds no second copy."""
    model, _ = build_tiny_model(model_id, 0, dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = random_prompts(PROMPTS)
    fused = ModelExecutor(model, 256, 16)
    # gate/up fuse where the fused forward runs the MLP itself (float32 on the CPU here)
    assert fused.fused == (dtype == "float32")
    assert all(f.qkv is not None and (f.gate_up is not None) == fused.fused for f in fused.fusion)
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight) == _storage(attn.v_proj.weight)
    assert (_storage(mlp.gate_proj.weight) == _storage(mlp.up_proj.weight)) == fused.fused
    if attn.q_proj.bias is not None:
        assert _storage(attn.q_proj.bias) == _storage(attn.v_proj.bias)
    after = {k.replace(".inner.", "."): v for k, v in model.state_dict().items()}  # packed.py's wrapper
    assert after.keys() == before.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    plain = ModelExecutor(model, 256, 16, fuse_projections=False)
    assert plain.fusion == [None] * len(plain.layers)
    tol = 1e-10 if dtype == "float64" else 1e-4
    for a, b in zip(mixed_steps(fused, prompts, 16), mixed_steps(plain, prompts, 16)):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def test_an_adapter_injected_after_the_executor_was_built_applies():
    """peft wraps q_proj, v_proj and up_proj of a model whose executor already fused them:
    those layers' products go back to the modules (the LoRA applies), and the executor's
    logits equal peft's own forward."""
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-m", 0, "float32")
    prompts = random_prompts([9, 4])
    ex = ModelExecutor(model, 256, 4)
    assert ex.fused
    base_logits, _ = run_steps([ex], prompts, 2)
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "up_proj"]))
    lora.eval()
    assert not any(f.qkv.current() or f.gate_up.current() for f in ex.fusion)
    got, seqs = run_steps([ex], prompts, 2)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = lora(input_ids=torch.tensor([s[:-1]])).logits[0, len(prompts[i]) - 1:]
            torch.testing.assert_close(torch.stack([step[i] for step in got]), ref, rtol=0, atol=1e-4)
    assert (got[0] - base_logits[0]).abs().max() > 1e-2       # the adapter changed the output
    # An executor built on the peft model fuses the LoRA layers' bases, and adds their
    # adapters itself: the same logits.
    rebuilt = ModelExecutor(lora, 256, 4)
    assert all(f.qkv.current() and f.qkv.wrapped == [True, False, True] for f in rebuilt.fusion)
    again, _ = run_steps([rebuilt], prompts, 2)
    for a, b in zip(again, got):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_moved_weights_are_laid_out_again():
    """``model.to(device)`` gives every parameter its own storage (as an engine's sleep and
    wake move the weights): wake_up lays the parts out as one weight again, and a step that
    finds them moved without a wake-up does so itself; the logits do not change."""
    model, _ = build_tiny_model("tiny-qwen2-s", 0, "float32")
    prompts = random_prompts(PROMPTS)
    ex = ModelExecutor(model, 256, 16)
    assert ex.fused and ex.fusion[0].gate_up is not None
    reference = mixed_steps(ex, prompts, 16)

    def move():                         # what Module._apply does to each parameter
        for p in model.parameters():
            p.data = p.data.clone()

    attn = ex.layers[0].self_attn
    ex.sleep()
    assert all(p.linear is None for f in ex.fusion for p in f.projections())
    move()
    assert _storage(attn.q_proj.weight) != _storage(attn.k_proj.weight)
    ex.wake_up()
    assert _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight) == _storage(attn.v_proj.weight)
    assert _storage(attn.q_proj.bias) == _storage(attn.v_proj.bias)
    assert all(p.current() for f in ex.fusion for p in f.projections())
    for a, b in zip(mixed_steps(ex, prompts, 16), reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    move()
    assert not ex.fusion[0].qkv.current()
    for a, b in zip(mixed_steps(ex, prompts, 16), reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(p.current() for f in ex.fusion for p in f.projections())


def test_only_plain_linears_of_one_input_fuse():
    layer = torch.nn.Module()
    layer.a, layer.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)
    assert FusedProjection.fusable(layer, ("a", "b"))
    fused = FusedProjection(layer, ("a", "b"))
    x = torch.randn(3, 8, dtype=torch.float32)
    with torch.inference_mode():
        ya, yb = fused(x)
        torch.testing.assert_close(ya, layer.a(x), rtol=0, atol=1e-6)
        torch.testing.assert_close(yb, layer.b(x), rtol=0, atol=1e-6)
    layer.e = torch.nn.Linear(8, 6, bias=False)
    assert not FusedProjection.fusable(layer, ("a", "e"))                 # a bias on one part only
    layer.c = torch.nn.Linear(9, 4)
    assert not FusedProjection.fusable(layer, ("a", "c"))                 # another input size
    layer.d = torch.nn.Linear(8, 4).double()
    assert not FusedProjection.fusable(layer, ("a", "d"))                 # another dtype


@pytest.mark.skipif(not native.fused_pointwise_supported(torch.float32, torch.device("cpu")),
                    reason="no C compiler: the native kernels are off")
def test_native_kernels_read_column_slices_of_a_fused_product():
    """rotary with the cache write and paged attention on q/k/v that are column slices of
    one (tokens, q+k+v) tensor equal the same kernels on contiguous copies."""
    from tests.engine.test_triton_attention import scattered_cache

    gen = torch.Generator().manual_seed(7)
    tokens, heads, kv_heads, d, bs = 6, 8, 2, 32, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)
    assert not q.is_contiguous() and native.heads_contiguous(q)
    qc, kc = q.contiguous(), k.contiguous()
    angle = torch.rand(tokens, d // 2, generator=gen) * 100
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    slots = torch.randperm(4 * bs, generator=gen)[:tokens]
    strided, dense = (PagedKVCache(1, 4, bs, kv_heads, d, torch.float32) for _ in range(2))
    native.rope_and_write(q, k, v, cos, sin, slots, strided.keys[0], strided.values[0])
    native.rope_and_write(qc, kc, v.contiguous(), cos, sin, slots, dense.keys[0], dense.values[0])
    torch.testing.assert_close(q, qc, rtol=0, atol=0)
    torch.testing.assert_close(strided.keys[0], dense.keys[0], rtol=0, atol=0)
    lengths = [40, 3, 17, 25, 1, 33]
    cache, _, _, flat, starts = scattered_cache(gen, lengths, bs, kv_heads, d)
    positions = torch.tensor([n - 1 for n in lengths])
    args = (cache.keys[0], cache.values[0], flat, torch.tensor(starts), positions, None, d ** -0.5)
    torch.testing.assert_close(native.paged_attention(q, *args), native.paged_attention(qc, *args),
                               rtol=0, atol=0)


def _peft_logits(lora, prompts, seqs):
    with torch.no_grad():
        return [lora(input_ids=torch.tensor([s[:-1]])).logits[0, len(p) - 1:] for p, s in zip(prompts, seqs)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])     # float32: the fused forward, gate/up
def test_lora_layers_equal_peft_in_every_adapter_state(dtype):
    """LoRA on every projection: the executor computes base + scaling * B(A(x)) itself with
    one adapter active, with two, and with adapters disabled (peft's forward is not called:
    a hook on the LoRA layers counts), and hands merged adapters and DoRA to peft's
    forward; every state's logits equal peft's own."""
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-m", 0, dtype)
    prompts = random_prompts([9, 4, 17])
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets))
    lora.add_adapter("b", LoraConfig(r=2, lora_alpha=6, init_lora_weights=False, target_modules=targets))
    lora.eval()
    # unpacked: peft's merge rewrites base weights in place, which a oneDNN-packed copy
    # (packed.py) would not follow; raycolo never merges
    ex = ModelExecutor(lora, 256, 4, pack_weights=False)
    assert all(f.qkv is not None and (f.gate_up is not None) == ex.fused for f in ex.fusion)
    calls = []
    for layer in ex.layers:      # (the MLP is the model's module where the forward is not fused)
        for m in (layer.self_attn.q_proj, layer.self_attn.o_proj) + ((layer.mlp.down_proj,) if ex.fused else ()):
            m.register_forward_hook(lambda *a: calls.append(1))
    tol = 1e-10 if dtype == "float64" else 2e-4
    seen = []

    def check(fast: bool):
        calls.clear()
        got, seqs = run_steps([ex], prompts, 2)
        assert (not calls) == fast
        for i, ref in enumerate(_peft_logits(lora, prompts, seqs)):
            torch.testing.assert_close(torch.stack([step[i] for step in got]), ref, rtol=0, atol=tol)
        seen.append(got[0])

    check(fast=True)                                   # "default"
    lora.base_model.set_adapter(["default", "b"])      # two adapters, summed
    check(fast=True)
    lora.base_model.set_adapter("b")
    check(fast=True)
    with lora.disable_adapter():
        check(fast=True)
    lora.base_model.set_adapter("default")
    lora.merge_adapter()
    check(fast=False)                                  # merged: peft's forward (base only)
    lora.unmerge_adapter()
    check(fast=True)
    # the states really differ: one adapter, two, the other, none
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
        assert (seen[a] - seen[b]).abs().max() > 1e-3
    torch.testing.assert_close(seen[4], seen[0], rtol=0, atol=tol)      # merged = unmerged


def test_dora_goes_through_peft():
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-m", 0, "float64")
    prompts = random_prompts([9, 4])
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, use_dora=True,
                                            target_modules=["q_proj", "v_proj", "o_proj"])).eval()
    ex = ModelExecutor(lora, 256, 4)
    got, seqs = run_steps([ex], prompts, 2)
    for i, ref in enumerate(_peft_logits(lora, prompts, seqs)):
        torch.testing.assert_close(torch.stack([step[i] for step in got]), ref, rtol=0, atol=1e-10)


def test_biased_llama_projections_fuse_and_equal_transformers():
    """A Llama checkpoint with biases on attention and MLP projections (``attention_bias``,
    ``mlp_bias``): q/k/v and gate/up fuse with their biases, and the executor's last-token
    logits equal transformers' forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    ex = ModelExecutor(model, 64, 4)
    assert ex.fused and all(f.qkv is not None and f.gate_up is not None for f in ex.fusion)
    prompts = random_prompts([6, 11])
    got, seqs = run_steps([ex], prompts, 2)
    with torch.no_grad():
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            ref = model(input_ids=torch.tensor([s[:-1]])).logits[0, len(p) - 1:]
            torch.testing.assert_close(torch.stack([step[i] for step in got]), ref, rtol=0, atol=1e-4)


class _Products(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products torch runs (aten mm/addmm, in place or not)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_lora_on_q_k_v_shrinks_and_expands_in_one_product_each():
    """Every adapter's q/k/v ``lora_A`` weights become consecutive rows of one tensor and
    their ``lora_B`` weights the diagonal blocks of one zero matrix (lora_layout.py), so
    the LoRA of the three costs one shrink and one expand: 1 base product + 2 = 3 matrix
    products; 5 with the B's apart (an expand per part), 7 with the A's apart too (as peft
    leaves them); the outputs equal peft's layers' every time."""
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-m", 0, "float64")
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj"])).eval()
    attn = ModelExecutor(lora, 64, 4, pack_weights=False).layers[0].self_attn
    fused = FusedProjection(attn, ("q_proj", "k_proj", "v_proj"), pack=False)
    parts = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")]
    a = [p.lora_A["default"].weight for p in parts]
    b = [p.lora_B["default"].weight for p in parts]
    assert _storage(a[0]) == _storage(a[1]) == _storage(a[2])
    assert _storage(b[0]) == _storage(b[1]) == _storage(b[2]) and b[1].stride() == (12, 1)
    whole = b[0].as_strided((sum(x.shape[0] for x in b), 12), (12, 1), b[0].storage_offset())
    assert whole[:b[0].shape[0], 4:].abs().max() == 0 and whole[b[0].shape[0]:, :4].abs().max() == 0
    x = torch.randn(5, attn.q_proj.in_features, dtype=torch.float64)
    with torch.no_grad():
        want = [p(x) for p in parts]                                       # peft's forward
        for expected_products, take_apart in ((3, b[1]), (5, a[1]), (7, None)):
            with _Products() as products:
                got = fused(x)
            assert products.count == expected_products
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
            if take_apart is not None:             # k's B (then its A) on its own storage
                take_apart.data = take_apart.data.clone()


def test_trained_adapters_laid_out_in_rows_train_as_peft(tmp_path):
    """After the executor lays q/k/v's A weights out as rows of one tensor and their B's
    as blocks of one, AdamW steps on the model give the same weights and losses as on a
    copy whose adapters peft left apart; peft saves and loads the result."""
    import copy

    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-s", 0, "float64")
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    reference = copy.deepcopy(lora)
    ModelExecutor(lora, 64, 4, pack_weights=False)          # lays the A's out
    q = lora.base_model.model.model.layers[0].self_attn
    assert _storage(q.q_proj.lora_A["default"].weight) == _storage(q.v_proj.lora_A["default"].weight)
    assert _storage(q.q_proj.lora_B["default"].weight) == _storage(q.v_proj.lora_B["default"].weight)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (lora, reference):
        m.train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        run = []
        for _ in range(3):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    want = dict(reference.named_parameters())
    for name, p in lora.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=0, atol=1e-12)
    assert _storage(q.q_proj.lora_A["default"].weight) == _storage(q.v_proj.lora_A["default"].weight)
    # the blocks off the diagonal are no parameter's: still zero after training
    bq, bk = q.q_proj.lora_B["default"].weight, q.k_proj.lora_B["default"].weight
    whole = bq.as_strided((bq.shape[0] + 2 * bk.shape[0], 12), (12, 1), bq.storage_offset())
    assert whole[:bq.shape[0], 4:].abs().max() == 0 and whole[bq.shape[0]:, :4].abs().max() == 0
    assert bq.abs().max() > 0
    # peft saves and loads the laid-out adapter (its views copied out)
    lora.save_pretrained(tmp_path / "adapter")
    from peft import PeftModel
    again = PeftModel.from_pretrained(build_tiny_model("tiny-llama-s", 0, "float64")[0], tmp_path / "adapter")
    saved = dict(again.named_parameters())
    for name, p in lora.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(saved[name], p, rtol=0, atol=0)


def test_bf16_model_with_float32_adapters_skips_peft_forward():
    """peft keeps a bf16 model's adapters in float32: the executor still adds them itself
    (the input cast to float32 once for q/k/v, the LoRA sum added back in bf16), peft's
    forward is not called, and the logits match peft's own to bf16 rounding."""
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("tiny-llama-m", 0, "bfloat16")
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).eval()
    layer = lora.base_model.model.model.layers[0]
    assert layer.self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    assert layer.self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    ex = ModelExecutor(lora, 256, 4, pack_weights=False)
    calls = []
    for layer in ex.layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.o_proj):
            m.register_forward_hook(lambda *a: calls.append(1))
    prompts = random_prompts([9, 4])
    got, seqs = run_steps([ex], prompts, 2)
    assert not calls
    for i, ref in enumerate(_peft_logits(lora, prompts, seqs)):
        mine = torch.stack([step[i] for step in got]).float()
        ref = ref.float()
        # within 2-3 bf16 steps of the largest logit (one step at 1.0 is 2**-7; seen: one)
        assert (mine - ref).abs().max() <= 0.02 * ref.abs().max()
