"""Why an offline run stops: the errors the controller and its parts raise, and the one
line of a Ray error that says why (:func:`cause`)."""
from __future__ import annotations


class RunFailed(RuntimeError):
    """The run cannot go on; what is in the journal stays, and a rerun resumes from it."""


class ReplicaFailed(RunFailed):
    """A replica could not start, or died more often than ``max_restarts`` allows."""


class CapacityLost(RunFailed):
    """The cluster has had fewer GPUs than this run saw for ``node_loss_s``: what is left
    must be planned again on ``gpus_left`` GPUs (``lost_nodes``: the Ray nodes that died)."""

    def __init__(self, message: str, gpus_left: int, gpus_before: int, lost_nodes: list[dict]):
        super().__init__(message)
        self.gpus_left, self.gpus_before, self.lost_nodes = gpus_left, gpus_before, lost_nodes


def cause(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    for line in reversed(text):
        line = line.strip()
        if line and not line.startswith(("File ", "Traceback", "^")):
            return line[:300]
    return type(exc).__name__
