"""What a pipeline stage is told to run, and what it answers: typed messages, no dicts.

These cross a process boundary (the online controller to a stage worker over Ray today;
a node loop to its stages over the stage workers' own process group next), so each is a
dataclass with its fields and defaults declared here once. A stage runs them with
:class:`~raycolo.online.stages.stage_process.StageProcess`.

Every message names its op by ``seq`` (the node's number for it; out-of-band work such as
an evaluation or a checkpoint gets a negative one). ``after`` is the ``seq`` of the op on
the neighbour stage whose output this one receives (the point-to-point tag), and
``received`` lists this stage's earlier sends that their receivers have consumed, which
the stage may now let go of.

Pure: no torch, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from raycolo.generation.rows import PromptScore


@dataclass(kw_only=True, slots=True)
class StageWork:
    seq: int
    after: Optional[int] = None
    received: tuple = ()


@dataclass(kw_only=True, slots=True)
class ForwardStep(StageWork):
    """A prefill (``prefill=True``) or decode step of a batch of requests.

    ``tokens``: each request's new token ids (the first stage only; later stages receive
    hidden states). ``counts``: how many tokens each request adds. ``base``: requests
    served by the base model (LoRA off); ``pinned``: request id -> the directory of the
    adapter version it is pinned to. ``sampling``: the last stage's
    :class:`~raycolo.generation.sampler.SamplingRow` per request, or None where every
    request is plain greedy (a request's KV blocks are freed by :class:`ReleaseKV`).
    ``scored``: the last stage's request id -> PromptScore of the requests of a prefill
    asking for their prompt's log-probabilities (:mod:`raycolo.generation.prompt_scores`)."""

    prefill: bool
    requests: list
    counts: list
    tokens: Optional[list] = None
    base: tuple = ()
    pinned: dict = field(default_factory=dict)
    sampling: Optional[list] = None
    scored: dict[int, PromptScore] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "prefill" if self.prefill else "decode"


@dataclass(kw_only=True, slots=True)
class TrainForward(StageWork):
    """A training micro-batch's forward, with autograd. ``shape``: (rows, padded length);
    ``lengths``: each row's length; ``samples``: the rows' token ids (the first and last
    stages: inputs and labels). ``loss_scale``: the micro-batch's share of its task's loss
    (SIRIUS's split); ``preference``: the batch holds DPO pairs (then ``beta``)."""

    task: int
    shape: tuple
    lengths: list
    beta: float
    samples: Optional[list] = None
    preference: bool = False
    loss_scale: float = 1.0


@dataclass(kw_only=True, slots=True)
class TrainBackward(StageWork):
    """The backward of ``task``'s forward on this stage. ``step``: take the optimizer step
    after it (the last micro-batch of ``group``'s task on this stage)."""

    task: int
    shape: tuple
    preference: bool = False
    step: bool = True
    group: Optional[int] = None


@dataclass(kw_only=True, slots=True)
class EvalBatch(StageWork):
    """A forward-only pass of held-out ``samples``: the last stage answers their loss, or a
    preference batch's win rate and CLPD."""

    shape: tuple
    samples: list


@dataclass(kw_only=True, slots=True)
class LoadWeights(StageWork):
    """Load this stage's part of the adapter saved in ``adapter`` (SEPARATE's sync)."""

    adapter: str


@dataclass(kw_only=True, slots=True)
class ReleaseKV(StageWork):
    """Free the KV blocks of finished ``requests``."""

    requests: tuple


@dataclass(kw_only=True, slots=True)
class DropActivations(StageWork):
    """Drop the activations of training ``tasks`` (SIRIUS took the memory back)."""

    tasks: tuple


@dataclass(kw_only=True, slots=True)
class SaveCheckpoint(StageWork):
    """Report this stage's adapter to Ray Train as adapter ``version``; the first stage
    also saves the sample ``cursor`` and the ranges of samples the adapter ``held`` (JSON)."""

    version: int
    cursor: str
    held: str


@dataclass(kw_only=True, slots=True)
class ReadAdapter(StageWork):
    """Answer this stage's LoRA weights (``StageResult.state``)."""


@dataclass(kw_only=True, slots=True)
class Stop(StageWork):
    """The node's loop ends (a stage's receiver returns). ``rejoin``: the deployment's
    controller restarted; the stages roll back to their checkpoint and register again."""

    rejoin: bool = False


StageMessage = Union[ForwardStep, TrainForward, TrainBackward, EvalBatch, LoadWeights,
                     ReleaseKV, DropActivations, SaveCheckpoint, ReadAdapter, Stop]
QUIET = (ReleaseKV, DropActivations)     # run without an answer


@dataclass(slots=True)
class StageResult:
    """What a stage answers for one op. ``tokens`` (and ``logprobs``): the last stage's
    sampled token per request; ``prompt_logprobs``: per request, its prompt's
    log-probabilities where the op scored it (else None); ``loss``: a last-stage training forward's or evaluation's;
    ``win_rate``/``clpd``: a preference evaluation's; ``state``: the stage's LoRA weights;
    ``sends``: (sends held, sends posted); ``device``: a device reading (every few
    seconds)."""

    seq: int
    seconds: float = 0.0
    tokens: Optional[list] = None
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None
    loss: Optional[float] = None
    win_rate: Optional[float] = None
    clpd: Optional[float] = None
    state: Optional[dict] = None
    sends: Optional[tuple] = None
    device: Optional[dict] = None
