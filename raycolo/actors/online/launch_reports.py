"""The read-only reports of a live online deployment: the part of
:class:`~raycolo.actors.online.launch.OnlineDeployment`'s Python API that asks the
controller how the deployment stands (stats, training, metrics, profile, sample ledger,
placement, registry, health), and the retried controller call every method of it uses."""
from __future__ import annotations

import time
from typing import Any

import ray

RESTART_WAIT_S = 300.0    # calls wait this long for a controller Ray is restarting
WAIT_SLICE_S = 1.0        # a call waits in slices this long, so signals (Ctrl-C) reach the caller


def wait_for(ref):
    """``ray.get(ref)``, waiting as long as it takes, in slices of ``WAIT_SLICE_S``: a
    ``ray.get`` with no timeout blocks in C, where Python's signal handlers never run."""
    while True:
        try:
            return ray.get(ref, timeout=WAIT_SLICE_S)
        except ray.exceptions.GetTimeoutError:
            continue


class DeploymentReports:
    """A base class of OnlineDeployment, which sets ``controller``."""

    controller: Any           # the OnlineController's actor handle

    def _call(self, method: str, *args):
        """Call the controller. While Ray restarts it after a crash, calls are refused
        (ActorUnavailableError, nothing ran) and sent again, for up to ``RESTART_WAIT_S``."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return wait_for(getattr(self.controller, method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stats(self) -> dict:
        return self._call("stats")

    def train_status(self) -> dict:
        """Samples received, trained and pending, the adapter version, and what the
        deployment resumed from an earlier one (``resumed``)."""
        return self._call("train_status")

    def metrics(self):
        """The run's OnlineResult (``.summary()``: simulate-online's keys)."""
        return self._call("metrics")

    def profile_json(self) -> str:
        return self._call("profile_json")

    def save_profile(self, path) -> None:
        from pathlib import Path
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self._call("profile_json"))

    def sample_ledger(self) -> dict:
        """Per stored sample, how often the adapters keep its training (see the controller)."""
        return self._call("sample_ledger")

    def placement(self) -> dict:
        """Which Ray node (id) runs the controller and each stage worker."""
        return self._call("placement")

    def registry(self) -> dict:
        return self._call("registry")

    def health(self) -> dict:
        """``status`` (ok, degraded, starting), ``nodes_alive``, ``nodes``, ``nodes_restarting``."""
        return self._call("health")
