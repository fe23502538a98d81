"""LeMix's parameters, with defaults and where each comes from.

Times given as multiples are multiples of the model's whole-forward reference latency
(Table II), so one set of defaults fits every preset.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field

from raycolo.bounds import MAX_SECONDS, Strict


BIG = 1e6        # a multiple or weight beyond any that means something here


class LemixParams(Strict):
    model_config = ConfigDict(frozen=True)

    # f = (IP + λ2·LC) / (λ1·R), eq. 3. The paper sweeps both (Fig. 18) without fixing
    # defaults. LC is a density (1/tokens: ~0.004 at σ = 100 tokens); IP is at most -τ
    # (seconds). λ2 = 1 keeps λ2·LC below τ, so LC breaks near-ties; a larger λ2 lets a
    # node with a narrow length history turn its numerator positive and then outrank
    # every other node whatever its R (eq. 3's sign boundary; docs/online.md).
    lambda1: float = Field(default=1.0, gt=0, le=BIG)
    lambda2: float = Field(default=1.0, ge=0, le=BIG)
    # Eq. 3 with a negative numerator (the usual case: IP <= -τ). "monotone": num · λ1·R,
    # under which a faster node always scores higher. "quotient": num / (λ1·R), as LeMix's
    # code computes it (pejoule/LeMix distributed_llm.py): the largest planned R wins, which
    # with our LC put every task on one node in all 7 settings we tried (docs/online.md).
    score_rule: Literal["monotone", "quotient"] = "monotone"
    # Δa of eq. 1: "node", the gap since the task last placed on the scored node (LeMix's
    # code, distributed_llm.py: task_arrival[last_taskID] of that node's trace; the paper's
    # a - a_prev does not say which previous task); "global", since the previous arrival
    # anywhere (raycolo's earlier reading).
    arrival_gap: Literal["global", "node"] = "node"
    # τ of eq. 1, in forward latencies: idle-time increases below τ are tolerated alike
    # (IP = -max(Π/S - Δa, τ) <= -τ). With eq. 3 as we read it (docs/online.md) a busy
    # node keeps winning until τ·R exceeds an idle node's penalty, so τ = 1 forward
    # spills to a new node about when R reaches the 5-forward SLO.
    tau: float = Field(default=1.0, gt=0, le=BIG)
    # τ_R of eq. 4: the response SLO, in forward latencies ("e.g. 5x inference latency").
    slo_multiplier: float = Field(default=5.0, gt=0, le=BIG)
    slo_ms: Optional[float] = Field(default=None, gt=0, le=MAX_SECONDS * 1e3)  # absolute SLO; overrides the multiplier
    # Algorithm 3: maximum batch (sum of C) and maximum wait T_w ("0.5x inference latency").
    max_batch: int = Field(default=32, gt=0, le=1 << 20)
    max_wait: float = Field(default=0.5, ge=0, le=BIG)
    # Algorithm 2: memory threshold (fraction of a stage's free memory), check interval Δt
    # and maximum wait T_max, in forward latencies.
    memory_threshold: float = Field(default=0.9, gt=0, le=1)
    check_interval: float = Field(default=0.05, gt=0, le=BIG)
    max_memory_wait: float = Field(default=1.0, ge=0, le=BIG)
    # Host offload bandwidth for KV/activations (PCIe 4.0 x16, bytes/s).
    offload_bandwidth: float = Field(default=25e9, gt=0, le=1e15)
    # Without memory awareness an overrun slows the forward (allocator thrash, swapping).
    overrun_slowdown: float = Field(default=2.0, ge=1, le=BIG)
    # SEPARATE: weight sync every K training tasks over the inter-node network (bytes/s).
    sync_every: int = Field(default=100, gt=0, le=1 << 40)
    # Harli's rule: the TPOT target, in units of the node's predicted decode iteration of
    # one request at the reference length (raycolo's default; Harli sets a QoS target).
    tpot_multiplier: float = Field(default=3.0, gt=0, le=BIG)
    # Harli's predictor, stage 2 under time shares (b1, k1 of latency_predictor.py; what
    # ``raycolo profile`` prints): 1, 1 is no interference, an iteration's period is its
    # decode plus the fine-tune op run before it.
    harli_b1: float = Field(default=1.0, gt=0, le=100)
    harli_k1: float = Field(default=1.0, gt=0, le=100)
    sync_bandwidth: float = Field(default=12.5e9, gt=0, le=1e15)
    # MIX-LUF's GPU-utilization query before each allocation (Table III: 76 ms); the
    # simulator charges it, a live executor pays what its query really takes.
    luf_query_s: float = Field(default=0.076, ge=0, le=MAX_SECONDS)
    # Planning profile (η_F, η_B) fitted from observed training ops after this many
    # training tasks, and again each time their count doubles; until then the prior.
    profile_warmup: int = Field(default=8, ge=1, le=1 << 40)
    # ... with a fixed cost per op fitted beside η (dispatch and actor hops a live executor
    # pays on every op); false: LeMix's η·C·ℓ² alone. Decode steps then set the decode floor.
    fit_op_cost: bool = True
    # LeMix's cluster decision plans every placeable node up to ``scan_nodes`` of them;
    # beyond, only candidates from the node index (raycolo/online/node_index.py): the
    # ``candidate_window`` nodes freed last before the task's start and first after it,
    # the node idle longest, and the ``candidate_lengths`` nearest in mean task length.
    scan_nodes: int = Field(default=16, ge=1, le=1 << 20)
    candidate_window: int = Field(default=2, ge=1, le=1024)
    candidate_lengths: int = Field(default=2, ge=0, le=1024)

    def slo_s(self, forward_latency_s: float) -> float:
        return self.slo_ms / 1e3 if self.slo_ms is not None else self.slo_multiplier * forward_latency_s
