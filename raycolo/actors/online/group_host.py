"""The host of a deployment's worker groups: the actor that fits each node's ``TorchTrainer``.

A Ray actor dies with the process that created it (its owner). A node's Ray Train
controller is created by ``trainer.fit()``, and the stage workers by that controller, so
fitting the trainers in the deployment's controller tied every worker group to it: a
controller crash took every group down, and the restarted controller spent some 34 of
its 38 s making them again (processes, imports, the process group, the model).

The host fits them instead, each node in a thread of its own. With the node-loop data
plane (``stage.data_plane: node``) it is *detached* and named after the controller
(:func:`host_name`), so the groups outlive a controller crash: their stage workers wait
for the restarted controller, roll back to their newest committed checkpoint and
register with it (:mod:`raycolo.actors.online.stage_worker`), and the new controller finds
the host and starts no group. Being detached it does not go with its job either: it
watches the controller's name and ends itself (and with it the groups) once the
controller is gone for good (killed, or its owner gone), and the controller's ``stop``
ends it. With ``stage.data_plane: controller`` every op is a controller call, so the
host is an ordinary actor owned by the controller and goes with it, as before.

A node's run ending is told to the controller (``run_ended``): the deployment stopped,
the group failed past ``stage.max_failures``, or the run's own Ray Train controller died,
after which a new run of the same name restores the newest checkpoint (at most
``stage.max_failures`` times).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import ray

from raycolo.actors.online import library_imports
from raycolo.actors.online.placement_groups import PlacementGroups
from raycolo.actors.online.stage_trainer import quiet_helpers
from raycolo.online.config import OnlineConfig, stage_build

WATCH_EVERY_S = 1.0          # how often the host looks for its controller's name
GONE_AFTER = 3               # lookups in a row without it: the deployment is gone
# How often each node's Ray Train controller polls its stage workers: a worker that died,
# or whose train function returned (the deployment stops), is seen within this long.
# Ray's default is 2 s; a user's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S wins.
TRAIN_POLL_S = 0.5
TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"   # Ray Train passes it on to the controllers it starts


def host_name(controller: str) -> str:
    """The named (detached) host of the controller ``controller``'s worker groups."""
    return f"{controller}-groups"


@ray.remote(num_cpus=0, max_concurrency=64)
class GroupHost:
    """Fits the nodes' trainers (see the module docstring). ``run_names[n]`` is node n's
    Ray Train run; ``placement_file`` the controller's record of the groups' placement
    groups (:class:`~raycolo.actors.online.placement_groups.PlacementGroups`)."""

    def __init__(self, config: dict, controller: str, namespace: str, bounds, run_names: list[str],
                 placement_file: str, detached: bool):
        self.config = OnlineConfig.model_validate(config)
        self.controller, self.namespace, self.bounds = controller, namespace, bounds
        self.names = list(run_names)
        self.errors: list[str] = []
        self.groups = PlacementGroups(Path(placement_file), self.errors)
        self.threads: dict[int, threading.Thread] = {}
        self.train_runs = [0] * self.config.nodes
        os.environ.setdefault(TRAIN_POLL_ENV, str(TRAIN_POLL_S))     # this actor's own process
        quiet_helpers()
        if detached:
            threading.Thread(target=self._watch, daemon=True, name="controller-watch").start()

    def fit(self, node: int) -> bool:
        """Fit node ``node``'s trainer in a thread (unless one runs already); whether it
        started one."""
        thread = self.threads.get(node)
        if thread is not None and thread.is_alive():
            return False
        thread = self.threads[node] = threading.Thread(target=self._fit, args=(node,), daemon=True,
                                                       name=f"fit-node-{node}")
        thread.start()
        return True

    def fitting(self) -> list[int]:
        """The nodes whose runs are under way."""
        return sorted(n for n, t in self.threads.items() if t.is_alive())

    def run_names(self) -> list[str]:
        return list(self.names)

    def wait(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for every run to end (the deployment stops); the nodes
        still running."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self.threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.fitting()

    def _trainer(self, n: int):
        with library_imports.LIBRARY_IMPORTS:    # the nodes' fit threads: torch, first imported here
            from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
            from ray.train.torch import TorchConfig

            from raycolo.actors.online.group_watch import GroupWatch
            from raycolo.actors.online.stage_trainer import stage_trainer
            from raycolo.actors.online.stage_worker import stage_loop

        cfg = self.config
        storage = str(Path(cfg.storage_path).resolve())
        loop_config = {
            "node": n, "controller": self.controller, "namespace": self.namespace, **stage_build(cfg),
            "layer_bounds": self.bounds, "cpu_threads": cfg.stage.cpu_threads,
            "init_from": cfg.lora.init_from,      # every stage starts from its part (no checkpoint restored)
            "run_dir": str(Path(storage) / self.names[n]), "resume": cfg.resume,
            "data_plane": cfg.stage.data_plane, "report_every_s": cfg.stage.report_every_s,
            "switch_interval_s": cfg.stage.switch_interval_s,
        }
        return stage_trainer(
            train_loop_per_worker=stage_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=cfg.stages, use_gpu=True,
                                         resources_per_worker={"CPU": cfg.stage.cpus_per_worker,
                                                               "GPU": cfg.stage.gpus_per_worker}),
            torch_config=TorchConfig(backend=cfg.stage.backend),
            run_config=RunConfig(name=self.names[n], storage_path=storage,
                                 failure_config=FailureConfig(max_failures=cfg.stage.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                 callbacks=[GroupWatch(self.controller, self.namespace, n)]))

    def _fit(self, n: int) -> None:
        """Run node ``n``'s worker group until it ends (see the module docstring)."""
        from ray.exceptions import RayActorError

        trainer = self._trainer(n)
        while True:
            self.train_runs[n] += 1
            try:
                trainer.fit()
                return
            except Exception as exc:
                why = f"node {n}: {type(exc).__name__}: {exc}"
                lost_controller = isinstance(exc, RayActorError) or isinstance(exc.__cause__, RayActorError)
                again = (lost_controller and self.train_runs[n] <= self.config.stage.max_failures
                         and self.config.resume)
                self._tell("run_ended", n, why, again)
                if not again:
                    return
                self.groups.release([n])
                trainer = self._trainer(n)

    def _tell(self, method: str, *args) -> None:
        """Call the controller (fire and forget; a restarting one gets it once it is back)."""
        try:
            getattr(ray.get_actor(self.controller, namespace=self.namespace), method).remote(*args)
        except Exception as exc:      # gone for good: the watch ends the host
            self.errors.append(f"{method}{args}: the controller is gone ({type(exc).__name__})")

    def _watch(self) -> None:
        """End the host (and its runs) once the controller's name is gone: it was killed
        or its owner died, so nobody will stop these groups."""
        missing = 0
        while True:
            time.sleep(WATCH_EVERY_S)
            try:
                ray.get_actor(self.controller, namespace=self.namespace)
                missing = 0
            except ValueError:
                missing += 1
            except Exception:   # the GCS is unreachable for a moment: look again
                continue
            if missing >= GONE_AFTER:
                os._exit(0)
