"""What one pipeline stage's process does with the ops it is told to run.

:class:`StageProcess` runs the typed messages of :mod:`raycolo.online.stages.stage_ops` on a
:class:`~raycolo.online.stages.stage_model.StageModel`, moving hidden states and gradients to and
from its neighbours over the node's process group (gloo on CPU, NCCL on GPUs).

Point-to-point traffic stays matched because every message is tagged: an op that feeds
the next stage (a forward's hidden states) or the stage before (a backward's input
gradient) sends with its own ``seq`` as the tag, and the op that consumes it names that
``seq`` (``after``) and receives exactly that tag. Consuming ops are only started after
the producing op reported done, so every receive has its send posted; sends are
asynchronous (``isend``), so a stage never waits for its neighbour to be free.

Pure torch: no Ray (the Ray Train worker around it is ``raycolo/actors/online/stage_worker.py``).
"""
from __future__ import annotations

import os
import time

import torch

from raycolo.generation.penalty_history import PenaltyHistory

from raycolo.online.stages.stage_ops import (DropActivations, EvalBatch, ForwardStep, LoadWeights, ReadAdapter,
                                        ReleaseKV, StageResult, StageWork, TrainBackward, TrainForward)

TAG_MOD = 1 << 30            # point-to-point tags are an op's seq modulo this


def p2p_group(dist):
    """The group a node's stages exchange hidden states and gradients on, made once on
    every rank (a collective call): None, the default group,
    unless that is NCCL; then a gloo group of the same ranks, through host memory. NCCL
    matches a receive to its peer's sends in the order they were posted, whatever their
    tags, and the stage rules start consuming ops out of that order (Harli, SIRIUS and
    MACE run inference first; Algorithm 2 holds a forward back): a decode could take a
    training forward's activations. gloo matches by tag."""
    if dist is None or not dist.is_initialized() or dist.get_backend() != "nccl":
        return None
    return dist.new_group(backend="gloo")


class StageProcess:
    """Runs one stage's ops; ``dist`` is ``torch.distributed`` with its group initialised
    (or None for a single stage)."""

    def __init__(self, stage_model, stage: int, stages: int, hidden_size: int, dtype, dist, group=None,
                 messages=None, rules=None):
        """``group``: the group of the point-to-point traffic (:func:`p2p_group`; None: the
        default group). ``messages``: the group the node loop's messages to and from this
        stage travel on (:func:`~raycolo.engine.executor.idle_group.idle_group`: a stage
        waits there for its next op as long as its node idles). ``rules``: on the last
        stage, what builds the model's :class:`~raycolo.generation.vocab_rules.VocabRules`
        (called at the first request with structured outputs or bad words; None: such
        requests fail)."""
        self.model, self.stage, self.stages = stage_model, stage, stages
        self.rules_factory, self.rules = rules, None
        self.penalties = PenaltyHistory()     # the last stage's penalized requests, on its device
        self.hidden, self.dtype, self.dist, self.group = hidden_size, dtype, dist, group
        self.messages = messages
        # where the stage computes, and where its point-to-point tensors live: NCCL sends
        # device tensors; gloo's send/recv take host tensors (a GPU stage over gloo, e.g.
        # two stages sharing one GPU, copies across)
        self.device = next(stage_model.executor.layers[0].parameters()).device
        nccl = (group is None and dist is not None and dist.is_initialized()
                and dist.get_backend() == "nccl")
        self.wire = self.device if nccl else torch.device("cpu")
        self.pending: dict[int, tuple] = {}   # seq -> (work, tensor) of isends not known received
        self.sent = 0                         # sends posted, all told

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.to(self.wire).contiguous()      # kept alive until the send completes
        self.pending[tag] = (self.dist.isend(tensor, dst, group=self.group, tag=tag % TAG_MOD), tensor)
        self.sent += 1

    def received(self, seqs) -> None:
        """These sends were consumed (the ops that receive them are done): let go of them.
        gloo's ``isend`` reports completion only to ``wait()`` (``is_completed()`` stays
        False until then), so without this every hidden state a stage ever sent stayed
        referenced: a stage worker's memory grew with every op. ``wait()`` returns at once
        for a send that completed; sends not yet consumed are never waited for (their
        receivers may be ops held back behind a checkpoint)."""
        for seq in seqs or ():
            item = self.pending.pop(seq, None)
            if item is not None:
                item[0].wait()

    def _recv(self, shape, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.wire)
        self.dist.recv(buf, src, group=self.group, tag=tag % TAG_MOD)
        return buf.to(self.device)

    def _forward_out(self, out: torch.Tensor, op: StageWork) -> None:
        """A forward's output goes on to the next stage (the last stage keeps it)."""
        if not self.last:
            self._send(out, self.stage + 1, op.seq)

    def _batch(self, samples):
        """A training op's token ids, labels (on the stage's device) and lengths."""
        from raycolo.online.stages.stage_model import training_batch, training_rows

        ids, labels, lengths = training_batch(training_rows(samples)[0])
        return ids.to(self.device), labels.to(self.device), lengths

    def run(self, op: StageWork) -> StageResult:
        started = time.perf_counter()
        self.received(op.received)
        result = StageResult(op.seq)
        kind = type(op)
        if kind is ForwardStep:
            self._forward(op, result)
        elif kind is TrainForward:
            rows, t = op.shape
            ids, labels, lengths = self._batch(op.samples) if (self.first or self.last) else (None, None, op.lengths)
            # a preference batch's hidden states carry the frozen base's rows too
            x = ids if self.first else self._recv((rows * (1 + op.preference), t, self.hidden),
                                                  self.stage - 1, op.after)
            out = self.model.train_forward(op.task, x, lengths, labels if self.last else None,
                                           loss_scale=op.loss_scale, preference=op.preference, beta=op.beta)
            if self.last:
                result.loss = float(out)
            self._forward_out(out, op)
        elif kind is TrainBackward:
            rows, t = op.shape
            grad = None if self.last else self._recv((rows * (1 + op.preference), t, self.hidden),
                                                     self.stage + 1, op.after)
            # a micro-batch of a task SIRIUS split accumulates with the task's others
            # (``group``); the last of them on this stage takes the step
            grad_in = self.model.train_backward(op.task, grad, step=op.step, group=op.group)
            if not self.first:
                self._send(grad_in, self.stage - 1, op.seq)
        elif kind is EvalBatch:
            self._evaluate(op, result)
        elif kind is LoadWeights:
            from safetensors.torch import load_file

            from raycolo.online.stages.stage_model import ADAPTER_WEIGHTS_FILE

            self.model.load_lora_state(load_file(os.path.join(op.adapter, ADAPTER_WEIGHTS_FILE)))
        elif kind is ReleaseKV:
            for rid in op.requests:
                self.model.release(rid)
                self.penalties.forget(rid)
        elif kind is DropActivations:     # SIRIUS took the memory back: free the activations now
            for task in op.tasks:
                self.model.drop_training(task)
        elif kind is ReadAdapter:
            result.state = self.model.lora_state(host=True)
        else:
            raise TypeError(f"not an op a stage runs: {op!r}")
        result.seconds = time.perf_counter() - started
        result.sends = (len(self.pending), self.sent)    # held (not known received), all told
        return result

    def _forward(self, op: ForwardStep, result: StageResult) -> None:
        counts = op.counts
        hidden = None if self.first else self._recv((sum(counts), self.hidden), self.stage - 1, op.after)
        tokens = op.tokens if self.first else [[0] * n for n in counts]
        out = self.model.forward(op.requests, tokens, hidden, base=op.base,
                                 pinned={int(r): d for r, d in op.pinned.items()}, every_logit=op.scored)
        if self.last and op.scored:     # each scored request's rows of logits, its last row sampled
            from raycolo.generation.prompt_scores import split_scored

            out, result.prompt_logprobs = split_scored(out, op.requests, counts, op.scored)
        if self.last:    # op.sampling: a SamplingRow per request (None: all plain greedy)
            from raycolo.generation.sampler import sample, sample_plain

            if op.sampling is None:
                sampled = sample_plain(out)
            else:
                if (self.rules is None and self.rules_factory is not None
                        and any(r.params.needs_vocabulary for r in op.sampling)):
                    self.rules = self.rules_factory()
                sampled = sample(out, op.sampling, self.rules, self.penalties)
            result.tokens = sampled.tokens
            if any(lp is not None for lp in sampled.logprobs):
                result.logprobs = sampled.logprobs
        self._forward_out(out, op)

    def _evaluate(self, op: EvalBatch, result: StageResult) -> None:
        """A forward-only pass of a held-out batch: its loss, or a preference batch's win
        rate and CLPD (MACE's alignment metrics)."""
        from raycolo.online.stages.losses import preference_stats, sequence_logprob
        from raycolo.online.stages.stage_model import causal_lm_loss, training_rows

        b, t = op.shape
        preference = training_rows(op.samples)[1]
        ids, labels, lengths = self._batch(op.samples)
        with torch.no_grad():
            x = ids if self.first else self._recv((b, t, self.hidden), self.stage - 1, op.after)
            out = self.model.executor.forward_train(x, lengths)
        if self.last and preference:
            logp = sequence_logprob(out, labels)
            stats = preference_stats(logp[:b // 2], logp[b // 2:])
            result.win_rate, result.clpd = stats["win_rate"], stats["clpd"]
        elif self.last:
            result.loss = float(causal_lm_loss(out, labels))
        else:
            self._send(out, self.stage + 1, op.seq)


def build_stage(build: dict, bounds, stage: int):
    """Stage ``stage``'s model (layers ``bounds[stage]:bounds[stage + 1]`` of the checkpoint,
    peft LoRA on them) from a deployment's :func:`raycolo.online.config.stage_build`;
    returns (StageModel, the model's transformers config)."""
    from raycolo.engine.models import load_model
    from raycolo.online.stages.stage_model import BATCHED_VERSIONS, LoraSettings, StageModel, add_lora

    # loaded in host memory: only the stage's layers go to its device (StageModel's device)
    model, _ = load_model(build["model_id"], seed=build["seed"], dtype=build["dtype"], device="cpu")
    lora = LoraSettings(**build["lora"])
    model = add_lora(model, lora)
    stage_model = StageModel(model, (bounds[stage], bounds[stage + 1]), build["num_blocks"], build["block_size"],
                             lr=lora.lr, pinned_cache=build["pinned_versions"],
                             cuda_graphs=build.get("cuda_graphs", False),
                             batched_versions=build.get("batched_versions", BATCHED_VERSIONS),
                             device=build["device"])
    return stage_model, model.config
