"""The one rule for what a stage is told to run for a node's op, and for what a sampled
token does to its request: shared by the online controller (which runs every node's
scheduler today) and a node loop (:mod:`raycolo.online.scheduling.node_loop`, which runs one node's
scheduler next to its stages).

* :func:`stage_message` turns a :class:`~raycolo.online.scheduling.node_types.Op` into the typed message of
  :mod:`raycolo.online.stages.stage_ops` its stage runs, from the requests' state (prompts,
  tokens so far, sampling settings, pinned adapters) and the training tasks' samples.
* :func:`take_token` appends a sampled token to its request and says whether it ended it
  (raycolo.generation's stop rules: stop tokens after ``min_tokens``, ``max_tokens``; a
  cancelled request ends at its next token without it).

A request here is anything with the attributes of :class:`ServedRequest` (the
controller's ``LiveRequest`` adds its stream). Pure: no torch, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from raycolo.online.stages.stage_ops import ForwardStep, LoadWeights, StageWork, TrainBackward, TrainForward
from raycolo.generation import SamplingParams, check_stop
from raycolo.generation.rows import PromptArray, PromptScore, SamplingRow, plain
from raycolo.online.scheduling.node_types import Op, OpKind
from raycolo.online.samples import clip_sample, training_rows
from raycolo.online.tasks import OnlineTask
from raycolo.online.serving.token_wire import FrontKey, NodeAddress


@dataclass(frozen=True)
class WorkerStart:
    """When a stage worker got where, wall-clock seconds (time.time()): its process, the
    train function's entry, the stage model built, the checkpoint restored; for a worker
    that outlived its controller, when it found the restarted one (``rejoin_s``; it rolled
    back to its checkpoint by ``restored_s``)."""

    process_s: float
    train_function_s: float
    model_built_s: float
    restored_s: float
    rejoin_s: Optional[float] = None


@dataclass(frozen=True)
class WorkerInfo:
    """What a stage worker tells the controller when it registers: where it runs (Ray
    actor, process, Ray node, placement group) and the checkpoint it restored (the adapter
    version, the sample ranges it holds, the sample cursor), if any."""

    actor_id: str
    pid: int
    node_id: str                                  # the Ray node
    node_ip: str
    omp_wait_policy: Optional[str] = None
    restored_version: Optional[int] = None
    restored_held: Optional[list] = None          # sample seq ranges the checkpoint holds
    restored_cursor: Optional[dict] = None        # the samples.Cursor it saved, as fields
    placement_group: Optional[str] = None
    started: Optional[WorkerStart] = None         # its start (the controller's start_timeline)
    rejoined: bool = False                        # its group outlived an earlier controller
    node_inbox: Optional[NodeAddress] = None      # stage 0: replicas place requests there while the controller is down


@dataclass
class ServedRequest(PromptArray):
    """What a node needs of a request it serves."""

    task: OnlineTask
    prompt: list[int]
    params: SamplingParams
    seed: int = 0
    stop_ids: frozenset = frozenset()   # raycolo.generation.stop_token_set
    generated: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    cancelled: Optional[str] = None     # finish it at its next token with this reason
    base: bool = False                  # served by the base model, without the adapter
    version: Optional[int] = None       # served by this saved adapter version (<model>@v<k>)
    front: Optional[FrontKey] = None    # its tokens go from the node to this replica's inbox


@dataclass(frozen=True, slots=True)
class TrainingShare:
    """A training op's samples: its root task (the task SIRIUS split, or itself), the
    samples it trains on, and its share of the root's loss."""

    root: int
    samples: list
    share: float = 1.0


def training_share(op: Op, micro, samples_of: Callable[[int], list], max_len: int) -> TrainingShare:
    """A training op's samples (clipped to ``max_len``) and loss share: 1 unless SIRIUS
    split the task into micro-batches (``micro``: the node's
    :class:`~raycolo.online.scheduling.microbatches.MicroBatches`); then its share of the labelled
    tokens, or of the pairs, so that the micro-batches' gradients add up to the whole
    task's. ``samples_of(root)``: the root task's samples."""
    task = op.tasks[0]
    piece = micro.piece(task.task_id)
    root = task.task_id if piece is None else piece.root
    everything = [clip_sample(x, max_len) for x in samples_of(root)]
    if piece is None:
        return TrainingShare(root, everything)
    mine = everything[piece.first:piece.first + piece.samples]
    if len(everything[0]) == 3:
        return TrainingShare(root, mine, len(mine) / len(everything))
    return TrainingShare(root, mine, sum(len(c) for _, c in mine) / sum(len(c) for _, c in everything))


def stage_message(op: Op, stages: int, requests: Mapping[int, ServedRequest],
                  training: Callable[[Op], TrainingShare], version_dir: Callable[[object], str],
                  sync_dir: Callable[[int], str], dpo_beta: float, received: tuple = ()) -> StageWork:
    """What ``op``'s stage runs. ``training(op)``: a training op's samples;
    ``version_dir(version)``: where a pinned adapter version is; ``sync_dir(version)``:
    where SEPARATE's synced weights are; ``received``: the stage's sends since consumed."""
    s, last = op.stage, op.stage == stages - 1
    common = dict(seq=op.seq, after=op.after, received=tuple(received))
    if op.kind in (OpKind.PREFILL, OpKind.DECODE):
        reqs = [requests[r.task_id] for r in op.tasks]
        if op.kind == OpKind.PREFILL:      # a resumed request re-prefills what it streamed too
            tokens = [q.prompt + q.generated for q in reqs]
        else:
            tokens = [[q.generated[-1]] for q in reqs]
        sampling = None     # the last stage samples (raycolo.generation.sampler); None: all plain greedy
        if last and not all(plain(q.params) for q in reqs):
            sampling = [SamplingRow.of(q.params, q.seed, q.generated, q.prompt_array, q.stop_ids, q.task.task_id)
                        for q in reqs]
        # a prompt is scored once: a request resumed with tokens has sent its prompt's already
        scored = {q.task.task_id: PromptScore(list(q.prompt), q.params.prompt_logprobs) for q in reqs
                  if last and op.kind == OpKind.PREFILL and q.params.prompt_logprobs is not None and not q.generated}
        return ForwardStep(prefill=op.kind == OpKind.PREFILL, requests=[q.task.task_id for q in reqs],
                           counts=[len(t) for t in tokens], tokens=tokens if s == 0 else None,
                           base=tuple(q.task.task_id for q in reqs if q.base),
                           pinned={q.task.task_id: version_dir(q.version) for q in reqs if q.version is not None},
                           sampling=sampling, scored=scored, **common)
    if op.kind in (OpKind.TRAIN_F, OpKind.TRAIN_B):
        share = training(op)
        rows, preference = training_rows(share.samples)
        lengths = [len(p) + len(c) for p, c in rows]
        shape = (len(rows), max(lengths))
        if op.kind == OpKind.TRAIN_B:
            return TrainBackward(task=op.tasks[0].task_id, shape=shape, preference=preference, step=op.step,
                                 group=share.root, **common)
        return TrainForward(task=op.tasks[0].task_id, shape=shape, lengths=lengths, preference=preference,
                            beta=dpo_beta, loss_scale=share.share,
                            samples=share.samples if (s == 0 or last) else None, **common)
    if op.kind == OpKind.SYNC:
        return LoadWeights(adapter=sync_dir(op.version), **common)
    raise ValueError(f"no stage message for op kind {op.kind!r}")


def take_token(req: ServedRequest, token: int) -> tuple[bool, Optional[str]]:
    """The last stage sampled ``token`` for ``req``: (whether the token is the request's,
    why the request ends now or None). A cancelled request ends without it."""
    if req.cancelled is not None:
        return False, req.cancelled
    req.generated.append(token)
    return True, check_stop(req.params, req.stop_ids, req.generated)
