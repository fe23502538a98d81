"""Request dispatch of the offline controller: where each ready request goes.

A request whose node runs goes to one of its replicas by the planner's own rule,
:class:`~raycolo.offline.planner.dispatch.RoundRobin` (a chain's document stays on one
replica); one whose node does not run waits in ``pending`` until it does. Each replica
has at most one ``run`` call in flight: :meth:`Dispatcher.kick` sends it what it holds
once it is ready and idle.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

from raycolo.offline.planner.dispatch import RoundRobin
from raycolo.offline.runtime.communicator import Communicator, ReadyRequest
from raycolo.offline.runtime.setup import RunConfig

from raycolo.actors.offline.replica_records import Pending, Replica


class Dispatcher:
    """Hands ready requests to the running replicas of their node, or keeps them in
    ``pending``. ``replicas`` (each node's running replicas) and ``by_ref`` (every call in
    flight: its replica and kind) are the controller's tables, shared with the
    :class:`~raycolo.actors.offline.replicas.ReplicaSet` that starts and stops replicas."""

    def __init__(self, replicas: dict[str, list[Replica]], by_ref: dict[object, tuple[Replica, str]],
                 comm: Communicator, config: RunConfig, now: Callable[[], float]):
        self.replicas = replicas
        self.by_ref = by_ref
        self.comm = comm
        self.config = config
        self.now = now
        self.pending: dict[str, list[Pending]] = defaultdict(list)
        self.turns: dict[str, RoundRobin] = defaultdict(RoundRobin)    # the planner's dispatch rule

    def kick(self, rep: Replica) -> None:
        # Not before it is ready: a pooled actor runs calls beside its swap, which would
        # start the replica afresh under requests already handed over.
        if (rep.stopping or rep.ready_s is None or rep.inflight is not None
                or not (rep.outbox or rep.outstanding)):
            return
        batch = [p.payload() for p in rep.outbox]
        for p in rep.outbox:
            p.dispatched_s = self.now()
            p.attempts += 1
            rep.outstanding[p.ready.key] = p
        rep.outbox = []
        rep.inflight = rep.actor.run.options(name=f"{rep.name}.run").remote(batch, self.config.slice_s)
        self.by_ref[rep.inflight] = (rep, "run")

    def dispatch(self, node: str, items: list[Pending]) -> None:
        replicas = self.replicas[node]
        ordered = sorted(items, key=lambda p: p.ready.index)
        chained = node in self.comm.position
        ranks = self.turns[node].assign(len(ordered), len(replicas),
                                        [p.ready.item for p in ordered] if chained else None)
        touched = set()
        for p, rank in zip(ordered, ranks.tolist()):
            replicas[rank].outbox.append(p)
            touched.add(rank)
        for rank in touched:
            self.kick(replicas[rank])

    def enqueue(self, ready: list[ReadyRequest]) -> None:
        by_node = defaultdict(list)
        for r in ready:
            by_node[r.node].append(Pending(r))
        for node, items in by_node.items():
            if node in self.replicas:
                self.dispatch(node, items)
            else:
                self.pending[node].extend(items)
