"""The embedded engine: transformers models with iteration-level continuous batching.

Scheduling is :class:`raycolo.sim.scheduler.FcfsBlockScheduler`, the same code the
reference simulator runs: FCFS admission under a KV budget in blocks, prefill-first
iterations, preemption by recompute. Each request keeps its own KV tensors; a decode
iteration left-pads them into one batch (attention mask and explicit positions keep the
arithmetic identical to running the request alone) and appends each new key/value.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from raycolo.engines.base import (Engine, EngineConfig, EngineStats, IterationRecord, MemoryUsage,
                                  RequestOutput, SamplingParams, TrackedRequest)
from raycolo.engines.models import load_model
from raycolo.errors import ConfigError
from raycolo.sim.scheduler import FcfsBlockScheduler
from raycolo.sim.types import SchedulerLimits, ceil_div


@dataclass
class _Request(TrackedRequest):
    generator: Optional[torch.Generator] = None
    kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # per layer (1, heads, T, d)


class _DecodeBatch:
    """The running requests' KV, left-padded into one batch that persists across decode
    iterations: a steady batch costs one forward per iteration and no copies; rows are
    only dropped (finish, preemption) or merged in (after a prefill) when the set changes.
    """

    def __init__(self):
        self.rows: list[int] = []
        self.lengths: list[int] = []            # KV tokens each row holds
        self.kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # (n, heads, T, d)
        self.mask: Optional[torch.Tensor] = None  # (n, T), 0 on left padding
        self.cache = None  # the transformers cache holding ``kv``, reused while rows are stable

    def sync(self, handles: Sequence[int], requests: dict[int, "_Request"], device,
             admit: bool = True) -> None:
        wanted = set(handles)
        keep = [i for i, h in enumerate(self.rows) if h in wanted]
        if len(keep) < len(self.rows):
            self.cache = None
            if keep:
                index = torch.tensor(keep, device=device)
                self.kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]
                self.mask = self.mask.index_select(0, index)
                self.rows = [self.rows[i] for i in keep]
                self.lengths = [self.lengths[i] for i in keep]
                live = torch.nonzero(self.mask.any(dim=0))
                start = int(live[0]) if len(live) else self.mask.shape[1]
                if start:  # drop columns that are padding in every row
                    self.kv = [(k[:, :, start:], v[:, :, start:]) for k, v in self.kv]
                    self.mask = self.mask[:, start:]
            else:
                self.__init__()
        if not admit:
            return
        present = set(self.rows)
        new = [h for h in handles if h not in present]
        if not new:
            return
        parts = [requests[h].kv for h in new]
        widths = [p[0][0].shape[2] for p in parts]
        width = max(widths + ([self.mask.shape[1]] if self.rows else []))

        def left_pad(t: torch.Tensor, to: int) -> torch.Tensor:
            if t.shape[2] == to:
                return t
            pad = t.new_zeros((t.shape[0], t.shape[1], to - t.shape[2], t.shape[3]))
            return torch.cat([pad, t], dim=2)

        layers = []
        for layer in range(len(parts[0])):
            ks = [left_pad(p[layer][0], width) for p in parts]
            vs = [left_pad(p[layer][1], width) for p in parts]
            if self.rows:
                ks.insert(0, left_pad(self.kv[layer][0], width))
                vs.insert(0, left_pad(self.kv[layer][1], width))
            layers.append((torch.cat(ks), torch.cat(vs)))
        masks = [torch.cat([torch.zeros(width - w, dtype=torch.long, device=device),
                            torch.ones(w, dtype=torch.long, device=device)]).unsqueeze(0)
                 for w in widths]
        if self.rows:
            old = self.mask
            masks.insert(0, torch.cat([old.new_zeros((old.shape[0], width - old.shape[1])), old], dim=1))
        self.kv, self.mask, self.cache = layers, torch.cat(masks), None
        self.rows += new
        self.lengths += widths
        for h in new:
            requests[h].kv = None  # the batch owns it now


class TorchEngine(Engine):
    def __init__(self, config: EngineConfig):
        self.config = config
        kw = config.engine_kwargs
        if kw.tensor_parallel_size != 1:
            raise ConfigError("engine_kwargs.tensor_parallel_size: the torch engine runs tp=1; "
                              "use the vllm backend for tensor parallelism")
        if kw.cpu_threads:
            torch.set_num_threads(kw.cpu_threads)
        started = time.perf_counter()
        load = config.model_loading_config
        self.model, self.tokenizer = load_model(load.model_id, load.seed, load.dtype, kw.device)
        self.device = torch.device(kw.device)
        self.stats = EngineStats(load_seconds=time.perf_counter() - started)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_id = self.tokenizer.eos_token_id
        self.limits = SchedulerLimits(num_blocks=kw.kv_cache_tokens // kw.block_size,
                                      max_num_seqs=kw.max_num_seqs,
                                      max_num_batched_tokens=kw.max_num_batched_tokens,
                                      block_size=kw.block_size, watermark=kw.watermark)
        self.scheduler = FcfsBlockScheduler(self.limits)
        self.requests: dict[int, _Request] = {}
        self._batch = _DecodeBatch()
        self._next_handle = 0
        self._seed = load.seed

    # -- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: Optional[SamplingParams] = None) -> None:
        params = params or SamplingParams()
        ids = self._prompt_ids(request_id, prompt, params)
        need = ceil_div(len(ids) + params.max_tokens, self.limits.block_size)
        if need + self.limits.watermark_blocks > self.limits.num_blocks:
            raise ConfigError(f"request {request_id}: needs {need} KV blocks, the engine has "
                              f"{self.limits.num_blocks} (raise engine_kwargs.kv_cache_tokens)")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed if params.seed is not None
                                  else self._seed * 1_000_003 + self._next_handle)
        handle = self._next_handle
        self._next_handle += 1
        self.requests[handle] = _Request(request_id, ids, params, time.perf_counter(),
                                         generator=generator)
        self.scheduler.add(handle, len(ids))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one iteration ------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        decision = self.scheduler.schedule()
        if decision.kind == "idle":
            if self.requests:  # add_request's checks make this unreachable; never spin
                raise RuntimeError(f"scheduler idle with {len(self.requests)} requests queued "
                                   f"({self.scheduler.blocks_used}/{self.limits.num_blocks} KV blocks used)")
            return []
        started = time.perf_counter()
        for handle in decision.preempted:
            self.requests[handle].preemptions += 1  # its KV row leaves the batch at the next sync
        if decision.kind == "prefill":
            contexts = [len(self.requests[h].prompt) + len(self.requests[h].generated)
                        for h in decision.seqs]
            tokens = self._prefill([self.requests[h] for h in decision.seqs])
        else:
            contexts = [self.scheduler.stored[h] + 1 for h in decision.seqs]
            tokens = self._decode(decision.seqs) if decision.seqs else []
        now = time.perf_counter()
        finished = []
        if decision.kind == "decode":
            self.scheduler.decoded(decision.seqs)
        for handle, token in zip(decision.seqs, tokens):
            req = self.requests[handle]
            req.generated.append(token)
            if math.isnan(req.first_token_s):
                req.first_token_s = now
            reason = self._finish_reason(req, token)
            if reason:
                self.scheduler.finished(handle)
                finished.append(self._output(self.requests.pop(handle), reason, now))
            elif decision.kind == "prefill":
                self.scheduler.prefilled(handle)
        self._batch.sync(self.scheduler.running, self.requests, self.device, admit=False)
        self.stats.iterations.append(IterationRecord(
            kind=decision.kind, num_seqs=len(decision.seqs), new_tokens=len(tokens),
            context_lens=contexts, seconds=now - started, preempted=len(decision.preempted)))
        return finished

    def _finish_reason(self, req: _Request, token: int) -> Optional[str]:
        if token == self.eos_id and not req.params.ignore_eos:
            return "stop"
        if len(req.generated) >= req.params.max_tokens:
            return "length"
        return None

    def _output(self, req: _Request, reason: str, now: float) -> RequestOutput:
        return req.output(reason, self.tokenizer.decode(req.generated), now)

    def _prefill(self, reqs: list[_Request]) -> list[int]:
        """Compute prompts (plus tokens generated before a preemption) from scratch, in one
        left-padded forward; each request keeps its own unpadded KV until it joins the batch."""
        from transformers import DynamicCache

        seqs = [r.prompt + r.generated for r in reqs]
        width = max(len(q) for q in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, q in enumerate(seqs):
            ids[i, width - len(q):] = torch.tensor(q, device=self.device)
            mask[i, width - len(q):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        for i, (req, q) in enumerate(zip(reqs, seqs)):
            req.kv = [(k[i:i + 1, :, width - len(q):], v[i:i + 1, :, width - len(q):]) for k, v in layers]
        return self._sample(out.logits[:, -1, :], reqs)

    def _decode(self, handles: list[int]) -> list[int]:
        """One decode iteration of ``handles``; returns their new tokens in that order."""
        from transformers import DynamicCache

        batch = self._batch
        batch.sync(handles, self.requests, self.device)
        reqs = [self.requests[h] for h in batch.rows]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(reqs), 1))], dim=1)
        positions = torch.tensor([[n] for n in batch.lengths], device=self.device)
        last = torch.tensor([[r.generated[-1]] for r in reqs], device=self.device)
        # Reuse the cache object of the previous step: rebuilding it copies every layer.
        cache = batch.cache if batch.cache is not None else DynamicCache(batch.kv)
        out = self.model(input_ids=last, attention_mask=batch.mask, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        batch.cache = out.past_key_values
        batch.kv = [(layer.keys, layer.values) for layer in batch.cache.layers]
        batch.lengths = [n + 1 for n in batch.lengths]
        tokens = dict(zip(batch.rows, self._sample(out.logits[:, -1, :], reqs)))
        return [tokens[h] for h in handles]

    def _sample(self, logits: torch.Tensor, reqs: list[_Request]) -> list[int]:
        out = torch.argmax(logits, dim=-1).tolist()  # greedy for all, in one op
        for i, req in enumerate(reqs):
            p = req.params
            if p.temperature == 0:
                continue
            probs = torch.softmax(logits[i].float() / p.temperature, dim=-1).cpu()
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                keep = torch.cumsum(sorted_probs, 0) - sorted_probs < p.top_p
                filtered = torch.zeros_like(probs)
                filtered[order[keep]] = sorted_probs[keep]
                probs = filtered / filtered.sum()
            out[i] = int(torch.multinomial(probs, 1, generator=req.generator))
        return out

    # -- resources -----------------------------------------------------------------
    def memory(self) -> MemoryUsage:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        pending = [pair for r in self.requests.values() if r.kv for pair in r.kv]
        kv = sum(t.numel() * t.element_size() for pair in pending for t in pair)
        if self._batch.kv:  # tokens held, not the left padding around them
            per_token = sum(k.shape[1] * k.shape[3] * k.element_size() * 2 for k, _ in self._batch.kv)
            kv += per_token * sum(self._batch.lengths)
        return MemoryUsage(self.scheduler.blocks_used, self.limits.num_blocks, weights, kv)

    def release(self) -> None:
        self.requests.clear()
        self._batch = _DecodeBatch()
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
