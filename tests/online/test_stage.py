"""StageModel: layer slices with LoRA that serve and train, against the unsplit model.

The references are independent of the stage code: transformers' own forward and
generate() on the whole model, and peft's own forward/backward with the same optimizer.
float64 keeps every comparison far below argmax margins and float noise.
"""
from __future__ import annotations

import json

import pytest
import torch

from raycolo.engine.models import build_tiny_model, load_model
from raycolo.online.stages.stage_model import (LoraSettings, StageModel, add_lora, causal_lm_loss, training_batch,
                                    training_rows)

from tests.engine.test_executor import random_prompts  # noqa: E402

LORA = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


prompts = random_prompts


def base(model_id="tiny-llama-m"):
    """A tiny catalog model, or a checkpoint directory's, in float64."""
    model, _ = load_model(str(model_id), 0, "float64")
    return model


def stages(model_id, cuts, lora=LORA, blocks=64):
    """One StageModel per slice, each built from its own copy of the model, as each stage
    worker builds its own."""
    out = []
    bounds = list(zip(cuts[:-1], cuts[1:]))
    for first, last in bounds:
        model = add_lora(base(model_id), lora) if lora else base(model_id)
        out.append(StageModel(model, (first, last), blocks, 4, lr=lora.lr if lora else 1e-3))
    return out


def nonzero_lora(chain):
    """Random LoRA B matrices, so the adapter changes the outputs (peft starts B at zero)."""
    with torch.no_grad():
        for st in chain:
            for name, p in st.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.1)


def copy_of(chain):
    """Fresh stages of tiny-llama-m cut like ``chain``, holding its current LoRA weights."""
    cuts = [chain[0].first] + [st.last for st in chain]
    out = stages("tiny-llama-m", cuts)
    for src, dst in zip(chain, out):
        dst.load_lora_state(src.lora_state())
    return out


def chain_forward(chain, rids, toks):
    hidden = None
    for st in chain:
        hidden = st.forward(rids, toks, hidden)
    return hidden


def chain_greedy(chain, prompt_list, steps):
    rids = list(range(len(prompt_list)))
    logits = chain_forward(chain, rids, prompt_list)
    outs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(steps - 1):
        logits = chain_forward(chain, rids, [[o[-1]] for o in outs])
        for o, t in zip(outs, logits.argmax(-1)):
            o.append(int(t))
    return outs, logits


def model_of(name: str, request) -> str:
    """A catalog id, or "qwen3": the session's Qwen3 checkpoint directory."""
    return str(request.getfixturevalue("qwen3_checkpoint")) if name == "qwen3" else name


@pytest.mark.parametrize("model_id,cuts", [("tiny-llama-m", [0, 2, 4]), ("tiny-llama-m", [0, 1, 3, 4]),
                                           ("tiny-mistral-s", [0, 1, 2]), ("qwen3", [0, 1, 2])])
def test_chained_stages_give_the_unsplit_models_logits_and_greedy_tokens(model_id, cuts, request):
    model_id = model_of(model_id, request)
    chain = stages(model_id, cuts)
    whole = add_lora(base(model_id), LORA).eval()
    ps = prompts([9, 23, 14])
    with torch.no_grad():  # a fresh LoRA's B is zero: its output is the base model's
        ref_logits = [whole(torch.tensor([p])).logits[0, -1] for p in ps]
    logits = chain_forward(chain, [0, 1, 2], ps)
    torch.testing.assert_close(logits, torch.stack(ref_logits), rtol=1e-9, atol=1e-9)
    for st in chain:
        for rid in range(3):
            st.release(rid)
    outs, _ = chain_greedy(chain, ps, 12)
    from transformers import GenerationConfig
    whole.generation_config.eos_token_id = None
    cfg = GenerationConfig(do_sample=False, max_new_tokens=12, min_new_tokens=12, eos_token_id=None, pad_token_id=0)
    for p, o in zip(ps, outs):
        with torch.no_grad():
            ref = whole.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=cfg)[0, len(p):].tolist()
        assert o == ref


def pipelined_step(chain, batch, task=7, **kw):
    ids, labels, lengths = batch
    x = ids
    for st in chain[:-1]:
        x = st.train_forward(task, x, lengths, **kw)
    loss = chain[-1].train_forward(task, x, lengths, labels, **kw)
    grad = None
    for st in reversed(chain):
        grad = st.train_backward(task, grad)
    assert grad is None  # the first stage has no input gradient to send
    return float(loss)


@pytest.mark.parametrize("model_id,cuts", [("tiny-llama-m", [0, 1, 3, 4]), ("qwen3", [0, 1, 2])])
def test_a_pipelined_training_step_gives_the_unsplit_models_lora_weights(model_id, cuts, request):
    model_id = model_of(model_id, request)
    batch = training_batch([(p, p[1:6]) for p in prompts([8, 13, 5], seed=4)])
    chain = stages(model_id, cuts)
    whole = add_lora(base(model_id), LORA)
    opt = torch.optim.AdamW([p for p in whole.parameters() if p.requires_grad], lr=LORA.lr)
    losses = []
    for step in range(3):  # B moves off zero after the first step, so later steps test A too
        ids, labels, lengths = batch
        mask = torch.tensor([[1] * n + [0] * (ids.shape[1] - n) for n in lengths])
        out = whole(input_ids=ids, attention_mask=mask)
        ref_loss = causal_lm_loss(out.logits, labels)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((float(ref_loss), pipelined_step(chain, batch, task=step)))
    for ref, got in losses:
        assert got == pytest.approx(ref, rel=1e-9)
    assert losses[-1][0] < losses[0][0]
    from peft import get_peft_model_state_dict
    ref_state = get_peft_model_state_dict(whole)
    merged = {}
    for st in chain:
        merged.update(st.lora_state())
    assert set(merged) == set(ref_state)
    for k in ref_state:
        torch.testing.assert_close(merged[k], ref_state[k], rtol=1e-7, atol=1e-10)


def test_dpo_across_pipeline_stages_matches_the_whole_model_step():
    """Preference pairs through three stages (policy and frozen-base rows side by side):
    the DPO loss and the LoRA weights after each step equal one whole-model stage's
    dpo_step, which the DPO tests check against peft by hand."""
    g = torch.Generator().manual_seed(11)
    pairs = [(p, torch.randint(3, 200, (4,), generator=g).tolist(), torch.randint(3, 200, (3,), generator=g).tolist())
             for p in prompts([6, 9], seed=5)]
    rows, preference = training_rows(pairs)
    assert preference and len(rows) == 4
    chain = stages("tiny-llama-m", [0, 1, 3, 4])
    nonzero_lora(chain)
    whole = stages("tiny-llama-m", [0, 4])[0]
    for st in chain:
        whole.load_lora_state(st.lora_state())
    for step in range(2):
        ref = whole.dpo_step(pairs, beta=0.5)
        got = pipelined_step(chain, training_batch(rows), task=step, preference=True, beta=0.5)
        assert got == pytest.approx(ref, rel=1e-9)
    merged = {k: v for st in chain for k, v in st.lora_state().items()}
    for k, v in whole.lora_state().items():
        torch.testing.assert_close(merged[k], v, rtol=1e-7, atol=1e-10)
    with pytest.raises(ValueError, match="not both"):
        training_rows([pairs[0], pairs[0][:2]])


def test_training_loss_ignores_padding_and_prompt_tokens():
    """Right padding must not change a sequence's loss: one sample alone and the same
    sample padded next to a longer one give the same per-sample loss."""
    chain = stages("tiny-llama-m", [0, 2, 4])
    short = (prompts([6], seed=9)[0], [70, 71, 72])
    long = (prompts([15], seed=8)[0], [80, 81])
    ids, labels, lengths = training_batch([short, long])
    x = chain[0].train_forward(0, ids, lengths)
    full = chain[1].executor.forward_train(x, lengths).detach()
    ids1, labels1, lengths1 = training_batch([short])
    x1 = chain[0].train_forward(1, ids1, lengths1)
    alone = chain[1].executor.forward_train(x1, lengths1).detach()
    torch.testing.assert_close(full[0, :lengths[0]], alone[0], rtol=1e-9, atol=1e-9)
    assert labels[0, :6].eq(-100).all() and labels[0, lengths[0]:].eq(-100).all()


def test_a_lora_update_is_visible_to_the_next_forward_and_nothing_else_changes_it():
    chain = stages("tiny-llama-m", [0, 2, 4])
    probe = prompts([11], seed=5)
    first = chain_forward(chain, [100], probe)
    for st in chain:
        st.release(100)
    again = chain_forward(chain, [101], probe)              # no step between: identical
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    pipelined_step(chain, training_batch([(p, p[2:9]) for p in prompts([7, 9], seed=6)]))
    after = chain_forward(chain, [102], probe)             # one step: the logits move
    assert (after - first).abs().max() > 1e-4


def test_exported_adapter_loads_in_peft_and_matches_the_stages(tmp_path):
    from peft import PeftModel
    from raycolo.online.stages.peft_format import export_adapter

    chain = stages("tiny-llama-m", [0, 2, 4])
    pipelined_step(chain, training_batch([(p, p[1:5]) for p in prompts([6, 9], seed=2)]))
    out = export_adapter([st.lora_state() for st in chain], LORA, tmp_path / "adapter")
    assert json.loads((out / "adapter_config.json").read_text())["r"] == LORA.rank
    assert (out / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(base("tiny-llama-m"), str(out)).eval()
    probe = prompts([10], seed=7)
    with torch.no_grad():
        ref = loaded(torch.tensor(probe)).logits[0, -1]
    got = chain_forward(chain, [5], probe)[0]
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_stage_frees_blocks_and_drops_other_stages_layers():
    chain = stages("tiny-llama-m", [0, 2, 4], lora=None)
    chain_forward(chain, [1, 2], prompts([9, 5]))
    assert chain[0].allocator.blocks_of(1) == 3 and chain[1].contexts == {1: 9, 2: 5}   # 9 tokens, blocks of 4
    for st in chain:
        st.release(1)
        st.release(2)
        st.allocator.check()
        assert st.contexts == {}
    layers = chain[0].model.model.layers
    assert isinstance(layers[3], torch.nn.Identity) and not isinstance(layers[0], torch.nn.Identity)
    assert chain[0].optimizer is None    # no LoRA: nothing to train


def test_packed_projections_match_plain_ones_and_leave_training_to_the_plain_weights():
    """float32 on the CPU: the executor packs frozen projections for oneDNN; logits agree
    with an unpacked executor, LoRA's A/B stay plain, and a training step still reaches the
    LoRA weights through the packed layers."""
    from raycolo.engine.executor import SeqChunk
    from raycolo.engine.executor.model import ModelExecutor
    from raycolo.engine.executor.packed import PackedLinear
    from raycolo.batching.blocks import BlockAllocator

    packed = StageModel(add_lora(build_tiny_model("tiny-llama-m", 0, "float32")[0], LORA), (0, 4), 64, 4,
                        lr=LORA.lr)
    plain = ModelExecutor(add_lora(build_tiny_model("tiny-llama-m", 0, "float32")[0], LORA), 64, 4,
                          pack_weights=False)
    # hidden 256: per layer (4) the fused q/k/v bases (the LoRA layers' frozen 256 x 256
    # and less, 768 x 256 together), the fused gate/up (2 x 688 x 256) and down, and the
    # 512 x 256 head reach 2^17 weights; o_proj's base (256 x 256) stays plain
    assert packed.executor.packed == 3 * 4 + 1 and plain.packed == 0
    layer = packed.model.base_model.model.model.layers[0]
    fusion = packed.executor.fusion[0]
    assert isinstance(layer.mlp.down_proj, PackedLinear) and fusion.gate_up.packed and fusion.qkv.packed
    assert not isinstance(layer.self_attn.o_proj.base_layer, PackedLinear)
    assert type(layer.self_attn.q_proj.lora_A["default"]) is torch.nn.Linear  # the adapter stays trainable
    ps = prompts([9, 13])
    got = packed.forward([0, 1], ps)
    alloc = BlockAllocator(64)
    chunks = []
    for rid, p in enumerate(ps):
        alloc.allocate(rid, -(-len(p) // 4))
        chunks.append(SeqChunk(p, start=0, table=alloc.tables[rid]))
    torch.testing.assert_close(got, plain.execute(plain.batch(chunks)), rtol=1e-4, atol=1e-4)
    before = {k: v.clone() for k, v in packed.lora_state().items()}
    ids, labels, lengths = training_batch([(ps[0], ps[0][1:4])])
    packed.train_forward(0, ids, lengths, labels)
    packed.train_backward(0)
    after = packed.lora_state()
    # B starts at zero, so only a gradient moves it; layer 0's gradient passed backward
    # through the packed projections of layers 1-3
    assert all(not torch.equal(before[k], after[k]) for k in before if "lora_B" in k)


def test_interleaved_training_tasks_use_the_weights_of_their_own_forward():
    """Task 1's forward runs before task 0's backward steps the optimizer (stages
    pipeline): task 1's backward must still work, with the weights its forward used."""
    chain = stages("tiny-llama-m", [0, 2, 4])
    b0 = training_batch([(p, p[1:5]) for p in prompts([7, 9], seed=11)])
    b1 = training_batch([(p, p[1:6]) for p in prompts([8, 6], seed=12)])
    x0 = chain[0].train_forward(0, b0[0], b0[2])
    chain[1].train_forward(0, x0, b0[2], b0[1])
    x1 = chain[0].train_forward(1, b1[0], b1[2])          # task 1 enters before task 0 steps
    g = chain[1].train_backward(0)
    chain[0].train_backward(0, g)                          # stage 0 steps: its weights change
    chain[1].train_forward(1, x1, b1[2], b1[1])
    g = chain[1].train_backward(1)
    chain[0].train_backward(1, g)                          # no in-place error
    assert chain[0].steps == chain[1].steps == 2


def test_base_rows_run_without_the_adapter_in_the_same_step():
    """Requests pinned to the base model share prefill and decode steps with adapter
    requests through a two-stage chain: their rows equal the model without LoRA, the
    others equal the model with it (each checked against a chain of its own)."""
    with_lora = stages("tiny-llama-m", [0, 2, 4])
    nonzero_lora(with_lora)
    reference_lora = copy_of(with_lora)
    reference_base = stages("tiny-llama-m", [0, 2, 4], lora=None)
    ps = prompts([7, 12, 5])
    rids, pinned = [0, 1, 2], [1]

    def chain(chain_, toks, base=()):
        hidden = None
        for st in chain_:
            hidden = st.forward(rids, toks, hidden, base=base)
        return hidden

    mixed, lora_only, base_only = chain(with_lora, ps, pinned), chain(reference_lora, ps), chain(reference_base, ps)
    for step in range(3):
        torch.testing.assert_close(mixed[[0, 2]], lora_only[[0, 2]], rtol=0, atol=1e-10)
        torch.testing.assert_close(mixed[[1]], base_only[[1]], rtol=0, atol=1e-10)
        assert (lora_only[1] - base_only[1]).abs().max() > 1e-3     # the adapter changes row 1
        nxt = [[int(t)] for t in mixed.argmax(-1)]
        mixed, lora_only, base_only = (chain(with_lora, nxt, pinned), chain(reference_lora, nxt),
                                       chain(reference_base, nxt))


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded-decode"])
def test_pinned_rows_run_with_their_saved_adapter_version_in_the_same_step(tmp_path, padded):
    """Version 1 of the adapter is exported (peft's format), then training moves on. A
    step mixing a request pinned to v1, one on the latest adapter and one on the base
    model gives each row what a chain holding only that variant gives; the latest weights
    are exactly as before afterwards, and the next training step still works.

    ``padded``: the chain under test decodes through the padded steps CUDA graphs replay
    (graphs.py, run eagerly here), one set per adapter state: the base rows' steps are
    kept apart from the adapter rows', and a pinned version reuses the latest's shapes
    (its weights are swapped into the same tensors)."""
    from raycolo.online.stages.peft_format import export_adapter
    from raycolo.engine.executor.graphs import enable_padded_decode

    chain = stages("tiny-llama-m", [0, 2, 4])
    if padded:
        for st in chain:
            enable_padded_decode(st.executor, capture=False)
    nonzero_lora(chain)
    v1 = export_adapter([st.lora_state() for st in chain], LORA, tmp_path / "v1")
    reference_v1 = copy_of(chain)
    for seed in (8, 9):       # training moves the latest adapter away from v1
        pipelined_step(chain, training_batch([(p, p[1:7]) for p in prompts([9, 6], seed=seed)]))
    reference_latest = copy_of(chain)
    reference_base = stages("tiny-llama-m", [0, 2, 4], lora=None)
    latest_before = [st.lora_state() for st in chain]
    ps, rids = prompts([7, 12, 5]), [0, 1, 2]

    def run(chain_, toks, **variants):
        hidden = None
        for st in chain_:
            hidden = st.forward(rids, toks, hidden, **variants)
        return hidden

    variants = {"base": [2], "pinned": {0: str(v1)}}
    references = [reference_v1, reference_latest, reference_base]     # row i: variant i
    mixed, refs = run(chain, ps, **variants), [run(r, ps) for r in references]
    for step in range(3):
        for row, ref in enumerate(refs):
            torch.testing.assert_close(mixed[row], ref[row], rtol=0, atol=1e-10)
        assert (refs[0][0] - refs[1][0]).abs().max() > 1e-3     # v1 differs from the latest
        nxt = [[int(t)] for t in mixed.argmax(-1)]
        mixed, refs = run(chain, nxt, **variants), [run(r, nxt) for r in references]
    for st, before in zip(chain, latest_before):
        for key, value in st.lora_state().items():
            assert torch.equal(value, before[key])
    if padded:      # each variant is a pass of one row: v1 and the latest share one graph,
        for st in chain:    # on every stage (a later stage's graphs keyed apart too)
            states = {(key[0][0], key[1]) for key in st.executor.graphs.graphs}
            assert states == {(False, 1), (True, 1)}, (st.first, states)     # (adapters off?, rows)
    pipelined_step(chain, training_batch([(p, p[1:7]) for p in prompts([9, 6], seed=10)]))


def test_stage_tensors_go_on_the_default_group_unless_it_is_nccl(tmp_path):
    """p2p_group: no side group without a process group or over gloo (tags match there);
    StageProcess then sends on the default group, in host memory."""
    import torch.distributed as dist

    from raycolo.online.stages.stage_process import p2p_group

    assert p2p_group(None) is None
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert p2p_group(dist) is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cuts", [[0, 2, 4], [0, 4]])
def test_scored_requests_get_the_whole_models_logits_at_every_prompt_position(cuts):
    """Prompt log-probabilities on the stage path: the last stage returns every new token's
    logits for the requests it scores (``every_logit``) and the last token's for the others,
    in a step where one scored request runs on the base model (a pass of its own); each
    prompt token's log-probability, rank and top tokens are transformers' on the whole
    model (a fresh adapter changes nothing), and the rows sampled from are its last ones."""
    from raycolo.generation.prompt_scores import split_scored
    from raycolo.generation.rows import PromptScore

    chain = stages("tiny-llama-m", cuts)
    whole = base("tiny-llama-m").eval()
    ps = prompts([9, 5, 13])
    rids, scored = [0, 1, 2], {0: PromptScore(ps[0], 2), 1: PromptScore(ps[1], 0)}
    hidden = None
    for st in chain:
        hidden = st.forward(rids, ps, hidden, base=[1], every_logit=scored)
    assert hidden.shape[0] == 9 + 5 + 1
    last, prompt_lps = split_scored(hidden, rids, [len(p) for p in ps], scored)
    assert prompt_lps[2] is None
    for rid, p in enumerate(ps):
        with torch.no_grad():
            ref = whole(torch.tensor([p])).logits[0]
        torch.testing.assert_close(last[rid], ref[-1], rtol=1e-9, atol=1e-9)
        if rid not in scored:
            continue
        lp, k = torch.log_softmax(ref, -1), scored[rid].top
        got = prompt_lps[rid]
        assert got[0] is None and len(got) == len(p)
        for j, e in enumerate(got[1:], 1):
            assert (e.token, e.rank) == (p[j], int((lp[j - 1] >= lp[j - 1, p[j]]).sum()))
            assert e.logprob == pytest.approx(float(lp[j - 1, p[j]]), abs=1e-6)
            assert [t for t, _ in e.top] == torch.topk(lp[j - 1], k).indices.tolist()
