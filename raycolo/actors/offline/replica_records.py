"""The offline controller's records of its replicas and of the requests on their way:
what the dispatcher (dispatch.py), the replica lifecycle (replicas.py), the warm pool
(pool.py) and the controller share. Plain dataclasses; the actors they name are Ray
actor handles.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raycolo.engine.replica_messages import EngineRequest, ReplicaInfo, RunReport
from raycolo.offline.planner.problem import ExecPlan
from raycolo.offline.runtime.communicator import ReadyRequest


@dataclass
class Pending:
    """A request on its way: queued, sent to a replica, or moved after a preemption."""

    ready: ReadyRequest
    prompt_ids: Optional[list[int]] = None   # set once a preemption returned it
    generated: list[int] = field(default_factory=list)
    preemptions: int = 0
    attempts: int = 0
    dispatched_s: float = 0.0

    def payload(self) -> EngineRequest:
        prompt = self.ready.prompt if self.prompt_ids is None else self.prompt_ids + self.generated
        return EngineRequest(self.ready.key, prompt, self.ready.sampling(len(self.generated)))


@dataclass
class Replica:
    node: str
    plan: ExecPlan
    rank: int
    gpus: tuple[int, ...]
    name: str
    pg: object
    actor: object
    created_s: float
    info_ref: Optional[object] = None
    ready_s: Optional[float] = None
    stopped_s: Optional[float] = None
    info: Optional[ReplicaInfo] = None
    inflight: Optional[object] = None
    outbox: list[Pending] = field(default_factory=list)
    outstanding: dict[str, Pending] = field(default_factory=dict)
    busy_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    restarts: int = 0
    stopping: bool = False
    switch: str = "cold"        # how it got its actor: cold (a new one), swap, wake or keep (pooled)

    def segment_rows(self, end_s: float) -> list[tuple[int, float, float, float, str]]:
        stop = self.stopped_s if self.stopped_s is not None else end_s
        ready = self.ready_s if self.ready_s is not None else stop
        return [(g, self.created_s, min(ready, stop), stop, self.node) for g in self.gpus]

    def account(self, result: RunReport) -> None:
        """Add the work a ``run`` or ``drain`` call reports."""
        self.busy_s += result.busy_s
        self.tokens += result.tokens
        self.steps += result.steps


@dataclass
class Pooled:
    """A drained engine actor kept warm on its GPUs, with the placement group holding them."""

    gpus: tuple[int, ...]
    pg: object
    actor: object
    # the engine config it serves with and those it parked (EngineActor.info's keys), where
    # known: the warm pool's start tells the planner (raycolo.offline.planner.engines)
    engine_key: str = ""
    parked_keys: tuple[str, ...] = ()
