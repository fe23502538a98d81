"""The size of a KV cache, one rule for every place that sizes one (the catalog's cost
model, the executor's cache, the vLLM and torch engines, the online profiles).

A token's keys and values take, per layer, ``kv_heads × head_dim`` elements each, so a
token costs ``2 · layers · kv_heads · head_dim · dtype_bytes`` bytes (grouped-query
attention shrinks ``kv_heads`` below the attention heads; vLLM's ``get_kv_cache_spec``
counts the same: ``2 * block_size * num_kv_heads * head_size * dtype_size`` per layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union


def kv_bytes_per_token(layers: float, kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """Bytes of keys and values one token holds over ``layers`` layers (a fraction where
    a pipeline stage holds an uneven share)."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class AttentionShape:
    """The attention geometry of a Hugging Face config (an object or its dict)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Union[Mapping[str, Any], Any]) -> "AttentionShape":
        """``num_key_value_heads`` absent or empty: multi-head attention (as many as the
        heads); ``head_dim`` absent: ``hidden_size / num_attention_heads``."""
        get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
        heads = int(get("num_attention_heads", 1) or 1)
        hidden = int(get("hidden_size", 0) or 0)
        return cls(layers=int(get("num_hidden_layers", 0) or 0), hidden=hidden, heads=heads,
                   kv_heads=int(get("num_key_value_heads", None) or heads),
                   head_dim=int(get("head_dim", None) or hidden // heads))

    def kv_bytes_per_token(self, dtype_bytes: float, layers: float | None = None) -> float:
        return kv_bytes_per_token(self.layers if layers is None else layers, self.kv_heads, self.head_dim,
                                  dtype_bytes)
