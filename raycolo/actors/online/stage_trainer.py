"""The Ray Train trainer of a node's stage workers: a ``TorchTrainer`` without the helper
actors a stage group never uses.

Ray Train 2 starts helper actors around every worker group, each a Python process of its
own (about 430 MB and 2-10 s of CPU while it imports Ray's libraries). Two of them serve
nothing a stage group does:

- a ``DatasetManager``, which Ray Train creates for every run, with or without Ray
  Datasets (``DatasetsCallback.before_init_train_context``). Stage workers take no Ray
  Dataset: their samples come from the deployment's sample store.
- a ``PreemptionWatcher``, which polls the nodes' drain state and tells the workers a node
  is about to be preempted (``ray.train.get_context()``'s preemption info). Stage workers
  never read it: a node that goes away is a worker-group failure, which Ray Train restarts
  and the deployment resumes from the node's newest committed checkpoint
  (docs/online-live.md).

On the 2-core test VM each of their processes took 9-11 s to start during a deployment
start whose CPUs were already saturated (Ray's task events, 2026-11-30; docs/benchmarks.md,
"Test suite", which also says the start's time did not measurably drop). A user who wants
the watcher back sets ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1`` in the cluster's
environment: the user's setting wins.
"""
from __future__ import annotations

import os

PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train passes it on to its controllers
PREEMPTION_WATCHER_DEFAULT = "0"       # the stage groups' default (Ray's: on)


def quiet_helpers() -> None:
    """This process's Ray Train controllers start no preemption watcher (unless the user's
    environment says otherwise): call it in the process that fits the trainers."""
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, PREEMPTION_WATCHER_DEFAULT)


def stage_trainer(**kwargs):
    """A ``TorchTrainer(**kwargs)`` whose runs start no ``DatasetManager`` when they are
    given no datasets (see the module docstring)."""
    from ray.train.torch import TorchTrainer

    class StageTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            from ray.train.v2._internal.callbacks import DatasetsCallback

            return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]

    return StageTrainer(**kwargs)
