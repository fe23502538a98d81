"""Which tensor-parallel degrees can split a model: one rule for the planner (which never
plans another), the engine (which refuses one before it starts) and the executor's sharding
(raycolo/engine/executor/tensor_parallel.py). Pure: no torch."""
from __future__ import annotations

from typing import Optional


def tp_split_error(world: int, heads: int, kv_heads: int, intermediate: int) -> Optional[str]:
    """Why ``world`` ranks cannot split a model of these shapes (None: they can). Query heads
    and the MLP's intermediate size split evenly; key/value heads split evenly or, where the
    world exceeds them, are replicated (``world`` a multiple of them), as vLLM's
    ``QKVParallelLinear`` does."""
    if world < 1:
        return f"must be at least 1, got {world}"
    if world == 1:
        return None
    if heads % world:
        return f"{world} does not divide the model's {heads} attention heads"
    if kv_heads % world and world % kv_heads:
        return f"{world} neither divides nor is a multiple of the model's {kv_heads} key/value heads"
    if intermediate % world:
        return f"{world} does not divide the model's intermediate size {intermediate}"
    return None
