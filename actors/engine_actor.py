"""One model replica as a Ray actor: an engine that runs continuous batching in slices.

The controller drives each replica with :meth:`EngineActor.run`: it hands over new
requests and gets back what finished while the engine stepped for up to ``budget_s``.
Between calls the engine holds its queue, so a replica is never busier or idler than
its requests make it. :meth:`drain` stops a replica for a preemption and returns every
unfinished request with the tokens it generated, so the next replica continues them
(recompute of the prompt only, as vLLM does) and no finished work is redone.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import ray


@ray.remote(num_cpus=0)
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

    def info(self) -> dict:
        context = ray.get_runtime_context()
        return {"label": self.label, "pid": os.getpid(), "node_id": context.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "load_s": self.load_s,
                "device": self.engine.config.engine_kwargs.device}

    def run(self, requests: list[dict], budget_s: float) -> dict:
        """Queue ``requests`` ({key, prompt, params}) and step for up to ``budget_s``."""
        from raycolo.engines.base import SamplingParams

        for r in requests:
            self.engine.add_request(r["key"], r["prompt"], SamplingParams(**r["params"]))
        started = time.perf_counter()
        records = self.engine.stats.iterations
        records.clear()  # the controller keeps the totals; this bounds the actor's memory
        finished, steps = [], 0
        while self.engine.has_unfinished() and time.perf_counter() - started < budget_s:
            finished.extend(self.engine.step())
            steps += 1
        tokens = sum(r.new_tokens for r in records)
        return {"outputs": finished, "busy_s": time.perf_counter() - started if steps else 0.0,
                "steps": steps, "tokens": tokens}

    def drain(self) -> list[dict]:
        """Stop: every unfinished request with its prompt and generated token ids."""
        left = [{"key": r.request_id, "prompt_ids": list(r.prompt), "generated": list(r.generated),
                 "preemptions": r.preemptions} for r in self.engine.unfinished()]
        self.engine.release()
        return left

    def memory(self) -> Optional[dict]:
        m = self.engine.memory()
        return {"kv_blocks_used": m.kv_blocks_used, "kv_blocks_total": m.kv_blocks_total,
                "weight_bytes": m.weight_bytes, "kv_bytes": m.kv_bytes}
