"""Padded decode steps (raycolo/engine/executor/graphs.py), the shapes CUDA graphs replay.

A CPU cannot capture a CUDA graph, but the padded step a graph records runs here eagerly
(``enable_padded_decode(capture=False)``): the same static batch, padding rows and padded
block tables pointing at the scratch block. It must give the unpadded executor's logits
and transformers' tokens, whole and in layer slices, past a sliding window. The capture
itself is checked on a GPU by ``make gpu-check`` (row ``executor.graphs``).
"""
from __future__ import annotations

import pytest
import torch

from raycolo.engine.models import TINY_SLIDING_WINDOW, build_tiny_model
from raycolo.engine.executor import ModelExecutor, SeqChunk, create_executor
from raycolo.engine.executor.graphs import BATCH_BUCKETS, DecodeBatch, enable_padded_decode
from tests.engine.test_executor import hf_greedy, random_prompts, run_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def padded(model, layers=None):
    ex = ModelExecutor(model, 256, 4, layers=layers, native_attention=False)
    enable_padded_decode(ex, capture=False)
    return ex


@pytest.mark.parametrize("model_id", ["tiny-llama-m", "tiny-mistral-s"])
def test_padded_decode_equals_the_unpadded_executor_and_transformers(model_id):
    model, _ = build_tiny_model(model_id, 0, "float64")
    # 3 rows pad to 4; tables of 3..17 blocks pad to 32; the Mistral's contexts pass its window
    prompts = random_prompts([6, 13, 3] if model_id == "tiny-llama-m" else [60, 13, 3])
    steps = 8
    plain, seqs = run_steps([create_executor(model, 256, 4)], prompts, steps)
    whole = padded(model)
    got, got_seqs = run_steps([whole], prompts, steps)
    assert got_seqs == seqs
    for a, b in zip(plain, got):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert ((), 4, 32 if model_id == "tiny-mistral-s" else 8) in whole.graphs.graphs   # (adapter state, rows, blocks)
    for i, p in enumerate(prompts):
        assert seqs[i][len(p):] == hf_greedy(model, p, steps + 1)
    if model_id == "tiny-mistral-s":
        assert max(len(s) for s in seqs) > TINY_SLIDING_WINDOW + 10


def test_padded_decode_in_layer_slices_passes_hidden_states():
    model, _ = build_tiny_model("tiny-llama-m", 0, "float64")
    prompts = random_prompts([6, 13, 3, 9, 21])          # 5 rows pad to 8
    plain, seqs = run_steps([create_executor(model, 256, 4)], prompts, 6)
    chain = [padded(model, r) for r in [(0, 1), (1, 3), (3, 4)]]
    got, got_seqs = run_steps(chain, prompts, 6)
    assert got_seqs == seqs
    for a, b in zip(plain, got):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert all(((), 8, 8) in ex.graphs.graphs for ex in chain)


def test_which_steps_are_padded_decode_steps():
    model, _ = build_tiny_model("tiny-llama-s", 0, "float64")
    ex = padded(model)
    table = [0, 1, 2]
    # a prefill, a chunk of two tokens, or a mixed step runs unpadded
    assert not isinstance(ex.batch([SeqChunk([5, 6, 7], 0, table)]), DecodeBatch)
    assert not isinstance(ex.batch([SeqChunk([5], 3, table), SeqChunk([5, 6], 0, [3])]), DecodeBatch)
    too_many = [SeqChunk([5], 0, [i]) for i in range(BATCH_BUCKETS[-1] + 1)]
    assert not isinstance(ex.batch(too_many), DecodeBatch)
    d = ex.batch([SeqChunk([5], 9, table), SeqChunk([6], 0, [3])])
    assert isinstance(d, DecodeBatch) and (d.num_seqs, d.rows, d.blocks) == (2, 2, 4)
    scratch = ex.cache.num_blocks - 1
    assert scratch == 256                               # past every block a sequence can own
    assert d.packed.tolist() == [5, 6, 9, 0, 2 * 4 + 1, 3 * 4,       # ids, positions, slots
                                 0, 1, 2, scratch, 3, scratch, scratch, scratch]
    with pytest.raises(ValueError, match="needs more than its 1 blocks"):
        ex.batch([SeqChunk([5], 4, [0])])


def test_graphs_are_captured_only_on_cuda():
    model, _ = build_tiny_model("tiny-llama-s", 0, "float64")
    assert create_executor(model, 64, 4, cuda_graphs=True).graphs is None    # the CPU: eager
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        enable_padded_decode(ModelExecutor(model, 64, 4), capture=True)


@pytest.mark.parametrize("rope,fixed", [(None, True), ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}, True),
                                         ({"rope_type": "dynamic", "factor": 2.0}, False)])
def test_only_fixed_rope_frequencies_are_captured(rope, fixed):
    """A captured step replays the frequencies it was captured with: "dynamic" RoPE picks
    them from each batch's longest position on the host, so those models decode eagerly
    (Llama 3.1's "llama3" scaling is fixed)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from raycolo.engine.executor.graphs import static_rope

    extra = {} if rope is None else {"rope_scaling": rope}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=10000.0, **extra)
    assert static_rope(LlamaRotaryEmbedding(config)) is fixed


def test_a_released_engine_frees_its_executor_and_graphs_at_once():
    """An executor and its decode graphs refer to each other; ``release()`` collects the
    cycle, so the weights, cache and captured graphs of a GPU engine go before the next
    engine loads (``raycolo profile`` loads a real-size model several times in a row)."""
    import gc
    import weakref

    from raycolo.engine.base import SamplingParams
    from raycolo.engine.factory import create_engine

    engine = create_engine({"backend": "torch", "model_loading_config": {"model_id": "tiny-llama-s"},
                            "engine_kwargs": {"max_num_seqs": 4, "kv_cache_tokens": 1024, "cpu_threads": 1}})
    enable_padded_decode(engine.executor, capture=False)
    engine.generate([[1, 5, 9, 12]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not any(r.graph_capture for r in engine.stats.iterations)     # nothing captured on the CPU
    executor, graphs = weakref.ref(engine.executor), weakref.ref(engine.executor.graphs)
    gc.disable()           # only release() may collect it
    try:
        engine.release()
        assert executor() is None and graphs() is None
    finally:
        gc.enable()

