"""What crosses the process boundary between the offline controller and an engine replica
(:class:`~raycolo.actors.offline.engine_actor.EngineActor`): typed, no dicts of string keys.

The controller sends :class:`EngineRequest` lists (``run``, ``time_batch``); the actor
answers with a :class:`RunReport` (``run``), a :class:`DrainReport` (``drain``), a list of
:class:`Unfinished` (``take``), a :class:`ProbeTiming` (``time_batch``) or its
:class:`ReplicaInfo` (``info``, ``swap``). Pure Python: no Ray, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from raycolo.engine.base import RequestOutput
from raycolo.generation import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One request for a replica: its key, its prompt (text, or token ids once a
    preemption handed it back with its generated tokens) and its sampling parameters."""

    key: str
    prompt: Union[str, list[int]]
    params: SamplingParams


@dataclass(frozen=True)
class Unfinished:
    """A request a replica handed back unfinished: its prompt ids and the tokens it
    generated (``prompt_ids`` None: the engine never took it in)."""

    key: str
    prompt_ids: Optional[list[int]] = None
    generated: list[int] = field(default_factory=list)
    preemptions: int = 0


@dataclass(frozen=True)
class RunReport:
    """The requests that finished since the last report, and the work done for them."""

    outputs: list[RequestOutput]
    busy_s: float
    steps: int
    tokens: int


@dataclass(frozen=True)
class DrainReport(RunReport):
    """A drained replica's last report, with every request it had not finished."""

    unfinished: list[Unfinished] = field(default_factory=list)


@dataclass(frozen=True)
class ProbeTiming:
    """A compute probe of the warm pool: wall seconds, and tokens generated per key."""

    seconds: float
    output_lens: dict[str, int]


@dataclass(frozen=True)
class ReplicaInfo:
    """Where a replica runs and how it got its engine (``switch``: one of
    :data:`raycolo.offline.planner.engines.SWITCH_KINDS`)."""

    label: str
    pid: int
    node_id: str                      # the Ray node
    node_ip: str
    actor_name: Optional[str]
    gpu_ids: list[str]
    load_s: float
    switch: str
    swaps: int
    parked: int
    engine_key: str
    parked_keys: list[str]
    device: str
    model_id: str
    ranks: list = field(default_factory=list)     # tp_ranks.RankInfo per rank, rank 0 first
