"""A tensor-parallel rank's shard read alone from a safetensors checkpoint
(raycolo/engine/executor/shard_load.py) holds exactly what loading the whole model with
transformers' from_pretrained and cutting it gives, parameter for parameter and bit for
bit, on every rank; checkpoints it cannot read that way are left to the whole load."""
from __future__ import annotations

import json

import pytest
import torch

from raycolo.engine.executor.shard_load import checkpoint_files, load_rank_model, load_shard
from raycolo.engine.executor.tensor_parallel import TensorParallel, shard_layers
from raycolo.engine.models import build_tiny_model, load_model, save_tiny_checkpoint


def _whole_then_cut(path, rank: int, world: int):
    model, _ = load_model(str(path), 0, "float32")
    shard_layers(model.model.layers, model.config, TensorParallel(rank, world))
    return model


def _assert_same(ours, theirs):
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    for key, value in theirs_state.items():
        assert ours_state[key].dtype == value.dtype and torch.equal(ours_state[key], value), key
    for (name, a), (_, b) in zip(ours.named_buffers(), theirs.named_buffers()):    # rotary frequencies
        assert torch.equal(a, b), name


# Llama (8 heads, 4 KV heads), Qwen2 (q/k/v biases, a windowed layer), Mistral (one KV head:
# replicated on every rank)
@pytest.mark.parametrize("model_id,worlds", [("tiny-llama-m", (2, 4)), ("tiny-qwen2-s", (2,)),
                                             ("tiny-mistral-s", (2, 4))])
def test_each_rank_reads_what_the_whole_load_cut_to_it_holds(model_id, worlds, tmp_path):
    path = save_tiny_checkpoint(model_id, tmp_path / model_id, seed=3)
    for world in worlds:
        for rank in range(world):
            ours = load_shard(str(path), "float32", TensorParallel(rank, world))
            assert ours is not None
            _assert_same(ours, _whole_then_cut(path, rank, world))
            attn = ours.model.layers[0].self_attn
            assert attn.q_proj.weight.tp_slice == (0, rank * attn.q_proj.weight.shape[0],
                                                   (rank + 1) * attn.q_proj.weight.shape[0])
            assert attn.q_proj.weight.shape[0] == ours.config.num_attention_heads * attn.head_dim // world
            assert ours.model.layers[0].mlp.down_proj.weight.shape[1] == ours.config.intermediate_size // world


def test_a_checkpoint_in_several_files_and_a_real_tokenizer(hf_checkpoints, qwen3_checkpoint, tmp_path):
    """Several safetensors files under an index (the layout of every large checkpoint), the
    Qwen3 fixture (per-head norms, a head_dim apart from hidden / heads) and the BPE
    tokenizer of a Llama-3-style checkpoint."""
    model, _ = build_tiny_model("tiny-llama-m", seed=5)
    split = tmp_path / "split"
    model.save_pretrained(split, max_shard_size="200KB")
    assert len(checkpoint_files(split)) > 2 and (split / "model.safetensors.index.json").exists()
    for path in (split, qwen3_checkpoint):
        for rank in range(2):
            _assert_same(load_shard(str(path), "float32", TensorParallel(rank, 2)), _whole_then_cut(path, rank, 2))
    shard, tok = load_rank_model(str(hf_checkpoints["llama3"]), 0, "float32", TensorParallel(1, 2))
    _assert_same(shard, _whole_then_cut(hf_checkpoints["llama3"], 1, 2))
    assert tok.encode("hello world") == load_model(str(hf_checkpoints["llama3"]))[1].encode("hello world")


def test_row_parallel_biases_are_held_by_rank_0_alone(tmp_path):
    """Llama with ``attention_bias`` and ``mlp_bias``: o_proj's and down_proj's biases are
    in the files, read whole, and zeroed on every rank but 0 (the all-reduce adds them once)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()        # transformers initialises them to 0
    model.save_pretrained(tmp_path / "biased")
    for rank in range(2):
        ours = load_shard(str(tmp_path / "biased"), "float32", TensorParallel(rank, 2))
        _assert_same(ours, _whole_then_cut(tmp_path / "biased", rank, 2))
        assert bool(ours.model.layers[1].mlp.down_proj.bias.abs().sum() > 0) == (rank == 0)


def test_what_it_cannot_read_is_left_to_the_whole_load(hf_checkpoints, tmp_path):
    path = save_tiny_checkpoint("tiny-llama-s", tmp_path / "llama", seed=1)
    assert load_shard(str(hf_checkpoints["gpt2"]), "float32", TensorParallel(0, 2)) is None   # no fast path
    assert load_shard("tiny-llama-s", "float32", TensorParallel(0, 2)) is None                # not a directory
    assert load_shard(str(path), "float32", TensorParallel(0, 3)) is None                     # heads not divided
    # a tensor missing from the files: loaded whole (where transformers decides what to do)
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert load_shard(str(path), "float32", TensorParallel(0, 2)) is None
    # the catalog's tiny models, built in memory: the whole model, for the executor to cut
    model, _ = load_rank_model("tiny-llama-s", 0, "float32", TensorParallel(0, 2))
    assert model.model.layers[0].mlp.up_proj.weight.shape[0] == model.config.intermediate_size
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_a_tp2_torch_engine_on_a_checkpoint_reads_shards_and_equals_tp1(tmp_path, one_torch_thread):
    """The torch engine at tp=2 on a checkpoint directory (each rank, the engine's own
    process included, loading through load_rank_model): rank 0 holds half the query
    heads, and the greedy tokens equal tp=1's."""
    from raycolo.engine import SamplingParams, create_engine
    from tests.engine.test_executor import random_prompts

    path = save_tiny_checkpoint("tiny-llama-m", tmp_path / "llama", seed=2)

    def engine(tp):
        return create_engine({"model_loading_config": {"model_id": str(path), "dtype": "float64"},
                              "engine_kwargs": {"block_size": 4, "tensor_parallel_size": tp}})

    prompts = random_prompts([4, 30, 9])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = engine(1)
    expected = [o.token_ids for o in one.generate(prompts, params)]
    two = engine(2)
    try:
        q = two.model.model.layers[0].self_attn.q_proj.weight
        assert q.tp_slice == (0, 0, q.shape[0]) and 2 * q.shape[0] == one.model.model.layers[0].self_attn.q_proj.weight.shape[0]
        assert [o.token_ids for o in two.generate(prompts, params)] == expected
    finally:
        two.release()
