"""The model executor: one forward pass over a batch of sequences, on a paged KV cache.

Shared by the offline torch engine (:mod:`raycolo.engine.torch_engine`) and, on a layer
slice, by the online stage workers. Pure torch, no Ray. See docs/executor.md.
"""
from raycolo.engine.executor.batch import SeqChunk, StepBatch
from raycolo.engine.executor.kv_cache import PagedKVCache
from raycolo.engine.executor.model import FallbackExecutor, ModelExecutor, create_executor, fast_path_family

__all__ = ["FallbackExecutor", "ModelExecutor", "PagedKVCache", "SeqChunk", "StepBatch",
           "create_executor", "fast_path_family"]
