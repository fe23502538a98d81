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

    lambda1: float = Field(default=1.0, gt=0, le=BIG, description=(
        "λ1 of LeMix's node score f = (IP + λ2·LC) / (λ1·R) (eq. 3): the weight of the planned response "
        "time R. The paper sweeps λ1 and λ2 (Fig. 18) without fixing defaults."))
    lambda2: float = Field(default=0.1, ge=0, le=BIG, description=(
        "λ2 of eq. 3: the weight of the length consistency LC. With LC's default \"shape\" form (at most τ, "
        "seconds), 0.1 lets LC move a score by at most a tenth of τ: it breaks near-ties and never turns "
        "the numerator positive. With LC a density (1/tokens, ~0.004 at σ = 100 tokens but 0.13 at σ = 3) a "
        "node with a narrow length history can turn its numerator positive and then outrank every other "
        "node whatever its R (eq. 3's sign boundary; docs/online.md)."))
    score_rule: Literal["monotone", "quotient"] = Field(default="monotone", description=(
        "Eq. 3 with a negative numerator (the usual case: IP <= -τ). \"monotone\": num · λ1·R, under which "
        "a faster node always scores higher. \"quotient\": num / (λ1·R), as LeMix's code computes it "
        "(pejoule/LeMix distributed_llm.py): the largest planned R wins, which with raycolo's LC put every "
        "task on one node in all 7 settings tried (docs/online.md)."))
    arrival_gap: Literal["global", "node"] = Field(default="node", description=(
        "Δa of eq. 1. \"node\": the gap since the task last placed on the scored node (LeMix's code, "
        "distributed_llm.py: task_arrival[last_taskID] of that node's trace; the paper's a - a_prev does "
        "not say which previous task); \"global\": since the previous arrival anywhere (raycolo's earlier "
        "reading)."))
    tau: float = Field(default=1.0, gt=0, le=BIG, description=(
        "τ of eq. 1, in forward latencies: idle-time increases below τ are tolerated alike "
        "(IP = -max(Π/S - Δa, τ) <= -τ). With eq. 3 as raycolo reads it (docs/online.md) a busy node keeps "
        "winning until τ·R exceeds an idle node's penalty, so τ = 1 forward spills to a new node about "
        "when R reaches the 5-forward SLO."))
    batch_aware: bool = Field(default=True, description=(
        "Plan inference tasks in the batch they will run in (raycolo's extension of Algorithm 1, "
        "docs/online.md): a task waits for its batch to close (T_w) and costs the padded forward of the "
        "whole batch, and eq. 4 plans the next inference task the same way, behind the backwards already "
        "planned. false: Algorithm 1 and eq. 4 as the paper writes them (each task its own forward)."))
    hold_share: float = Field(default=0.6, gt=0, le=1, description=(
        "Eq. 4 holds a training task back when the next inference task's predicted response exceeds this "
        "share of τ_R (raycolo's; the paper's eq. 4 is 1). Eq. 4 guards only the next inference task, so at "
        "1 the nodes fill with training up to the SLO's edge and any planning error misses it; 0.6 won every "
        "saturated cell of bench/online_grid.py that 1 lost (docs/online.md)."))
    plan_error_quantile: Optional[float] = Field(default=0.9, ge=0, le=1, description=(
        "Calibrated eq. 4 (raycolo's extension, docs/online.md): a training task is held back when the next "
        "inference task's planned response plus this quantile of how late first tokens came out against "
        "their plans (the latest 256, after 16) exceeds hold_share·τ_R. Plans cannot see every op the node "
        "will run first; this learns by how much they miss. null: no margin, as eq. 4 is written."))
    backlog_aware: bool = Field(default=True, description=(
        "Calibrated R (raycolo's extension, docs/online.md): each node's planned response, in eq. 3's "
        "score and eq. 4's check, adds the work on that node its plans do not see: how late its latest "
        "op ended against its plan, drained at one second per second since. Plans shift a late task's "
        "own path, not the queue behind it, and cannot see decode iterations or a shared CPU. Eq. 4's "
        "batch-aware check then takes no plan_error_quantile margin (with batch_aware false it keeps the "
        "margin and adds no backlog). false: R as planned."))
    length_consistency: Literal["shape", "density"] = Field(default="shape", description=(
        "LC of eq. 2. \"shape\": the Gaussian's shape exp(-z²/2) times τ (seconds, like IP; raycolo's), so "
        "λ2·LC <= λ2·τ and with λ2 <= 1 the numerator of eq. 3 stays <= 0: LC breaks near-ties. "
        "\"density\": N(ℓ; μ, σ) in 1/tokens, as the paper writes it; a node with a narrow length history "
        "(short prompts, σ of a few tokens) then turns its numerator positive and outranks every other node "
        "whatever its R (docs/online.md)."))
    slo_multiplier: float = Field(default=5.0, gt=0, le=BIG, description=(
        "τ_R of eq. 4: the response SLO, in forward latencies (the paper: \"e.g. 5x inference latency\")."))
    slo_ms: Optional[float] = Field(default=None, gt=0, le=MAX_SECONDS * 1e3, description=(
        "An absolute response SLO in milliseconds; when set it overrides slo_multiplier."))
    max_batch: int = Field(default=32, gt=0, le=1 << 20, description=(
        "Algorithm 3's maximum batch: a node's open inference batch closes once the sum of its tasks' "
        "batch sizes (C) reaches this."))
    max_wait: float = Field(default=0.5, ge=0, le=BIG, description=(
        "Algorithm 3's maximum wait T_w, in forward latencies: an open inference batch closes this long "
        "after its first task arrived (the paper: \"0.5x inference latency\")."))
    memory_threshold: float = Field(default=0.9, gt=0, le=1, description=(
        "Algorithm 2's memory threshold: the fraction of a stage's free memory a forward op may fill "
        "before it has to wait."))
    check_interval: float = Field(default=0.05, gt=0, le=BIG, description=(
        "Algorithm 2's check interval Δt, in forward latencies: how often a forward op waiting for "
        "memory checks again."))
    max_memory_wait: float = Field(default=1.0, ge=0, le=BIG, description=(
        "Algorithm 2's maximum wait T_max, in forward latencies: a forward op that has waited this long "
        "for memory runs with its memory offloaded to the host."))
    offload_bandwidth: float = Field(default=25e9, gt=0, le=1e15, description=(
        "Host offload bandwidth for KV and activations in bytes/s (PCIe 4.0 x16); the simulator charges "
        "offloads and reloads at this rate."))
    overrun_slowdown: float = Field(default=2.0, ge=1, le=BIG, description=(
        "Without memory awareness an overrun slows the forward (allocator thrash, swapping): the "
        "simulator multiplies an overrunning forward's time by this."))
    sync_every: int = Field(default=100, gt=0, le=1 << 40, description=(
        "SEPARATE: the training nodes' weights are synced to the serving nodes every this many finished "
        "training tasks."))
    tpot_multiplier: float = Field(default=3.0, gt=0, le=BIG, description=(
        "Harli's rule: the TPOT target, in units of the node's predicted decode iteration of one request "
        "at the reference length (raycolo's default; Harli sets a QoS target)."))
    harli_b1: float = Field(default=1.0, gt=0, le=100, description=(
        "b1 of Harli's predictor, stage 2 under time shares (latency_predictor.py; what `raycolo profile` "
        "prints): the weight of the inference share in the interference factor. b1 = k1 = 1 is no "
        "interference: an iteration's period is its decode plus the fine-tune op run before it."))
    harli_k1: float = Field(default=1.0, gt=0, le=100, description=(
        "k1 of Harli's predictor, stage 2 under time shares (latency_predictor.py; what `raycolo profile` "
        "prints): the weight of the fine-tune share in the interference factor (1 with b1 = 1: no "
        "interference)."))
    sync_bandwidth: float = Field(default=12.5e9, gt=0, le=1e15, description=(
        "SEPARATE: the inter-node network bandwidth for weight syncs, in bytes/s; a sync takes a stage's "
        "weight bytes over this."))
    luf_query_s: float = Field(default=0.076, ge=0, le=MAX_SECONDS, description=(
        "MIX-LUF's GPU-utilization query before each allocation, in seconds (Table III: 76 ms); the "
        "simulator charges it, a live executor pays what its query really takes."))
    profile_warmup: int = Field(default=8, ge=1, le=1 << 40, description=(
        "The planning profile (η_F, η_B) is fitted from observed training ops after this many training "
        "tasks, and again each time their count doubles; until then the prior is used."))
    fit_op_cost: bool = Field(default=True, description=(
        "Fit a fixed cost per op beside η (the dispatch and actor hops a live executor pays on every op), "
        "and let decode steps set the decode floor; false: LeMix's η·C·ℓ² alone."))
    scan_nodes: int = Field(default=16, ge=1, le=1 << 20, description=(
        "LeMix's cluster decision plans every placeable node up to this many of them; beyond, only "
        "candidates from the node index (raycolo/online/scheduling/node_index.py)."))
    candidate_window: int = Field(default=2, ge=1, le=1024, description=(
        "Beyond scan_nodes, the node index offers the this-many nodes freed last before the task's start "
        "and the this-many freed first after it, besides the node idle longest."))
    candidate_lengths: int = Field(default=2, ge=0, le=1024, description=(
        "Beyond scan_nodes, the node index also offers this many nodes nearest the task in mean task "
        "length."))

    def slo_s(self, forward_latency_s: float) -> float:
        return self.slo_ms / 1e3 if self.slo_ms is not None else self.slo_multiplier * forward_latency_s


# LeMix as the paper writes it, over raycolo's extensions: Algorithm 1 and eq. 4 with each task
# its own forward, eq. 4 at τ_R without margin or backlogs, LC a density (with λ2 1, raycolo's
# earlier default). ``LemixParams(**PAPER_LITERAL)``; bench/decision.py compares the two.
PAPER_LITERAL = {"batch_aware": False, "hold_share": 1.0, "plan_error_quantile": None, "backlog_aware": False,
                 "length_consistency": "density", "lambda2": 1.0}
