"""One lock for a process's first imports of the ML libraries from threads.

Two threads importing torch, transformers, peft or accelerate for the first time at once
can meet inside a circular import, and Python's import deadlock avoidance then hands one
of them a partly built module: "cannot import name 'AcceleratorState' from partially
initialized module 'accelerate.state'" (the controller's warm-up thread importing peft
while a loaded adapter's check built the model's transformers config; fresh-clone suite,
2026-11-30). Every thread that may import them first holds :data:`LIBRARY_IMPORTS`.
"""
from __future__ import annotations

import threading

LIBRARY_IMPORTS = threading.Lock()


def importing(fn, *args):
    """``fn(*args)`` holding :data:`LIBRARY_IMPORTS` (call it in a thread)."""
    with LIBRARY_IMPORTS:
        return fn(*args)
