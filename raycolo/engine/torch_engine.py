"""The embedded engine: transformers models on raycolo's model executor.

Scheduling is :class:`raycolo.batching.step_scheduler.FcfsBlockScheduler`, the same code the
reference simulator runs: FCFS admission under a KV budget in blocks, prefill-first
iterations, preemption by recompute. Its block tables are the pages of the executor's
preallocated KV cache (:mod:`raycolo.engine.executor`), so the blocks the cost model counts are
the blocks the engine fills. A prefill runs all admitted prompts in one packed forward;
a decode iteration runs every running request in one forward, attention reading each
request's keys/values through its block table.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from raycolo.engine.base import (Engine, EngineConfig, EngineStats, IterationRecord, MemoryUsage,
                                  RequestOutput, SamplingParams, TrackedRequest)
from raycolo.engine.models import load_model
from raycolo.engine.threads import apply_thread_policy
from raycolo.errors import ConfigError
from raycolo.engine.executor import SeqChunk, create_executor
from raycolo.engine.executor.graphs import graph_attempts
from raycolo.engine.executor.shard_load import load_rank_model
from raycolo.engine.executor.tensor_parallel import TensorParallel
from raycolo.generation import FinishReason, StopChecker
from raycolo.generation.penalty_history import PenaltyHistory
from raycolo.generation.sampler import SamplingRow, plain, position_seed, sample, sample_plain
from raycolo.generation.prompt_scores import split_scored
from raycolo.generation.rows import PromptArray, PromptScore
from raycolo.batching.step_scheduler import FcfsBlockScheduler, StepKind
from raycolo.batching.limits import SchedulerLimits, ceil_div
from raycolo.kv_bytes import AttentionShape


@dataclass
class _Request(TrackedRequest, PromptArray):
    seed: int = 0
    checker: Optional[StopChecker] = None     # raycolo.generation's stop rules; owns ``generated``
    plain: bool = True                        # greedy on raw logits (raycolo.generation.sampler.plain)


class TorchEngine(Engine):
    def __init__(self, config: EngineConfig, loaded: Optional[tuple] = None, ranks=None):
        """``loaded``: a (model, tokenizer) pair already on ``engine_kwargs.device`` to run
        instead of loading ``model_id`` (bench/gpu_realsize.py's random real-size models).
        ``ranks``: with ``tensor_parallel_size`` > 1, ``ranks(world, device)`` starts the
        other ranks and returns their :class:`~raycolo.engine.executor.tp_ranks.Ranks`
        (default: processes of this machine; under Ray, actors in the replica's bundles)."""
        self.config = config
        kw = config.engine_kwargs
        self.threads = apply_thread_policy(kw.cpu_threads)
        started = time.perf_counter()
        load = config.model_loading_config
        # tensor-parallel: rank 0's shard in host memory (read alone from a safetensors
        # checkpoint), and only the shard goes to the device (ModelExecutor's device); a model
        # that needs tp to fit never lands whole on one GPU
        self.model, self.tokenizer = loaded or (
            load_rank_model(load.model_id, load.seed, load.dtype, TensorParallel(0, kw.tensor_parallel_size))
            if kw.tensor_parallel_size > 1 else load_model(load.model_id, load.seed, load.dtype, kw.device))
        self.device = torch.device(kw.device)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_ids = self.tokenizer.eos_token_ids     # the checkpoint's EOS set
        self.rules = None       # structured outputs, bad words: raycolo.generation.vocab_rules, at the first need
        self.penalties = PenaltyHistory()     # penalized requests' prompts and outputs, on the device
        self.limits = SchedulerLimits(num_blocks=self._cache_blocks(kw),
                                      max_num_seqs=kw.max_num_seqs,
                                      max_num_batched_tokens=kw.max_num_batched_tokens,
                                      block_size=kw.block_size, watermark=kw.watermark)
        self.ranks = None
        if kw.tensor_parallel_size > 1:
            self.executor = self._tensor_parallel(kw, load, loaded, ranks)
        else:
            self._check_device_memory(self.limits.num_blocks * kw.block_size)
            self.executor = create_executor(self.model, self.limits.num_blocks, kw.block_size,
                                            cuda_graphs=kw.cuda_graphs, fuse_projections=kw.fuse_projections)
        self.stats = EngineStats(load_seconds=time.perf_counter() - started)
        self.scheduler = FcfsBlockScheduler(self.limits)
        self.requests: dict[int, _Request] = {}
        self._next_handle = 0
        self._seed = load.seed

    def _tensor_parallel(self, kw, load, loaded, ranks):
        """Ranks 1..tp-1 as processes of this machine (raycolo/engine/executor/tp_ranks.py),
        each with its slice of the model and of every layer's KV heads; this process is rank
        0 and samples. Refused for a model without the fast path."""
        from raycolo.engine.executor import fast_path_family
        from raycolo.engine.executor.model import FAST_PATH_NAMES
        from raycolo.engine.executor.tensor_parallel import check_tp
        from raycolo.engine.executor.tp_ranks import LocalRanks, RankSpec

        tp = kw.tensor_parallel_size
        if fast_path_family(self.model) is None:
            raise ConfigError(f"engine_kwargs.tensor_parallel_size: {type(self.model).__name__} has no fast "
                              f"path ({FAST_PATH_NAMES}); tensor parallelism needs one")
        check_tp(self.model.config, tp, "engine_kwargs.tensor_parallel_size")
        if loaded is not None:
            raise ConfigError("engine_kwargs.tensor_parallel_size: the other ranks load model_id themselves; "
                              "an in-memory model runs tp=1")
        self.ranks = (ranks or LocalRanks)(tp, kw.device)
        spec = RankSpec(load.model_id, load.seed, load.dtype, kw.device, self.limits.num_blocks, kw.block_size,
                        kw.cuda_graphs, kw.fuse_projections)
        return self.ranks.load(spec, self.model)

    def _cache_blocks(self, kw) -> int:
        """KV blocks to preallocate: ``kv_cache_tokens``, capped at what ``max_num_seqs``
        sequences of the model's full context can ever hold (plus the watermark). The cap
        never changes a scheduling decision; it keeps a planner's budget for a large
        logical GPU from reserving memory no request can use."""
        per_seq = ceil_div(self.max_positions, kw.block_size)
        most = math.ceil(kw.max_num_seqs * per_seq / (1 - kw.watermark)) + 1
        return min(kw.kv_cache_tokens // kw.block_size, most)

    def _check_device_memory(self, tokens: int) -> None:
        """On a GPU: a KV cache the device cannot hold beside the weights is refused in one
        line naming the field, before the allocator fails (a budget planned for a larger
        card, e.g. the offline runtime's default ``--gpu-memory`` of 80 GiB on a 24 GB one)."""
        if self.device.type != "cuda":
            return
        need = tokens * AttentionShape.of(self.model.config).kv_bytes_per_token(
            next(self.model.parameters()).element_size())
        free, total = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # torch's spare
        if need > free:
            raise ConfigError(f"engine_kwargs.kv_cache_tokens: {tokens} tokens of KV cache need "
                              f"{need / 2**30:.1f} GiB; {self.device} has {free / 2**30:.1f} GiB free of "
                              f"{total / 2**30:.1f} GiB beside the weights (offline runs: give --gpu-memory "
                              "of this card)")

    # -- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: Optional[SamplingParams] = None) -> None:
        params = params or SamplingParams()
        ids = self._prompt_ids(request_id, prompt, params)
        need = ceil_div(len(ids) + params.max_tokens, self.limits.block_size)
        if need + self.limits.watermark_blocks > self.limits.num_blocks:
            raise ConfigError(f"request {request_id}: needs {need} KV blocks, the engine has "
                              f"{self.limits.num_blocks} (raise engine_kwargs.kv_cache_tokens)")
        seed = params.seed if params.seed is not None else position_seed(self._seed, self._next_handle)
        handle = self._next_handle
        self._next_handle += 1
        checker = StopChecker(params, self.eos_ids, self.tokenizer, ids)
        if params.needs_vocabulary and self.rules is None:
            from raycolo.generation.vocab_rules import VocabRules
            self.rules = VocabRules(self.tokenizer, int(self.model.config.vocab_size))
        self.requests[handle] = _Request(request_id, ids, params, time.perf_counter(), seed=seed,
                                         generated=checker.output, checker=checker, plain=plain(params),
                                         logprobs=[] if params.logprobs is not None else None)
        self.scheduler.add(handle, len(ids))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one iteration ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        started = time.perf_counter()  # an iteration's time includes its scheduling
        attempts = graph_attempts(self.executor)
        decision = sched.schedule()
        if decision.kind == StepKind.IDLE:
            if self.requests:  # add_request's checks make this unreachable; never spin
                raise RuntimeError(f"scheduler idle with {len(self.requests)} requests queued "
                                   f"({sched.blocks_used}/{self.limits.num_blocks} KV blocks used)")
            return []
        for handle in decision.preempted:
            self.requests[handle].preemptions += 1
            self._forget(handle)
        if decision.kind == StepKind.PREFILL:  # from scratch: prompt plus tokens before a preemption
            chunks = [SeqChunk(r.prompt + r.generated, 0, sched.table(h), every_logit=self._scores(r))
                      for h, r in ((h, self.requests[h]) for h in decision.seqs)]
        else:
            chunks = [SeqChunk(self.requests[h].generated[-1:], sched.stored[h], sched.table(h))
                      for h in decision.seqs]
        contexts = [c.start + len(c.tokens) for c in chunks]
        plain_step = all(self.requests[h].plain for h in decision.seqs)
        sampled = self._run(decision.seqs, chunks, plain_step) if chunks else None
        tokens = sampled.tokens if sampled else []
        now = time.perf_counter()
        finished = []
        if decision.kind == StepKind.DECODE:
            sched.decoded(decision.seqs)
        for i, (handle, token) in enumerate(zip(decision.seqs, tokens)):
            req = self.requests[handle]      # req.generated is req.checker.output: append() adds the token
            if req.logprobs is not None:
                req.logprobs.append(sampled.logprobs[i])
            if math.isnan(req.first_token_s):
                req.first_token_s = now
            reason = req.checker.append(token)
            if reason:
                sched.finished(handle)
                self._forget(handle)
                self.penalties.forget(handle)
                finished.append(self._output(self.requests.pop(handle), reason, now))
            elif decision.kind == StepKind.PREFILL:
                sched.prefilled(handle)
        self.stats.iterations.append(IterationRecord(
            kind=decision.kind, num_seqs=len(decision.seqs), new_tokens=len(tokens),
            context_lens=contexts, seconds=time.perf_counter() - started,
            preempted=len(decision.preempted), plain_sampling=plain_step,
            graph_capture=graph_attempts(self.executor) != attempts))
        return finished

    @staticmethod
    def _scores(req: _Request) -> bool:
        """Whether this prefill scores the request's prompt (asked for, not yet done)."""
        return req.params.prompt_logprobs is not None and req.prompt_logprobs is None

    def _run(self, handles: list[int], chunks: list[SeqChunk], plain_step: bool):
        ex = self.executor
        if ex.paged:
            logits = ex.execute(ex.batch(chunks))
        else:
            logits = ex.execute(ex.batch(chunks), handles=handles)
        scored = {h: PromptScore(self.requests[h].prompt, self.requests[h].params.prompt_logprobs)
                  for h, c in zip(handles, chunks) if c.every_logit}
        if scored:        # a preempted request keeps what its first prefill scored
            logits, prompts = split_scored(logits, handles, [c.length for c in chunks], scored)
            for h, prompt in zip(handles, prompts):
                if prompt is not None:
                    self.requests[h].prompt_logprobs = prompt
        if plain_step:
            return sample_plain(logits)
        reqs = [self.requests[h] for h in handles]
        return sample(logits, [SamplingRow.of(r.params, r.seed, r.generated, r.prompt_array, r.checker.stop_ids, h)
                               for h, r in zip(handles, reqs)], self.rules, self.penalties)

    def _forget(self, handle: int) -> None:
        if not self.executor.paged:
            self.executor.free(handle)

    def _output(self, req: _Request, reason: FinishReason, now: float) -> RequestOutput:
        return req.output(reason, req.checker.text(self.tokenizer), now)

    # -- resources -----------------------------------------------------------------
    def memory(self) -> MemoryUsage:
        """KV bytes count the tokens held (the cache itself is preallocated:
        ``executor.cache.nbytes``)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        per_token = AttentionShape.of(self.model.config).kv_bytes_per_token(
            next(self.model.parameters()).element_size())
        kv = per_token * sum(self.scheduler.stored.values())
        return MemoryUsage(self.scheduler.blocks_used, self.limits.num_blocks, weights, kv)

    def take(self, n: int) -> list[TrackedRequest]:
        sched = self.scheduler
        order = sorted(self.requests, key=lambda h: (not sched.is_waiting(h), len(self.requests[h].generated), -h))
        taken = order[:max(0, n)]
        for handle in taken:
            sched.remove(handle)
            self._forget(handle)
            self.penalties.forget(handle)
        return [self.requests.pop(h) for h in taken]

    def reset(self) -> bool:
        for handle in list(self.requests):
            self._forget(handle)
        self.requests.clear()
        self.penalties = PenaltyHistory()
        self.scheduler = FcfsBlockScheduler(self.limits)
        self.stats.iterations.clear()
        return True

    def sleep(self) -> bool:
        """Requests dropped, the KV cache freed and, on an accelerator, the weights moved
        to host memory (what vLLM's sleep level 1 does). :meth:`wake_up` then costs a copy
        back and a fresh cache, not a model build and weight packing."""
        self.reset()
        self.executor.sleep()
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        return True

    def wake_up(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.executor.wake_up()

    def release(self) -> None:
        self.requests.clear()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        del self.executor
        del self.model
        gc.collect()       # an executor and its decode graphs refer to each other: a cycle
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
