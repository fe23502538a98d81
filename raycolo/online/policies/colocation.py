"""Harli's, SIRIUS's and MACE's per-GPU rules as online policies, composed with a node allocation.

A co-location policy here is two halves: which node each task goes to (an allocation
policy: round robin or LeMix) and what each stage of a node runs next (a stage rule,
:mod:`raycolo.online.scheduling.stage_rules`). Names say both:

* ``harli``, ``sirius``, ``mace``: round-robin allocation (``mix-rr``), then the rule
  (``sirius`` makes the nodes memory-aware: a forward that does not fit waits, and a
  prefill may take memory back from training);
* ``lemix+harli``, ``lemix+sirius``, ``lemix+mace``: LeMix's allocation (eq. 1-4,
  Algorithm 2), then the rule;
* baselines: ``harli-static`` (a fixed half of each stage's time for fine-tuning:
  Harli's StaticMode), ``sirius-timeshare`` (inference first, no memory awareness:
  SIRIUS's time sharing), ``sirius-static`` (fixed halves of each stage's time and
  memory: SIRIUS's static partition), ``mace-sync`` (fine-tuning first: MACE's sync
  retraining, AdaInf) and ``mace-periodic`` (retraining epochs at fixed intervals that
  preempt inference: MACE's periodic retraining, Ekya).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from raycolo.online.scheduling.scheduler import OnlinePolicy
from raycolo.online.scheduling.stage_rules import (harli_rule, mace_rule, periodic_rule, sirius_rule,
                                        static_partition_rule, static_share_rule, training_first_rule)
from raycolo.online.tasks import OnlineTask
from raycolo.online.policies import lemix, baselines
from raycolo.online.policies.registry import _ONLINE, register_online


@dataclass
class WithStageRule(OnlinePolicy):
    """``inner``'s allocation with ``rule`` on every node's stages."""

    inner: OnlinePolicy
    rule: Callable
    name: str = "policy"
    memory: bool = False           # the rule needs memory-aware nodes (SIRIUS)

    def __post_init__(self) -> None:
        self.capabilities = replace(self.inner.capabilities,
                                    memory_aware=self.inner.capabilities.memory_aware or self.memory)

    def allocate(self, task: OnlineTask, scheduler, now: float) -> Optional[int]:
        return self.inner.allocate(task, scheduler, now)

    def groups(self, nodes: int):
        return self.inner.groups(nodes)

    def estimator(self, profile):
        return self.inner.estimator(profile)

    def stage_rule(self, profile, params):
        return self.rule(profile, params)


_COMPOSED_FROM = (lemix, baselines)     # they register the allocations composed here


def _compose(allocation: str, rule: Callable, name: str, memory: bool):
    def factory(params, **kw):
        return WithStageRule(_ONLINE[allocation](params, **kw), rule, name=name, memory=memory)
    return factory


for _rule_name, _rule, _memory in (("harli", harli_rule, False), ("sirius", sirius_rule, True),
                                   ("mace", mace_rule, False)):
    register_online(_rule_name)(_compose("mix-rr", _rule, _rule_name, _memory))
    register_online(f"lemix+{_rule_name}")(_compose("lemix", _rule, f"lemix+{_rule_name}", _memory))

# The papers' baselines, where they are not an existing policy already (Harli's
# SeparateMode is ``separate``; MACE's continuous retraining, FIFO on each GPU, is
# ``mix-rr``):
# * SIRIUS's time sharing by preemption: inference first, without memory awareness;
register_online("sirius-timeshare")(_compose("mix-rr", sirius_rule, "sirius-timeshare", False))
# * Harli's StaticMode: a fixed half of each stage's time for fine-tuning;
register_online("harli-static")(_compose("mix-rr", static_share_rule, "harli-static", False))
# * SIRIUS's static partition: fixed halves of each device's time and memory;
register_online("sirius-static")(_compose("mix-rr", static_partition_rule, "sirius-static", True))
# * MACE's sync retraining (AdaInf): fine-tuning first;
register_online("mace-sync")(_compose("mix-rr", training_first_rule, "mace-sync", False))
# * MACE's periodic retraining (Ekya): fine-tuning waits for an epoch every 200 forward
#   latencies, which preempts inference until it is done.
register_online("mace-periodic")(_compose("mix-rr", periodic_rule, "mace-periodic", False))
