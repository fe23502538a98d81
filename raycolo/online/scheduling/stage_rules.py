"""Which ready op a stage runs next: the per-GPU half of a co-location policy.

A node's stages run one op at a time (:mod:`raycolo.online.scheduling.node`). By default a stage
starts its oldest ready op (LeMix's node logic). A :class:`StageRule` orders, and may
hold back, the ready ops of one stage each time the stage is free; the node scheduler
then applies its memory rules (Algorithm 2) in that order. The same rule object runs in
the simulator and in the live controller, because both drive the same ``NodeScheduler``.

* :class:`HarliRule` (Harli §6, on time shares): inference first; between decode
  iterations a fine-tune op runs only when the predicted decode iteration plus that op
  still meets the TPOT target, else fine-tuning pauses until the inference load falls.
  Harli partitions SMs inside one iteration; with one op per stage at a time, raycolo
  shares time at op granularity instead, and the predictor is stage 1 of Harli's
  (:class:`~raycolo.latency_predictor.DecodeLatencyPredictor`) built from the
  node profile.
* :class:`SiriusRule` (SIRIUS §4): inference first; a prefill that does not fit the
  stage's memory aborts training tasks waiting for their backward (their activations are
  freed on every stage, and they run again from their first forward: SIRIUS discards
  the batch in its gradient phase and retries its samples). Only tasks with no op in
  flight and no activation or gradient on the wire are aborted, so the live pipeline's
  point-to-point messages stay matched. What SIRIUS adds on a real GPU (a shared memory
  pool, 5 ms handovers) is the node scheduler's reclaim (node.py) and MicroBatches.
* :class:`StaticShareRule`: Harli's StaticMode baseline, a fixed time share for
  fine-tuning whatever the load.
* :class:`MaceRule` (MACE §4.1): every ready op gets the priority
  ``P_w(t) = pi_w + delta_w * (t - t_arr)`` of its workload type (prefill, decode,
  fine-tune), plus ``gamma * loss`` for a fine-tune op whose training loss is known; the
  highest runs first (the live controller reports each training forward's loss, so
  the task's backward ops carry it). MACE sets ``pi_decode > pi_prefill > pi_ft`` and
  ``delta_ft > delta_prefill > delta_decode`` without giving values: the defaults below
  are raycolo's, in forward latencies. MACE's best-fit bin packing of several ops into
  one iteration has no counterpart here (a stage runs one op at a time).

Pure Python, no clock: the node scheduler passes ``now``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import math
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from raycolo.latency_predictor import DecodeLatencyPredictor, DecodeSample, fit
from raycolo.online.scheduling.node_types import OpKind
from raycolo.online.tasks import TaskKind

if TYPE_CHECKING:  # pragma: no cover
    from raycolo.online.profiles import NodeProfile
    from raycolo.online.scheduling.node_types import Op, Stage


class NodeView(Protocol):
    """What a stage rule reads of its node: :class:`~raycolo.online.scheduling.node.NodeScheduler`
    has these (the node imports its rules, not the other way round)."""

    profile: "NodeProfile"
    stages: "list[Stage]"
    batch: list                      # the inference tasks of the batch being formed
    joining: list                    # requests joining the decode batch at its next iteration
    first_start: Optional[float]     # when the node first started an op

INFERENCE_KINDS = (OpKind.PREFILL, OpKind.DECODE)
TRAIN_KINDS = (OpKind.TRAIN_F, OpKind.TRAIN_B)


def oldest_first(ops: Sequence["Op"]) -> list["Op"]:
    return sorted(ops, key=lambda op: (op.ready_s, op.seq))


def split_oldest_first(ops: Sequence["Op"]) -> tuple[list["Op"], list["Op"]]:
    """(inference ops, training ops), each oldest first."""
    return (oldest_first([op for op in ops if op.kind not in TRAIN_KINDS]),
            oldest_first([op for op in ops if op.kind in TRAIN_KINDS]))


class StageRule:
    """The default: the oldest ready op first, nothing held back."""

    name = "fifo"
    holds = False              # True: a rule that may leave a free stage idle
    reclaims = False           # True: a prefill short of memory aborts waiting training
    elastic = False            # True: a training task short of memory runs in smaller micro-batches

    def order(self, node: NodeView, stage: int, ops: Sequence["Op"], now: float) -> list["Op"]:
        """The ready ops of ``stage`` that may start now, most preferred first."""
        return oldest_first(ops)

    def fits(self, stage: "Stage", op: "Op", limit: float) -> bool:
        """Whether forward ``op`` fits the memory of a memory-aware stage (``limit``: the
        threshold of Algorithm 2, in bytes)."""
        return stage.used_bytes + op.mem_bytes <= limit

    def wake_at(self, node: NodeView, stage: int, now: float) -> Optional[float]:
        """A rule that held every ready op of ``stage`` back: when to look again even if
        no op ends meanwhile (None: at the next event)."""
        return None

    def started(self, stage: int, op: "Op") -> None:
        """The node started ``op`` on ``stage`` (after :meth:`order` offered it)."""

    def observe_loss(self, task_id: int, loss: float) -> None:
        """A training task's loss came out of its forward (the live executor reports it)."""

    def forget(self, task_id: int) -> None:
        """A training task is done: drop what the rule kept about it."""


def _arrival(op: "Op") -> float:
    task = op.tasks[0]
    return getattr(task, "task", task).arrival_s      # a Request wraps its task


@dataclass
class HarliRule(StageRule):
    """Inference first; fine-tune ops only where they fit under the TPOT target."""

    predictor: DecodeLatencyPredictor      # one stage's decode step
    tpot_target_s: float
    profile: object                        # the node's NodeProfile (training op durations)
    name: str = "harli"
    holds = True                           # may leave a stage idle: retry on every op end
    paused: int = 0            # times a fine-tune op was held back (a predicted violation)
    spent: dict = field(default_factory=dict)   # stage -> op seconds since its last decode iteration

    def running(self, node: NodeView) -> tuple[int, float]:
        """The node's decoding requests: how many, and their mean context."""
        running = list(node.joining)
        for op in _node_ops(node):
            if op.kind == OpKind.DECODE:
                running.extend(op.tasks)
        if not running:
            return 0, 0.0
        return len(running), sum(r.context for r in running) / len(running)

    def decode_iteration_s(self, node: NodeView) -> float:
        """The predicted latency of the node's next decode iteration (every stage), solo."""
        bs, context = self.running(node)
        return self.profile.stages * self.predictor.solo(bs, context) if bs else 0.0

    def with_finetune_s(self, node: NodeView, op: "Op") -> float:
        """The next decode iteration's predicted latency with fine-tune ``op`` run on one
        stage before it: that stage's part by stage 2 at the time shares the op leaves
        (with ``b1 = k1 = 1``, its decode plus the op), the other stages' solo."""
        bs, context = self.running(node)
        solo = self.predictor.solo(bs, context)
        op_s = expected_op_s(op, self.profile)
        share = solo / (solo + op_s)
        return (self.profile.stages - 1) * solo + self.predictor.colocated(bs, context, share, 1.0 - share)

    def order(self, node, stage, ops, now):
        inference, training = split_oldest_first(ops)
        if not training:
            return inference
        if inference:
            if any(op.kind != OpKind.DECODE for op in inference):
                return inference              # prefills first
            return self.between_iterations(node, stage, inference, training) + inference
        if self.decode_iteration_s(node) == 0.0 and not node.batch:
            return training                   # no inference on the node: fine-tune freely
        fits = [op for op in training if self.with_finetune_s(node, op) <= self.tpot_target_s]
        if len(fits) < len(training):
            self.paused += 1
        return fits

    def between_iterations(self, node, stage, decodes, training) -> list:
        """Only decode iterations are ready on ``stage``: the oldest fine-tune op that fits
        runs first when the iteration it delays, plus what ran on the stage since its last
        iteration, still meets the TPOT target. Harli gives fine-tuning the SMs a decode
        leaves *during* the iteration; a stage that runs one op at a time can only use each
        iteration's slack (docs/colocation-gaps.md: on a one-GPU node, without this, no
        fine-tune op ran while requests decoded). The iteration is the larger of the
        predictor's and the ready op's profiled step times the stages (the fitted predictor
        runs low at small batch)."""
        step = max(expected_op_s(op, self.profile) for op in decodes)
        iteration = max(self.decode_iteration_s(node), self.profile.stages * step)
        budget = self.tpot_target_s - iteration - self.spent.get(stage, 0.0)
        for op in training:
            if expected_op_s(op, self.profile) <= budget:
                return [op]
        self.paused += 1
        return []

    def started(self, stage, op):
        if op.kind == OpKind.DECODE:
            self.spent[stage] = 0.0
        elif op.kind != OpKind.SYNC:           # fine-tune ops and prefills delay the next iteration
            self.spent[stage] = self.spent.get(stage, 0.0) + expected_op_s(op, self.profile)


@dataclass
class SiriusRule(StageRule):
    """SIRIUS on a pipeline stage: inference first with the whole device; training runs on
    what is left, in micro-batches as large as that memory allows (gradient accumulation
    keeps the task's effective batch: :mod:`raycolo.online.scheduling.microbatches`), and a prefill
    short of memory takes memory back from training (the node scheduler aborts training
    micro-batches that wait for their backward, frees their activations on every stage and
    runs them again; :meth:`NodeScheduler._reclaim`)."""

    name: str = "sirius"
    reclaims = True
    elastic = True

    def order(self, node, stage, ops, now):
        inference, training = split_oldest_first(ops)
        return inference + training


def sirius_rule(profile, params) -> SiriusRule:
    return SiriusRule()


@dataclass
class StaticShareRule(StageRule):
    """Harli's StaticMode baseline on time shares: inference first, and fine-tuning gets a
    fixed share of each stage's time whatever the load (it may run while the stage's
    training time so far is within ``share`` of the time since the node first ran an op;
    with no inference on the node, freely)."""

    share: float = 0.5
    name: str = "static-share"
    holds = True

    def order(self, node, stage, ops, now):
        inference, training = split_oldest_first(ops)
        if inference or not training:
            return inference
        idle_of_inference = not node.joining and not node.batch and not any(
            op.kind not in TRAIN_KINDS for op in _node_ops(node))
        elapsed = now - (node.first_start if node.first_start is not None else now)
        if idle_of_inference or node.stages[stage].train_busy_s <= self.share * elapsed:
            return training
        return []

    def wake_at(self, node, stage, now):
        """When the stage's training time falls back within its share."""
        if node.first_start is None or self.share <= 0:
            return None
        return node.first_start + node.stages[stage].train_busy_s / self.share


@dataclass
class StaticPartitionRule(StaticShareRule):
    """SIRIUS's static-partition baseline: training gets a fixed part of each device, both
    of its time (:class:`StaticShareRule`'s share, standing in for a fixed SM partition)
    and of its memory (``train_memory`` of the stage's memory threshold; inference
    forwards fit in the rest). Neither side takes the other's part when it is idle."""

    train_memory: float = 0.5
    name: str = "static-partition"

    def fits(self, stage, op, limit):
        train = sum(v for (kind, _), v in stage.held.items() if kind == TaskKind.TRAIN)
        if op.kind == OpKind.TRAIN_F:
            return train + op.mem_bytes <= self.train_memory * limit
        return stage.used_bytes - train + op.mem_bytes <= (1 - self.train_memory) * limit


def static_partition_rule(profile, params) -> StaticPartitionRule:
    return StaticPartitionRule()


@dataclass
class PeriodicRule(StageRule):
    """MACE's periodic-retraining baseline (Ekya): fine-tuning waits for the next retraining
    epoch, every ``period_s``; an epoch preempts inference on the node (inference queues,
    synchronous blocking) until no fine-tune op is left, and the next epoch is due
    ``period_s`` after it ends."""

    period_s: float
    name: str = "periodic"
    holds = True
    next_s: Optional[float] = None         # when the next epoch may start
    in_epoch: bool = False

    def order(self, node, stage, ops, now):
        inference, training = split_oldest_first(ops)
        pending = _node_has_training(node)
        if self.next_s is None:
            self.next_s = now + self.period_s
        if self.in_epoch and not pending:
            self.in_epoch, self.next_s = False, now + self.period_s
        if not self.in_epoch and pending and now >= self.next_s:
            self.in_epoch = True
        return training if self.in_epoch else inference

    def wake_at(self, node, stage, now):
        return self.next_s if not self.in_epoch and self.next_s is not None and self.next_s > now else None


PERIOD_FORWARDS = 200       # the periodic baseline's interval, in forward latencies


def periodic_rule(profile, params) -> PeriodicRule:
    return PeriodicRule(PERIOD_FORWARDS * profile.forward_latency_s)


def _node_has_training(node: NodeView) -> bool:
    return any(op.kind in TRAIN_KINDS for op in _node_ops(node))


def _node_ops(node: NodeView):
    """Every op running or ready on the node's stages."""
    for st in node.stages:
        if st.busy is not None:
            yield st.busy
        for item in st.ready:
            yield item[2]


def static_share_rule(profile, params) -> StaticShareRule:
    return StaticShareRule()


class TrainingFirstRule(StageRule):
    """MACE's "sync retraining" baseline (AdaInf-like): fine-tune ops before inference."""

    name = "training-first"

    def order(self, node, stage, ops, now):
        inference, training = split_oldest_first(ops)
        return training + inference


def training_first_rule(profile, params) -> TrainingFirstRule:
    return TrainingFirstRule()


@dataclass
class Bin:
    """One iteration's bin of MACE's Algorithm 1: its items, memory and longest latency."""

    items: list = field(default_factory=list)
    memory: float = 0.0
    max_latency: float = 0.0


def pack_bins(items: Sequence[tuple], capacity: float, tau_mem: float, tau_task: int,
              lambdas: tuple[float, float] = (1.0, 1.0), latency_unit: float = 1.0) -> list[Bin]:
    """MACE's Algorithm 1 (GPU-local request scheduling): ``items`` are ``(item, memory,
    latency)`` in priority order. Each is dequeued in turn (until bin 1 holds
    ``tau_mem * capacity`` bytes or ``tau_task`` items were dequeued) and goes to the bin
    with room for it whose best-fit score ``f = l1 |free - m| + l2 |max_latency - l|`` is
    lowest, else to a new bin. Memory is scored in fractions of ``capacity`` and latency in
    ``latency_unit`` (raycolo's normalisation: the paper leaves the units open). Bin 1 runs
    this iteration; the others' items go back to the queue."""
    if capacity < 0 or tau_mem <= 0 or tau_task < 1:
        raise ValueError("pack_bins: capacity >= 0, tau_mem > 0, tau_task >= 1")
    l1, l2 = lambdas
    bins: list[Bin] = []
    for count, (item, m, latency) in enumerate(items):
        if bins and (bins[0].memory >= tau_mem * capacity or count >= tau_task):
            break
        best, best_score = None, math.inf
        for b in bins:
            free = capacity - b.memory
            if free >= m:
                score = l1 * abs(free - m) / max(capacity, 1.0) + l2 * abs(b.max_latency - latency) / latency_unit
                if score < best_score:
                    best, best_score = b, score
        if best is None:
            best = Bin()
            bins.append(best)
        best.items.append(item)
        best.memory += m
        best.max_latency = max(best.max_latency, latency)
    return bins


@dataclass
class MaceRule(StageRule):
    """MACE's dynamic priorities and iteration bins (§4.1-4.2). Each time a stage's current
    bin is used up, its ready ops, highest priority first, are packed by
    :func:`pack_bins` into bins of the stage's free memory; only bin 1 runs, and its ops
    start before anything that became ready later (the others go back to the queue with
    their priorities rising). On a GPU a bin's ops share one iteration; a raycolo stage
    runs one op at a time, so a bin's ops run back to back."""

    unit_s: float                                     # the node's forward latency
    profile: object = None                            # the node's NodeProfile (op latencies)
    pi: dict = field(default_factory=lambda: {"decode": 3.0, "prefill": 2.0, "ft": 1.0})
    delta: dict = field(default_factory=lambda: {"ft": 0.5, "prefill": 0.2, "decode": 0.1})
    gamma: float = 0.1
    tau_mem: float = 0.9                              # bin 1 closes at this share of free memory
    tau_task: int = 4                                 # ... or after this many ops were dequeued
    lambdas: tuple = (1.0, 1.0)                       # best-fit weights: memory, latency
    losses: dict = field(default_factory=dict)        # task id -> its current training loss
    current: dict = field(default_factory=dict)       # stage -> seqs of its bin 1 not started yet
    iterations: int = 0                               # bins formed
    name: str = "mace"

    def __post_init__(self) -> None:
        if not (self.pi["decode"] > self.pi["prefill"] > self.pi["ft"]
                and self.delta["ft"] > self.delta["prefill"] > self.delta["decode"]):
            raise ValueError("mace: needs pi_decode > pi_prefill > pi_ft and "
                             "delta_ft > delta_prefill > delta_decode (MACE §4.1)")

    def priority(self, op: "Op", now: float) -> float:
        kind = "ft" if op.kind in TRAIN_KINDS else op.kind
        waited = (now - _arrival(op)) / self.unit_s
        p = self.pi.get(kind, 0.0) + self.delta.get(kind, 0.0) * waited
        if kind == "ft":
            p += self.gamma * self.losses.get(op.tasks[0].task_id, 0.0)
        return p

    def order(self, node, stage, ops, now):
        ranked = sorted(ops, key=lambda op: (-self.priority(op, now), op.ready_s, op.seq))
        if self.profile is None:
            return ranked
        current = self.current.get(stage, set())
        chosen = [op for op in ranked if op.seq in current]
        if not chosen:
            free = max(0.0, node.profile.free_bytes - node.stages[stage].used_bytes)
            items = [(op, op.mem_bytes if op.kind in (OpKind.PREFILL, OpKind.TRAIN_F) else 0.0,
                      expected_op_s(op, self.profile) if op.kind != OpKind.SYNC else 0.0) for op in ranked]
            first = pack_bins(items, free, self.tau_mem, self.tau_task, self.lambdas, self.unit_s)[0]
            self.iterations += 1
            chosen = [op for op in ranked if op in first.items]
        self.current[stage] = {op.seq for op in chosen}
        return chosen

    def started(self, stage: int, op: "Op") -> None:
        self.current.get(stage, set()).discard(op.seq)

    def observe_loss(self, task_id: int, loss: float) -> None:
        self.losses[task_id] = loss         # its backward ops get gamma * loss

    def forget(self, task_id: int) -> None:
        self.losses.pop(task_id, None)


def harli_rule(profile, params) -> HarliRule:
    """Harli's rule for a node. Its predictor (stage 1, per stage) is fitted by least
    squares to the node profile's decode-step model over batch sizes 1-256 and contexts
    16-4,096 (in the live runtime the profile is the one fitted from measured ops), stage 2
    is ``params.harli_b1`` / ``harli_k1`` (``raycolo profile`` measures them); the
    TPOT target is ``params.tpot_multiplier`` x the predicted decode iteration of one
    request at the profile's reference length."""
    grid = [DecodeSample(bs, ctx, float(profile.decode_step_s(bs, ctx)))
            for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256) for ctx in (16, 64, 256, 1024, 4096)]
    predictor = replace(fit(grid), b1=params.harli_b1, k1=params.harli_k1)
    single = profile.stages * predictor.solo(1, profile.reference_length)
    return HarliRule(predictor, params.tpot_multiplier * single, profile)


def mace_rule(profile, params) -> MaceRule:
    return MaceRule(profile.forward_latency_s, profile)


def expected_op_s(op: "Op", profile) -> float:
    """An op's duration on its stage by the node profile, before any offload or overrun
    cost (the simulator's ``op_duration`` adds those; what Harli's and MACE's rules
    compare)."""
    if op.kind == OpKind.PREFILL:
        return profile.forward_s(op.batch, max(r.task.length for r in op.tasks))
    if op.kind == OpKind.DECODE:
        return profile.decode_step_s(op.batch, int(sum(r.context for r in op.tasks) / len(op.tasks)))
    if op.kind in TRAIN_KINDS:
        task = op.tasks[0]
        return (profile.forward_s if op.kind == OpKind.TRAIN_F else profile.backward_s)(task.batch, task.length)
    raise ValueError(f"expected_op_s: no profile duration for a {op.kind} op")
