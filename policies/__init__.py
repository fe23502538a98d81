"""Planning policies, registered by name.

Each module registers one policy: a function ``plan(problem, **options) -> AppPlan``.
Offline policies share the stage loop in :mod:`raycolo.planner.search`, so the same code
decides stages in the simulator, in replay and (via the controller) at run time.
"""
from __future__ import annotations

import importlib
from typing import Callable

from raycolo.errors import ConfigError

_REGISTRY: dict[str, Callable] = {}
_MODULES = ["samullm", "heuristics", "nopreempt", "rollout", "search", "optimal"]

# The policy ``raycolo plan``/``run`` use when none is named (declared here only).
DEFAULT_OFFLINE_POLICY = "samullm-search"


def register(name: str):
    def wrap(fn: Callable) -> Callable:
        _REGISTRY[name] = fn
        return fn
    return wrap


def _load_all() -> None:
    for module in _MODULES:
        importlib.import_module(f"raycolo.policies.{module}")


def get_policy(name: str) -> Callable:
    _load_all()
    if name not in _REGISTRY:
        raise ConfigError(f"--policy: unknown policy '{name}' (known: {', '.join(policy_names())})")
    return _REGISTRY[name]


def policy_names() -> list[str]:
    _load_all()
    return list(_REGISTRY)


# Online allocation policies (LeMix and its baselines) live in their own registry: they
# decide where each arriving task runs, not an offline plan.
_ONLINE: dict[str, Callable] = {}
_ONLINE_MODULES = ["lemix", "online_baselines", "online_colocation"]


def register_online(name: str):
    """Register a factory ``(params, separate_train_nodes) -> OnlinePolicy``."""
    def wrap(factory: Callable) -> Callable:
        _ONLINE[name] = factory
        return factory
    return wrap


def get_online_policy(name: str) -> Callable:
    for module in _ONLINE_MODULES:
        importlib.import_module(f"raycolo.policies.{module}")
    if name not in _ONLINE:
        raise ConfigError(f"--policy: unknown online policy '{name}' (known: {', '.join(online_policy_names())})")
    return _ONLINE[name]


def make_online_policy(name: str, params, nodes: int = 4, train_rate: float = 0.5):
    """The online policy registered as ``name``, built for ``nodes`` nodes and a
    training share ``train_rate`` (SEPARATE sizes its groups from them)."""
    return get_online_policy(name)(params, nodes=nodes, train_rate=train_rate)


def online_policy_names() -> list[str]:
    for module in _ONLINE_MODULES:
        importlib.import_module(f"raycolo.policies.{module}")
    return list(_ONLINE)


def optimal_applies(problem) -> bool:
    """Whether the exhaustive ``optimal`` policy accepts a problem of this size."""
    from raycolo.policies.optimal import optimal_applies as applies
    return applies(problem)
