"""The online policy interface: what a policy decides, and what it asks of the executor.

A policy allocates every arriving task to a node (:meth:`OnlinePolicy.allocate`). What
else it needs from the world is declared, typed, in :class:`PolicyCapabilities`, instead
of being discovered with ``getattr``/``hasattr`` on the policy object:

* ``prioritize``: it may hold a training task back (``allocate`` returns None, eq. 4);
  the scheduler keeps it in the global queue and retries it as nodes finish work;
* ``memory_aware``: node schedulers run Algorithm 2 (wait, then offload) before a forward
  that would pass the stage's memory threshold; without it a forward runs anyway;
* ``queries_utilization``: every decision reads the nodes' GPU utilization. The query is
  the executor's cost, not the scheduler's: a simulator charges ``luf_query_s`` before
  the task reaches its node; a live executor pays whatever the real query takes;
* ``dedicated_nodes``: nodes are split into training and serving groups
  (:meth:`OnlinePolicy.groups`), and training weights are synced to the serving nodes
  every ``sync_every`` training tasks (SEPARATE).

Plans use :meth:`OnlinePolicy.estimator`: by default the node profile the executor
fitted from observed op times; a policy may plan with something else (``lemix-noprofile``
plans with length-blind latencies).

This module imports nothing from :mod:`raycolo.policies`; the policies import it, and
name lookup (``raycolo.policies.make_online_policy``) is the CLI's business.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from raycolo.online.scheduling.planning import LatencyEstimator
    from raycolo.online.profiles import NodeProfile
    from raycolo.online.scheduling.scheduler import OnlineScheduler
    from raycolo.online.scheduling.stage_rules import StageRule
    from raycolo.online.tasks import OnlineTask


@dataclass(frozen=True)
class PolicyCapabilities:
    prioritize: bool = False
    memory_aware: bool = False
    queries_utilization: bool = False
    dedicated_nodes: bool = False


class OnlinePolicy(ABC):
    """Base of every online allocation policy (LeMix, its ablations, the baselines)."""

    name: str = "policy"
    capabilities: PolicyCapabilities = PolicyCapabilities()

    @abstractmethod
    def allocate(self, task: "OnlineTask", scheduler: "OnlineScheduler", now: float) -> Optional[int]:
        """A node index, or None to hold a training task back (needs ``prioritize``)."""

    def groups(self, nodes: int) -> Optional[tuple[list[int], list[int]]]:
        """(training nodes, serving nodes) for ``dedicated_nodes`` policies; else None."""
        return None

    def stage_rule(self, profile: "NodeProfile", params) -> "Optional[StageRule]":
        """What each stage runs next on a node (raycolo.online.scheduling.stage_rules); None: the
        oldest ready op (LeMix's node logic). Called once per node: a rule may keep state."""
        return None

    def estimator(self, profile: "NodeProfile") -> "LatencyEstimator":
        """What this policy plans with, given the node profile fitted so far."""
        return profile
