"""All of raycolo's Ray code: offline engine actors and controller (:mod:`.offline`), the
online controller and workers (:mod:`.online`), the Ray Serve front (:mod:`.serve`), and
the local cluster helpers shared by all three (:mod:`.local_cluster`)."""

# The old spellings of modules users import (docs before the offline/online/serve folders):
# ``from raycolo.actors import serve_launch`` keeps working.
_MOVED = {"serve_launch": "raycolo.actors.serve.launch", "online_launch": "raycolo.actors.online.launch"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'raycolo.actors' has no attribute {name!r}")
