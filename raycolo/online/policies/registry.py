"""The online policy registry: name -> policy. Policy modules register here; the package
loads them and looks names up."""
from __future__ import annotations

from typing import Callable

_ONLINE: dict[str, Callable] = {}


def register_online(name: str):
    """Register a factory ``(params, separate_train_nodes) -> OnlinePolicy``."""
    def wrap(factory: Callable) -> Callable:
        _ONLINE[name] = factory
        return factory
    return wrap
