"""Tell the deployment's controller as soon as Ray Train finds a node's worker group failed.

Ray Train's controller polls its workers; on a failure it tears the group down and starts
a new one, which registers with the deployment's controller only once every process has
imported torch and loaded its layers (10-30 s on a small machine). Until then the
controller would not know the node is gone and would keep placing work there. This
callback runs inside the node's Ray Train controller (``UserCallback.after_exception``,
called after a poll that found worker errors, before the restart) and tells the
deployment's controller at once, so the node is avoided while it restarts.
"""
from __future__ import annotations

import time

import ray
from ray.train import UserCallback


class GroupWatch(UserCallback):
    def __init__(self, controller: str, namespace: str, node: int):
        self.controller, self.namespace, self.node = controller, namespace, node

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        ranks = sorted(worker_exceptions)
        first = worker_exceptions[ranks[0]]
        why = f"node {self.node}: Ray Train found stage(s) {ranks} failed ({type(first).__name__})"
        try:
            handle = ray.get_actor(self.controller, namespace=self.namespace)
            handle.group_failed.remote(self.node, time.time(), why)   # fire and forget
        except Exception:       # the controller is gone or restarting: it resumes on its own
            pass
