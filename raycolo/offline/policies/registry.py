"""The offline policy registry: name -> policy. Policy modules register here; the package
loads them and looks names up."""
from __future__ import annotations

from typing import Callable

_REGISTRY: dict[str, Callable] = {}


def register(name: str):
    def wrap(fn: Callable) -> Callable:
        _REGISTRY[name] = fn
        return fn
    return wrap
