"""The Python API of a live online deployment, and trace replay for ``raycolo online run``.

    from raycolo.actors.online.launch import OnlineDeployment
    dep = OnlineDeployment.start(config)          # on a running Ray cluster, or a local one
    rid = dep.submit(prompt_ids, max_tokens=32)
    for token in dep.stream(rid): ...
    dep.add_samples([(prompt_ids, completion_ids)])   # persisted before it returns
    dep.train()                                        # the next micro-batch becomes a task
    print(dep.stats())
    dep.stop()
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Iterator, Optional, Sequence

import numpy as np
import ray

from raycolo.actors.local_cluster import NAMESPACE, join_or_start
from raycolo.actors.online.controller import OnlineController
from raycolo.actors.online.launch_reports import DeploymentReports
from raycolo.rng import seeded_rng
from raycolo.online.config import OnlineConfig
from raycolo.online.serving.messages import EventKind
from raycolo.online.tasks import OnlineTask

# the longest OnlineDeployment.stop() waits for the controller to end its runs (each node's
# Ray Train run gets 60 s of it) before killing it
STOP_TIMEOUT_S = 180.0

BOS, FIRST_BYTE = 1, 3


def learnable_pair(rng: np.random.Generator, prompt_len: int, vocab: int) -> tuple[list[int], list[int]]:
    """A training sample a small model can learn: the completion repeats the prompt's
    first three content tokens twice (a copy task, so held-out loss can fall)."""
    body = [int(t) for t in rng.integers(FIRST_BYTE, min(vocab, FIRST_BYTE + 64), size=max(3, prompt_len - 1))]
    prompt = [BOS] + body
    return prompt, body[:3] * 2


def learnable_preference(rng: np.random.Generator, prompt_len: int, vocab: int) -> tuple[list[int], ...]:
    """A preference pair a small model can learn: :func:`learnable_pair`'s prompt, its copy
    completion as the chosen answer, and the copy with every token shifted by one (within
    the same 64 tokens) as the rejected answer."""
    prompt, chosen = learnable_pair(rng, prompt_len, vocab)
    span = min(vocab, FIRST_BYTE + 64) - FIRST_BYTE
    return prompt, chosen, [FIRST_BYTE + (t - FIRST_BYTE + 1) % span for t in chosen]


class OnlineDeployment(DeploymentReports):
    """A live deployment: requests, samples and training, its lifecycle and trace replay
    here; its read-only reports (stats, train_status, metrics, health, ...) and the retried
    controller call ``_call`` in :class:`~raycolo.actors.online.launch_reports.DeploymentReports`."""

    def __init__(self, controller, config: OnlineConfig, name: str, started_ray: bool):
        self.controller = controller
        self.config = config
        self.name = name
        self._started_ray = started_ray

    @classmethod
    def start(cls, config: OnlineConfig, address: Optional[str] = None, gpus: Optional[int] = None,
              timeout_s: float = 300.0) -> "OnlineDeployment":
        """Start on the Ray cluster at ``address`` (or the one this process is connected
        to); with neither, a local cluster with ``nodes x stages`` logical GPUs."""
        config.check_paths()
        started, _ = join_or_start(address, env=config.cluster_env(), num_gpus=gpus or config.gpus_needed(),
                                   num_cpus=config.local_cpus(), include_dashboard=False, log_to_driver=False)
        name = f"raycolo-online-{uuid.uuid4().hex[:8]}"
        controller = OnlineController.options(name=name, namespace=NAMESPACE, max_restarts=-1).remote(
            config.model_dump(), name, NAMESPACE)
        ray.get(controller.start.remote(timeout_s))
        return cls(controller, config, name, started)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_tokens: Optional[int] = None, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False) -> int:
        return self._call("submit", list(prompt), max_tokens, temperature, top_p, seed, ignore_eos)

    def stream(self, rid: int) -> Iterator[int]:
        for ref in self.controller.stream.options(num_returns="streaming").remote(rid):
            kind, value = ray.get(ref)
            if kind in (EventKind.TOKEN, EventKind.STOP_TOKEN):
                yield value
            elif kind == EventKind.ERROR:
                raise RuntimeError(value)

    def result(self, rid: int) -> dict:
        """The whole completion (waits for it). A request accepted before the controller
        restarted ends with finish_reason "error"; an unknown id raises ValueError."""
        return self._call("result", rid)

    def progress(self, rid: int) -> dict:
        """Tokens ``rid`` has streamed so far and its finish_reason (None while running)."""
        return self._call("progress", rid)

    def add_samples(self, samples: Sequence[Sequence[Sequence[int]]]) -> dict:
        """Store (fsynced) ``(prompt, completion)`` samples or ``(prompt, chosen, rejected)``
        preference pairs (token ids); returns their sequence numbers."""
        return self._call("add_samples", [tuple(list(part) for part in s) for s in samples])

    def train(self) -> Optional[int]:
        return self._call("submit_training")

    def held_out_loss(self, seed: int = 999, count: int = 16, node: int = 0) -> float:
        """Loss on ``count`` fresh samples of the training distribution (forward only)."""
        rng = seeded_rng(seed, "online-live", "held-out")
        vocab = _vocab(self.config)
        return self._call("held_out_loss",
                          [learnable_pair(rng, 12, vocab) for _ in range(count)], node)

    def held_out_preference(self, seed: int = 999, count: int = 16, node: Optional[int] = 0) -> dict:
        """Win rate and CLPD on ``count`` fresh preference pairs of the training
        distribution (:func:`learnable_preference`; forward only) on ``node`` (None: the
        node that trained last)."""
        rng = seeded_rng(seed, "online-live", "held-out-preference")
        vocab = _vocab(self.config)
        if node is None:
            node = self._call("last_node")
        return self._call("held_out_preference",
                          [learnable_preference(rng, 12, vocab) for _ in range(count)], node)

    def export_adapter(self, directory: str, node: Optional[int] = None) -> str:
        return self._call("export_adapter", directory, node)

    def use_policy(self, name: str) -> None:
        """Switch the online policy between runs (the stage workers stay)."""
        self._call("use_policy", name)

    def drain(self) -> None:
        self._call("drain")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict:
        """Stop the deployment: the controller ends its runs and closes its store, for at
        most ``timeout_s``; then it is killed either way (a controller that does not answer
        in time, or is dead, is reported in ``errors``)."""
        try:
            out = ray.get(self.controller.stop.remote(), timeout=timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            out = {"errors": [f"stop: the controller did not stop cleanly: {type(exc).__name__}: {exc}"]}
        ray.kill(self.controller)
        if self._started_ray:
            ray.shutdown()
        return out

    # -- trace replay ----------------------------------------------------------------------------
    def replay(self, tasks: list[OnlineTask], seed: int = 0, progress=None,
               preference_share: float = 0.0) -> dict:
        """Submit ``tasks`` at their arrival times (seconds from now): inference tasks as
        completions with prompts of the trace's lengths that generate exactly
        ``decode_tokens`` tokens (EOS ignored, as in the simulator); training tasks as
        ``micro_batch`` learnable samples, stored, then trained: with probability
        ``preference_share`` (seeded) preference pairs (:func:`learnable_preference`,
        trained with the DPO loss), else (prompt, completion) samples. Waits for all to
        finish and returns the run's OnlineResult."""
        if not 0.0 <= preference_share <= 1.0:
            raise ValueError(f"preference_share: must lie in [0, 1], got {preference_share}")
        return asyncio.run(self._replay(tasks, seed, progress, preference_share))

    async def _replay(self, tasks, seed, progress, preference_share=0.0):
        vocab = _vocab(self.config)
        rng = seeded_rng(seed, "online-live", "prompts")
        kinds = seeded_rng(seed, "online-live", "preference")
        await self.controller.mark_cpu.remote()       # the controller's CPU per task: this trace's
        started = time.perf_counter()
        pending = []
        ordered = sorted(tasks, key=lambda t: (t.arrival_s, t.task_id))
        for i, task in enumerate(ordered):
            delay = task.arrival_s - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            if task.is_train:
                make = learnable_preference if kinds.random() < preference_share else learnable_pair
                pairs = [make(rng, task.length, vocab) for _ in range(self.config.lora.micro_batch)]
                await self.controller.add_samples.remote(pairs)
                pending.append(self.controller.submit_training.remote())
            else:
                prompt = [BOS] + [int(t) for t in rng.integers(FIRST_BYTE, vocab, size=max(0, task.length - 1))]
                pending.append(self.controller.submit.remote(prompt, max(1, task.decode_tokens), 0.0, 1.0,
                                                             task.task_id, True))
            if progress and (i + 1) % 10 == 0:
                progress(f"submitted {i + 1}/{len(ordered)}")
        await asyncio.gather(*pending)
        await self.controller.drain.remote()
        return await self.controller.metrics.remote()


def _vocab(config: OnlineConfig) -> int:
    from raycolo.engine.models import load_tokenizer

    tok = load_tokenizer(config.model_loading_config.model_id)
    return getattr(tok, "vocab_size", 256 + FIRST_BYTE)
