"""The one KV-size rule (raycolo/kv_bytes.py), against hand-worked figures and the
Hugging Face configs' own conventions."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config

from raycolo.kv_bytes import AttentionShape, kv_bytes_per_token


def test_llama3_8b_holds_128_kib_per_token_in_bf16():
    # Llama 3 8B: 32 layers, 8 KV heads of 128 (grouped-query attention), bf16:
    # 2 (K and V) x 32 x 8 x 128 x 2 bytes = 131,072 bytes
    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert AttentionShape.of(cfg).kv_bytes_per_token(2) == 131_072
    assert kv_bytes_per_token(32, 8, 128, 2) == 131_072


def test_missing_kv_heads_and_head_dim_follow_the_configs_defaults():
    # no num_key_value_heads: multi-head attention; no head_dim: hidden / heads
    shape = AttentionShape.of({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4})
    assert (shape.kv_heads, shape.head_dim) == (4, 16)
    assert shape.kv_bytes_per_token(4) == 2 * 2 * 4 * 16 * 4
    qwen = Qwen2Config(num_hidden_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    assert AttentionShape.of(qwen) == AttentionShape(layers=3, hidden=96, heads=6, kv_heads=2, head_dim=16)
    # a stage's share of the layers
    assert AttentionShape.of(qwen).kv_bytes_per_token(2, layers=1.5) == pytest.approx(2 * 1.5 * 2 * 16 * 2)


def test_the_executor_cache_and_the_catalog_use_the_rule():
    import torch

    from raycolo.catalog import get_model
    from raycolo.engine.executor.kv_cache import PagedKVCache

    spec = get_model("tiny-llama-s")
    assert spec.kv_bytes_per_token == kv_bytes_per_token(spec.layers, spec.kv_heads, spec.head_dim, spec.dtype_bytes)
    cache = PagedKVCache(num_layers=3, num_blocks=4, block_size=16, kv_heads=2, head_dim=8, dtype=torch.float16)
    assert cache.bytes_per_token == 2 * 3 * 2 * 8 * 2
    cache.allocate()                      # what the tensors really take
    held = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert held == cache.nbytes == cache.bytes_per_token * 4 * 16
