"""Which data-parallel replica takes each request: one rule for the planner's simulation
(:func:`raycolo.offline.planner.state.run_node`) and the runtime's dispatch (``raycolo/actors/offline/dispatch.py``).

Requests take the replicas in turn, in the order given (by request index). A chain's
requests (a document's chunks, one after another) stay on the replica their item first
went to, and the items take the turns instead. An item whose replica is gone (the node
has fewer replicas now) takes a new turn.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


class RoundRobin:
    """The turns of one node's replicas, kept across calls (the runtime dispatches its
    requests as they become ready; the planner all of a stage's at once)."""

    def __init__(self) -> None:
        self.turn = 0
        self.item_replica: dict[int, int] = {}

    def assign(self, count: int, replicas: int, items: Optional[np.ndarray] = None) -> np.ndarray:
        """The replica (0 .. ``replicas`` - 1) of each of ``count`` requests, in order;
        ``items``: each request's item, for a chain."""
        if items is None:
            ranks = (self.turn + np.arange(count, dtype=np.int64)) % replicas
            self.turn += count
            return ranks
        uniq, first, inverse = np.unique(np.asarray(items, dtype=np.int64), return_index=True,
                                         return_inverse=True)
        rank_of = np.array([self.item_replica.get(u, -1) for u in uniq.tolist()], dtype=np.int64)
        new = np.flatnonzero((rank_of < 0) | (rank_of >= replicas))
        for u in new[np.argsort(first[new], kind="stable")].tolist():   # new items, as they first appear
            rank_of[u] = self.turn % replicas
            self.item_replica[int(uniq[u])] = int(rank_of[u])
            self.turn += 1
        return rank_of[inverse.reshape(-1)]
