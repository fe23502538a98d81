"""The part of an application still to run, as a workload the planner can plan.

A resumed job plans only what its journal does not hold: finished requests are dropped,
dependencies on finished upstream requests count as met, a chain step whose predecessor
is done becomes the head of its chain, and nodes with nothing left disappear.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from raycolo.offline.workload import NodeWorkload, Workload


def remaining_workload(workload: Workload, done: dict[str, np.ndarray]) -> Workload:
    keep = {n: ~done[n] for n in workload.nodes}
    new_index = {}
    for name, mask in keep.items():
        index = np.full(len(mask), -1, dtype=np.int64)
        index[mask] = np.arange(int(mask.sum()))
        new_index[name] = index
    nodes: dict[str, NodeWorkload] = {}
    for name, w in workload.nodes.items():
        mask = keep[name]
        if not mask.any():
            continue
        index = new_index[name]
        successor = np.where(w.successor >= 0, index[np.maximum(w.successor, 0)], -1)[mask]
        predecessor_done = np.zeros(len(w), dtype=bool)
        predecessor_done[1:] = done[name][:-1]
        chain_head = (w.chain_head | predecessor_done)[mask]
        deps = []
        for up, req, upi in w.deps:
            live = mask[req] & keep[up][upi]  # a finished upstream request is a met dependency
            if live.any():
                deps.append((up, index[req[live]], new_index[up][upi[live]]))
        nodes[name] = replace(w, input_len=w.input_len[mask], output_len=w.output_len[mask],
                              item=w.item[mask], successor=successor, chain_head=chain_head,
                              terminal=w.terminal[mask], deps=deps)
    return replace(workload, nodes=nodes)
