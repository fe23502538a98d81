"""The paper's baselines for co-located serving and training (§VI-A).

* ``mix-rr`` (NaiveMix): every task to the next node in round-robin order.
* ``mix-luf``: lowest GPU utilization first; each decision queries utilization, which
  costs ``luf_query_s`` (Table III: 76 ms) before the task reaches its node.
* ``separate``: N_train = ⌊N·α + 0.5⌋ nodes train, the rest serve (each side keeps at
  least one node while it has work); round robin within each side; serving nodes receive
  the trained weights every ``sync_every`` training tasks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raycolo.online.scheduling.scheduler import OnlinePolicy, PolicyCapabilities
from raycolo.online.tasks import OnlineTask, TaskKind
from raycolo.online.policies.registry import register_online


@dataclass
class _Baseline(OnlinePolicy):
    """The baselines neither defer training nor watch memory."""

    params: object


@dataclass
class RoundRobin(_Baseline):
    name: str = "mix-rr"
    counter: int = 0

    def allocate(self, task: OnlineTask, sched, now: float) -> Optional[int]:
        node = self.counter % sched.nodes
        self.counter += 1
        return node


@dataclass
class LowestUtilizationFirst(_Baseline):
    name: str = "mix-luf"
    capabilities = PolicyCapabilities(queries_utilization=True)

    def allocate(self, task: OnlineTask, sched, now: float) -> Optional[int]:
        return min(sched.placeable, key=lambda n: (sched.utilization(n), n))


def train_node_count(nodes: int, train_rate: float) -> int:
    """⌊N·α + 0.5⌋, kept within [1, N-1] when both kinds of task exist."""
    count = int(nodes * train_rate + 0.5)
    if 0 < train_rate < 1 and nodes > 1:
        count = min(max(count, 1), nodes - 1)
    return count


@dataclass
class Separate(_Baseline):
    train_nodes: int = 0
    name: str = "separate"
    counters: dict = field(default_factory=lambda: dict.fromkeys(TaskKind, 0))
    capabilities = PolicyCapabilities(dedicated_nodes=True)

    def groups(self, nodes: int) -> tuple[list[int], list[int]]:
        train = list(range(nodes - self.train_nodes, nodes))
        serve = list(range(nodes - self.train_nodes)) or train
        return (train or serve), serve

    def allocate(self, task: OnlineTask, sched, now: float) -> Optional[int]:
        train, serve = self.groups(sched.nodes)
        group = train if task.is_train else serve
        key = task.kind
        node = group[self.counters[key] % len(group)]
        self.counters[key] += 1
        return node


@register_online("mix-rr")
def mix_rr(params, **_):
    return RoundRobin(params)


@register_online("mix-luf")
def mix_luf(params, **_):
    return LowestUtilizationFirst(params)


@register_online("separate")
def separate(params, nodes: int = 4, train_rate: float = 0.5, **_):
    return Separate(params, train_nodes=train_node_count(nodes, train_rate))
