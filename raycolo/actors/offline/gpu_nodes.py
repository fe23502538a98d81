"""Planner GPU ids on Ray's nodes.

The planner numbers a run's GPUs 0..N-1 and groups them by NVLink (``--nvlink-group``);
Ray puts a placement group wherever it finds free GPUs. Left at that, the warm pool's
single-GPU groups scatter over the nodes, and a tensor-parallel replica that evicts the
pooled actors of its planner GPUs may free GPUs on two nodes: its own group then spans
them (``PACK``) or waits for one node's (``STRICT_PACK``). So every planner GPU id belongs
to one node: the alive GPU nodes, in node-id order, each take a block of ids as large as
its GPUs, and every bundle names its GPU's node (a label selector on Ray's
``ray.io/node-id``). A replica then starts on the GPUs of the node the planner put it on,
and an NVLink group that fits in a node lies in one. With one GPU node, or past the GPUs
the cluster has (an autoscaling cluster planned with ``--gpus``), nothing is pinned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

NODE_LABEL = "ray.io/node-id"


def assign(nodes: Sequence[tuple[str, int]], gpus: int) -> tuple[str, ...]:
    """The node of each of the first ``gpus`` planner ids: blocks of each node's GPUs, in
    node-id order."""
    owners: list[str] = []
    for node, count in sorted(nodes):
        owners.extend([node] * count)
    return tuple(owners[:gpus])


@dataclass(frozen=True)
class GpuNodes:
    owners: tuple[str, ...] = ()     # owners[g]: the Ray node id of planner GPU g

    @classmethod
    def of_cluster(cls, gpus: int) -> "GpuNodes":
        import ray

        return cls(assign([(n["NodeID"], int(n.get("Resources", {}).get("GPU", 0))) for n in ray.nodes()
                           if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1], gpus))

    @property
    def pinned(self) -> bool:
        return len(set(self.owners)) > 1

    def selector(self, gpus: Sequence[int]) -> Optional[list[dict[str, str]]]:
        """The placement group's ``bundle_label_selector`` for a replica on ``gpus`` (one
        bundle per GPU, in order), or None where nothing is pinned."""
        if not self.pinned or any(g >= len(self.owners) for g in gpus):
            return None
        return [{NODE_LABEL: self.owners[g]} for g in gpus]

    def straddling(self, group: int) -> list[tuple[int, ...]]:
        """The NVLink groups (planner ids) whose GPUs lie on more than one node."""
        groups = [tuple(range(k, min(k + group, len(self.owners)))) for k in range(0, len(self.owners), group)]
        return [g for g in groups if len({self.owners[i] for i in g}) > 1] if self.pinned else []
