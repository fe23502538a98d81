"""The model executor: one forward pass over a batch of sequences, on a paged KV cache.

Shared by the offline torch engine (:mod:`raycolo.engines.torch_engine`) and, on a layer
slice, by the online stage workers. Pure torch, no Ray. See docs/executor.md.
"""
from raycolo.executor.batch import SeqChunk, StepBatch
from raycolo.executor.kv_cache import PagedKVCache
from raycolo.executor.model import FallbackExecutor, ModelExecutor, create_executor, fast_path_family

__all__ = ["FallbackExecutor", "ModelExecutor", "PagedKVCache", "SeqChunk", "StepBatch",
           "create_executor", "fast_path_family"]
