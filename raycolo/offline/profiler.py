"""``raycolo profile``: measure a model on an engine and write the cost model's files.

1. Load time: median of timed engine loads from a checkpoint directory.
2. Sweep: batches of 1..64 requests at several context lengths, plus a mixed run of
   random lengths, recording every iteration (kind, sequences, tokens, seconds).
3. Output lengths: run a request set with sampling and write the measured eCDF.
4. Fit SamuLLM's per-iteration coefficients (:mod:`raycolo.offline.costmodel.fit`) to the
   iterations of steps 2 and 3.

Files (docs/profiles.md): ``DIR/<model>.tp<T>.json`` (LatencyProfile, what
``raycolo plan --profile DIR`` reads), ``DIR/ecdf/<model>.csv`` and
``DIR/<model>.tp<T>.fit.json`` (fit statistics and the sweep's settings).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from raycolo.batching.step_scheduler import StepKind
from raycolo.catalog import get_model
from raycolo.offline.costmodel.fit import fit_profile, samples_from_records
from raycolo.offline.costmodel.latency import IterationLatency, LatencyProfile
from raycolo.offline.costmodel.length_sampler import GREEDY_ECDF_SUFFIX, write_ecdf
from raycolo.rng import random_prompts, seeded_rng
from raycolo.engine.base import EngineConfig, SamplingParams
from raycolo.engine.factory import create_engine
from raycolo.engine.models import save_tiny_checkpoint
from raycolo.generation.params import ECDF_TEMPERATURE  # the planner's eCDFs are measured at it

ECDF_MAX_TOKENS = 256


@dataclass
class SweepSettings:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context_lens: tuple[int, ...] = (16, 128, 384)
    decode_steps: int = 12
    mixed_requests: int = 64
    ecdf_requests: int = 200
    load_repeats: int = 3

    @classmethod
    def quick(cls) -> "SweepSettings":
        return cls(batch_sizes=(1, 4, 16), context_lens=(16, 128), decode_steps=6,
                   mixed_requests=16, ecdf_requests=40, load_repeats=1)


def engine_config(model_id: str, device: str = "cpu", threads: Optional[int] = 1, seed: int = 0,
                  max_num_seqs: int = 64, kv_cache_tokens: int = 1 << 17, tp: int = 1) -> EngineConfig:
    return EngineConfig.model_validate({
        "backend": "torch",
        "model_loading_config": {"model_id": model_id, "seed": seed},
        "engine_kwargs": {"max_num_seqs": max_num_seqs, "kv_cache_tokens": kv_cache_tokens,
                          "device": device, "cpu_threads": threads, "tensor_parallel_size": tp}})


def _measure_load(model_id: str, device: str, threads: Optional[int], seed: int, repeats: int,
                  tp: int = 1) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        source = model_id
        if not Path(model_id).is_dir():
            source = str(save_tiny_checkpoint(model_id, Path(tmp) / "ckpt", seed))
        create_engine(engine_config(source, device, threads, seed, tp=tp)).release()  # warm imports
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            create_engine(engine_config(source, device, threads, seed, tp=tp)).release()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


# (model id, seed, device, largest batch) -> solo and co-located DecodeSamples
ColocatedProbe = Callable[[str, int, str, int], list]


def profile_model(model_id: str, out_dir: str | Path, tp: int = 1, device: str = "cpu",
                  threads: Optional[int] = 1, seed: int = 0, settings: Optional[SweepSettings] = None,
                  progress: Optional[Callable[[str], None]] = None,
                  colocated: Optional[ColocatedProbe] = None) -> tuple[LatencyProfile, dict]:
    """Profile ``model_id``: the cost model's coefficients and eCDFs, and Harli's decode
    predictor (stage 1 from the engine's decode iterations; stage 2 from ``colocated``'s
    samples when given, :func:`raycolo.online.stages.colocated_profile.measure_colocated`
    as ``raycolo profile`` passes it, else b1 = k1 = 1: no interference)."""
    settings = settings or SweepSettings()
    say = progress or (lambda msg: None)
    spec = get_model(model_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"{model_id}: timing loads")
    load_s = _measure_load(model_id, device, threads, seed, settings.load_repeats, tp)

    # tp > 1: a tensor-parallel engine, its other ranks as processes of this machine
    engine = create_engine(engine_config(model_id, device, threads, seed, tp=tp))
    rng = seeded_rng(seed, "profile", model_id)
    vocab = spec.vocab
    greedy = SamplingParams(max_tokens=settings.decode_steps, ignore_eos=True)
    engine.generate(random_prompts(rng, 2, 8, vocab), greedy)  # warm-up, not recorded
    engine.stats.iterations.clear()
    for length in settings.context_lens:
        for batch in settings.batch_sizes:
            say(f"{model_id}: sweep batch {batch} x context {length}")
            engine.generate(random_prompts(rng, batch, length, vocab), greedy)
    say(f"{model_id}: mixed run")
    mixed_lens = rng.integers(8, 256, settings.mixed_requests)
    mixed_params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
                    for m in rng.integers(1, 128, settings.mixed_requests)]
    engine.generate(random_prompts(rng, settings.mixed_requests, mixed_lens, vocab), mixed_params)

    # The output-length run is real traffic: many requests of mixed contexts batched
    # together. Its iterations join the fit, so the fit sees batches whose contexts differ
    # (attention pads each group of similar contexts to its longest), not only the sweep's
    # uniform ones.
    say(f"{model_id}: output lengths of {settings.ecdf_requests} sampled requests")
    prompts = random_prompts(rng, settings.ecdf_requests, rng.integers(8, 128, settings.ecdf_requests), vocab)
    params = [SamplingParams(max_tokens=ECDF_MAX_TOKENS, temperature=ECDF_TEMPERATURE, seed=seed * 7919 + i)
              for i in range(len(prompts))]
    lengths = [o.output_len for o in engine.generate(prompts, params)]
    # the same prompts decoded greedily: the lengths a greedy DAG node really produces
    greedy_lengths = [o.output_len for o in engine.generate(prompts, SamplingParams(max_tokens=ECDF_MAX_TOKENS))]
    records = list(engine.stats.iterations)
    engine.release()

    from raycolo.offline.costmodel.latency import default_profile
    from raycolo.hardware import ClusterSpec
    flops_model = IterationLatency(spec, default_profile(spec, ClusterSpec(), tp))
    profile, stats = fit_profile(samples_from_records(records, flops_model), model_id, tp, load_s)
    profile.save(out / f"{model_id}.tp{tp}.json")
    write_ecdf(out / "ecdf" / f"{model_id}.csv", lengths,
               f"MEASURED output lengths of {model_id} ({len(lengths)} requests, torch engine, "
               f"temperature {ECDF_TEMPERATURE}, max_tokens {ECDF_MAX_TOKENS}, seed {seed}).\n"
               "Written by raycolo profile.")
    write_ecdf(out / "ecdf" / f"{model_id}{GREEDY_ECDF_SUFFIX}.csv", greedy_lengths,
               f"MEASURED output lengths of {model_id} ({len(greedy_lengths)} requests, torch engine, "
               f"greedy, max_tokens {ECDF_MAX_TOKENS}, seed {seed}).\n"
               "Written by raycolo profile.")
    if colocated is not None:
        say(f"{model_id}: co-located iterations (fine-tune ops between decode iterations)")
    colocated = colocated(model_id, seed, device, max(settings.batch_sizes)) if colocated is not None else []
    stats["decode_predictor"] = fit_decode_predictor(records, colocated)
    stats.update(model=model_id, tp=tp, device=device, threads=threads, seed=seed,
                 load_s=load_s, iterations=len(records),
                 ecdf_mean=float(np.mean(lengths)), ecdf_max=int(np.max(lengths)),
                 sweep={"batch_sizes": list(settings.batch_sizes),
                        "context_lens": list(settings.context_lens),
                        "decode_steps": settings.decode_steps})
    (out / f"{model_id}.tp{tp}.fit.json").write_text(json.dumps(stats, indent=2))
    return profile, stats


def fit_decode_predictor(records, colocated=(), held_out_every: int = 5) -> dict:
    """Harli's decode predictor (raycolo.latency_predictor). Stage 1 is fitted to
    the engine's decode iterations measured here. Stage 2 is fitted to the iterations of
    ``colocated`` (solo and co-located, on a pipeline stage: its interference
    factor is relative to that stage's own solo iterations). Every ``held_out_every``-th
    iteration of each kind is held out for its error (Harli reports 3 % for stage 1 and
    about 5 % for stage 2)."""
    from raycolo.latency_predictor import DecodeSample, fit, mape

    samples = [DecodeSample(r.num_seqs, float(np.mean(r.context_lens)), r.seconds)
               for r in records if r.kind == StepKind.DECODE and r.seconds > 0 and not r.preempted]
    held = samples[::held_out_every]
    predictor = fit([s for i, s in enumerate(samples) if i % held_out_every])
    out = {"b0": predictor.b0, "c0": predictor.c0, "k0": predictor.k0, "b1": 1.0, "k1": 1.0,
           "fit_iterations": len(samples) - len(held), "held_out_iterations": len(held),
           "held_out_mape": mape(predictor, held)}
    colocated = list(colocated)
    if colocated:
        held_colo = [s for s in colocated[::held_out_every] if not s.solo]
        stage = fit([s for i, s in enumerate(colocated) if i % held_out_every])
        out.update(b1=stage.b1, k1=stage.k1, colocated_iterations=sum(not s.solo for s in colocated),
                   colocated_held_out_iterations=len(held_colo),
                   colocated_held_out_mape=mape(stage, held_colo))
    return out
