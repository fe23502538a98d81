"""One model replica as a Ray actor: an engine that steps continuously in its own thread.

The engine loop never waits for the controller: it steps whenever it has requests. The
controller talks to it with :meth:`EngineActor.run`, which hands over new requests and
returns as soon as some requests have finished (or after ``budget_s`` with whatever
progress there is), so an output reaches the next node one round trip after it is done.
:meth:`drain` stops a replica for a preemption: it returns the outputs not yet
collected and every unfinished request with the tokens it already generated, so the
next replica continues them (recompute of the prompt only, as vLLM does) and no finished
work is redone.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

import ray


@ray.remote(num_cpus=0, max_concurrency=2)
class EngineActor:
    def __init__(self, engine_config: dict, label: str):
        started = time.perf_counter()
        from raycolo.engines.base import create_engine

        config = dict(engine_config)
        kwargs = dict(config.get("engine_kwargs", {}))
        if kwargs.get("device") == "auto":
            import torch
            kwargs["device"] = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        config["engine_kwargs"] = kwargs
        self.engine = create_engine(config)
        self.label = label
        self.load_s = time.perf_counter() - started
        self._cond = threading.Condition()
        self._incoming: list[dict] = []
        self._finished: list = []
        self._active = False      # the loop holds requests (queued in the engine or incoming)
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._busy_s = 0.0
        self._tokens = 0
        self._steps = 0
        self._thread = threading.Thread(target=self._loop, name=f"engine-{label}", daemon=True)
        self._thread.start()

    # -- the engine loop ------------------------------------------------------------------
    def _loop(self) -> None:
        from raycolo.engines.base import SamplingParams

        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._incoming and not self.engine.has_unfinished():
                        self._active = False
                        self._cond.notify_all()
                        self._cond.wait()
                    if self._stopping:
                        self._active = False
                        self._cond.notify_all()
                        return
                    self._active = True
                    for r in self._incoming:
                        self.engine.add_request(r["key"], r["prompt"], SamplingParams(**r["params"]))
                    self._incoming = []
                started = time.perf_counter()
                finished = self.engine.step()
                seconds = time.perf_counter() - started
                records = self.engine.stats.iterations
                tokens = sum(r.new_tokens for r in records)
                records.clear()  # the controller keeps totals; this bounds the actor's memory
                with self._cond:
                    self._finished.extend(finished)
                    self._busy_s += seconds
                    self._tokens += tokens
                    self._steps += 1
                    if finished:
                        self._cond.notify_all()
        except BaseException as exc:  # surfaced to the controller by the next call
            with self._cond:
                self._error = exc
                self._active = False
                self._cond.notify_all()

    def _collect(self) -> dict:
        if self._error is not None:
            raise RuntimeError(f"engine {self.label} failed: {self._error!r}") from self._error
        out = {"outputs": self._finished, "busy_s": self._busy_s, "steps": self._steps,
               "tokens": self._tokens}
        self._finished = []
        self._busy_s, self._steps, self._tokens = 0.0, 0, 0
        return out

    # -- the controller's calls ---------------------------------------------------------
    def info(self) -> dict:
        context = ray.get_runtime_context()
        return {"label": self.label, "pid": os.getpid(), "node_id": context.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "load_s": self.load_s,
                "device": self.engine.config.engine_kwargs.device}

    def run(self, requests: list[dict], budget_s: float) -> dict:
        """Queue ``requests`` ({key, prompt, params}); return once some have finished, the
        replica is idle, or ``budget_s`` has passed."""
        deadline = time.perf_counter() + budget_s
        with self._cond:
            if requests:
                self._incoming.extend(requests)
                self._active = True
                self._cond.notify_all()
            while (not self._finished and self._error is None and not self._stopping
                   and (self._active or self._incoming)):
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._collect()

    def drain(self) -> dict:
        """Stop the engine; return uncollected outputs and every unfinished request with
        its prompt and generated token ids. Runs beside a pending :meth:`run` call (the
        actor takes two calls at once), which then returns at once with what it has."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            collected = self._collect()
            left = [{"key": r.request_id, "prompt_ids": list(r.prompt), "generated": list(r.generated),
                     "preemptions": r.preemptions} for r in self.engine.unfinished()]
            left += [{"key": r["key"], "prompt_ids": None, "generated": [], "preemptions": 0}
                     for r in self._incoming]
            self._incoming = []
            self._cond.notify_all()
        self.engine.release()
        return {**collected, "unfinished": left}
