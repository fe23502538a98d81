"""Online allocation policies (LeMix and its baselines), registered by name.

They decide where each arriving task runs. Each module registers a factory
``(params, nodes, train_rate) -> OnlinePolicy`` (:mod:`raycolo.online.scheduling.scheduler`).
"""
from __future__ import annotations

from typing import Callable

from raycolo.errors import ConfigError
from raycolo.online.policies.registry import _ONLINE, register_online


def _load_all() -> tuple:
    # every policy module registers itself on import (static imports: the import graph sees them)
    from raycolo.online.policies import lemix, baselines, colocation
    return lemix, baselines, colocation         # in registration order


def get_online_policy(name: str) -> Callable:
    _load_all()
    if name not in _ONLINE:
        raise ConfigError(f"--policy: unknown online policy '{name}' (known: {', '.join(online_policy_names())})")
    return _ONLINE[name]


def make_online_policy(name: str, params, nodes: int = 4, train_rate: float = 0.5):
    """The online policy registered as ``name``, built for ``nodes`` nodes and a
    training share ``train_rate`` (SEPARATE sizes its groups from them)."""
    return get_online_policy(name)(params, nodes=nodes, train_rate=train_rate)


def online_policy_names() -> list[str]:
    _load_all()
    return list(_ONLINE)


__all__ = ["get_online_policy", "make_online_policy", "online_policy_names", "register_online"]
