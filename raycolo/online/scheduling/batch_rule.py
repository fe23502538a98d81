"""Algorithm 3's batching rule, in one place: the node closes its batches by it and LeMix's
batch-aware planning (:mod:`raycolo.online.scheduling.planning`) predicts them by it.

A node's inference batch opens when its first task arrives and closes when the sum of its
tasks' batch sizes C reaches ``max_batch``, ``T_w`` after it opened, or when a training task
reaches the node (LeMix §IV-D, Algorithm 3). Its prefill costs one forward of ΣC queries at
the batch's longest ℓ (the batch is padded).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRule:
    max_batch: int        # ΣC at which a batch closes
    max_wait_s: float     # T_w, seconds

    @classmethod
    def of(cls, params, profile) -> "BatchRule":
        """The rule for a node of ``profile`` under ``params`` (T_w is in forward latencies)."""
        return cls(params.max_batch, params.max_wait * profile.forward_latency_s)

    def closes_at(self, opened_s: float) -> float:
        """When a batch opened at ``opened_s`` closes, unless it fills first."""
        return opened_s + self.max_wait_s

    def full(self, queries: int) -> bool:
        """A batch of ``queries`` (ΣC) closes at once."""
        return queries >= self.max_batch
