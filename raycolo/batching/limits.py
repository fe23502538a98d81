"""A replica's continuous-batching limits (vLLM's engine limits): KV blocks, sequences and
tokens per step. One rule for the planner's simulators and the engines."""
from __future__ import annotations

from dataclasses import dataclass

from raycolo.batching.blocks import DEFAULT_BLOCK_SIZE, blocks_for
from raycolo.catalog import ModelSpec
from raycolo.hardware import ClusterSpec

ACTIVATION_RESERVE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class SchedulerLimits:
    """vLLM engine limits of one replica."""

    num_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = DEFAULT_BLOCK_SIZE
    watermark: float = 0.01

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)


def kv_block_capacity(model: ModelSpec, cluster: ClusterSpec, tp: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """KV blocks per replica: memory left after the weight shard and an activation reserve."""
    usable = cluster.usable_bytes_per_gpu
    reserve = min(ACTIVATION_RESERVE_BYTES, 0.05 * cluster.gpu_memory_bytes)
    free = usable - model.weight_bytes / tp - reserve
    per_block = model.kv_bytes_per_token / tp * block_size
    return max(0, int(free // per_block))


def batched_token_budget(model: ModelSpec) -> int:
    """Tokens one iteration may prefill: a whole prompt of the model's context, at least
    2,048. The planner simulates with it, and the runtime, ``raycolo profile`` and
    ``raycolo validate`` give it to the engines they measure."""
    return max(2048, model.context_length)


def make_limits(model: ModelSpec, cluster: ClusterSpec, tp: int, max_num_seqs: int = 256) -> SchedulerLimits:
    return SchedulerLimits(
        num_blocks=kv_block_capacity(model, cluster, tp),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched_token_budget(model),
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
