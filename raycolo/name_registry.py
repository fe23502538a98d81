"""A registry of things by name, filled by a decorator: the offline planners and the online
allocators each keep one (:mod:`raycolo.offline.policies`, :mod:`raycolo.online.policies`)."""
from __future__ import annotations

from typing import Callable


class Registry(dict[str, Callable]):
    """name -> callable, in registration order."""

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def wrap(fn: Callable) -> Callable:
            self[name] = fn
            return fn
        return wrap
