"""Offline planning policies, registered by name.

Each module registers one policy: a function ``plan(problem, **options) -> AppPlan``.
Offline policies share the stage loop in :mod:`raycolo.offline.planner.search`, so the same code
decides stages in the simulator, in replay and (via the controller) at run time.
"""
from __future__ import annotations

from typing import Callable

from raycolo.errors import ConfigError
from raycolo.offline.policies.registry import _REGISTRY, register


# The policy ``raycolo plan``/``run`` use when none is named (declared here only).
DEFAULT_OFFLINE_POLICY = "samullm-search"


def _load_all() -> tuple:
    # every policy module registers itself on import (static imports: the import graph sees them)
    from raycolo.offline.policies import samullm, heuristics, nopreempt, rollout, samullm_search, optimal
    return samullm, heuristics, nopreempt, rollout, samullm_search, optimal     # in registration order


def get_policy(name: str) -> Callable:
    _load_all()
    if name not in _REGISTRY:
        raise ConfigError(f"--policy: unknown policy '{name}' (known: {', '.join(policy_names())})")
    return _REGISTRY[name]


def policy_names() -> list[str]:
    _load_all()
    return list(_REGISTRY)


def optimal_applies(problem) -> bool:
    """Whether the exhaustive ``optimal`` policy accepts a problem of this size."""
    from raycolo.offline.policies.optimal import optimal_applies as applies
    return applies(problem)


__all__ = ["DEFAULT_OFFLINE_POLICY", "get_policy", "optimal_applies", "policy_names", "register"]
