"""GPU placement: keep continuing models where they are, pack new replicas into NVLink groups.

A tensor-parallel replica must sit inside one NVLink group. Models whose plan is
unchanged keep their GPUs (no reload); only if the new stage cannot be packed around
them do we move some, smallest first, and those moves count as reloads. A model whose
plan changes only its data parallelism (same tp) keeps the GPUs of its first replicas
(a dp1 replica stays replica 0 of dp2), unless that does not pack either.
"""
from __future__ import annotations

from typing import Optional

from raycolo.hardware import ClusterSpec
from raycolo.offline.planner.problem import ExecPlan

Placement = dict[str, list[tuple[int, ...]]]  # node -> GPU ids of each replica


_GROUPS: dict[tuple[int, int], list[list[int]]] = {}


def _groups(cluster: ClusterSpec) -> list[list[int]]:
    """``cluster.nvlink_groups()``, once per machine shape (placement is a hot path)."""
    shape = (cluster.num_gpus, cluster.nvlink_group)
    if shape not in _GROUPS:
        _GROUPS[shape] = cluster.nvlink_groups()
    return _GROUPS[shape]


def _pack(cluster: ClusterSpec, fixed: Placement, todo: list[tuple[str, ExecPlan]]) -> Optional[Placement]:
    taken = {gpu for replicas in fixed.values() for gpus in replicas for gpu in gpus}
    free = [[gpu for gpu in group if gpu not in taken]
            for group in _groups(cluster)]
    out = dict(fixed)
    # Largest replicas first, each into the fullest group that still fits it (best fit),
    # on that group's lowest free GPUs.
    for node, plan in sorted(todo, key=lambda item: (-item[1].tp, item[0])):
        replicas = list(fixed.get(node, []))    # a resized node's kept replicas come first
        tp = plan.tp
        for _ in range(plan.dp - len(replicas)):
            best = None
            for group in free:
                if len(group) >= tp and (best is None or len(group) < len(best)):
                    best = group
            if best is None:
                return None
            replicas.append(tuple(best[:tp]))
            del best[:tp]
        out[node] = replicas
    return out


def place(cluster: ClusterSpec, selection: dict[str, ExecPlan],
          previous: dict[str, tuple[ExecPlan, list[tuple[int, ...]]]]
          ) -> Optional[tuple[Placement, set[str]]]:
    """Return (placement, nodes that keep their plan but must move) or None if infeasible."""
    if sum(p.gpus for p in selection.values()) > cluster.num_gpus:
        return None
    keep = sorted((n for n, p in selection.items() if n in previous and previous[n][0] == p),
                  key=lambda n: (-selection[n].gpus, n))
    resized = sorted(n for n, p in selection.items() if n in previous and previous[n][0] != p
                     and previous[n][0].tp == p.tp)
    moved: set[str] = set()
    while True:
        fixed = {n: previous[n][1] for n in keep}
        partial = {n: previous[n][1][: selection[n].dp] for n in resized}
        todo = [(n, p) for n, p in selection.items() if n not in fixed]
        packed = _pack(cluster, {**fixed, **partial}, todo)
        if packed is not None:
            return {n: packed[n] for n in selection}, moved
        if resized:
            resized.pop()      # a resized model starts afresh before a kept one moves
            continue
        if not keep:
            return None
        moved.add(keep.pop())  # give up the smallest kept model first
