"""``raycolo profile``: measure a model on an engine and write the cost model's files.

1. Load time: median of timed engine loads from a checkpoint directory.
2. Sweep: batches of 1..64 requests at several context lengths, in rounds, plus a mixed
   run of random lengths, recording every iteration (kind, sequences, tokens, seconds),
   a reference batch timed between runs, and every iteration rescaled to the machine's
   median speed over the profile (:mod:`raycolo.offline.speed_trace`).
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
from typing import Callable, Optional, Sequence

import numpy as np

from raycolo.batching.step_scheduler import StepKind
from raycolo.catalog import model_spec
from raycolo.offline.costmodel.fit import fit_profile, samples_from_records
from raycolo.offline.costmodel.latency import IterationLatency, LatencyProfile, fit_file, profile_file
from raycolo.offline.costmodel.length_sampler import GREEDY_ECDF_SUFFIX, write_ecdf
from raycolo.offline.speed_trace import SpeedTrace, TracedRun, at_median_speed, round_orders, traced
from raycolo.rng import random_prompts, seeded_rng
from raycolo.engine.base import EngineConfig, SamplingParams
from raycolo.engine.factory import create_engine
from raycolo.engine.models import save_tiny_checkpoint
from raycolo.generation.params import ECDF_TEMPERATURE  # the planner's eCDFs are measured at it

ECDF_MAX_TOKENS = 256


# The reference batch (time_reference): requests, prompt tokens, greedy tokens, timed runs.
REFERENCE_REQUESTS, REFERENCE_PROMPT, REFERENCE_TOKENS, REFERENCE_REPEATS = 16, 64, 16, 3
DRIFT_WARNING = 0.10   # raycolo profile warns when the reference moved more than this
SPREAD_WARNING = 0.15  # or when its 90th percentile run took this much longer than its 10th
SAMPLER_BATCHES = (1, 8, 32, 64)     # batch sizes the full sampler is timed at
SAMPLER_STEPS = 12                   # decode steps of each timed run
SAMPLER_REPEATS = 3                  # greedy/sampled pairs per batch size (the median is kept)


@dataclass
class SweepSettings:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context_lens: tuple[int, ...] = (16, 128, 384)
    decode_steps: int = 12              # decode iterations of each sweep point (after its prefill)
    rounds: int = 3                     # passes over the sweep's points, each in its own seeded order
    mixed_requests: int = 64
    ecdf_requests: int = 200
    load_repeats: int = 3
    sampler_batches: tuple[int, ...] = SAMPLER_BATCHES     # the full sampler's timing (time_full_sampler)
    sampler_repeats: int = SAMPLER_REPEATS
    max_num_seqs: int = 64                 # the profiled engine's batch limit
    kv_cache_tokens: int = 1 << 17         # and its KV budget (every run of the sweep fits it)

    @classmethod
    def quick(cls) -> "SweepSettings":
        return cls(batch_sizes=(1, 4, 16), context_lens=(16, 128), decode_steps=6, rounds=1,
                   mixed_requests=16, ecdf_requests=40, load_repeats=1, sampler_batches=(1, 16),
                   sampler_repeats=1)

    @classmethod
    def gpu(cls) -> "SweepSettings":
        """A real-size model on one GPU, within a device lease (about 3 minutes for the
        Llama-3-8B shape): batches up to 256 at prompts up to 1,024 tokens, one timed
        load (a load reads the whole checkpoint), a KV budget that holds the largest batch
        (256 x 1,040 tokens: 36 GiB for that shape, which leaves room on an 80 GB card)."""
        return cls(batch_sizes=(1, 4, 16, 64, 128, 256), context_lens=(128, 512, 1024), decode_steps=16, rounds=1,
                   mixed_requests=128, ecdf_requests=64, load_repeats=1, sampler_batches=(1, 64, 256),
                   sampler_repeats=2, max_num_seqs=256, kv_cache_tokens=9 << 15)

    @classmethod
    def for_run(cls, device: str, quick: bool) -> "SweepSettings":
        """``raycolo profile``'s sweep: quick, sized for a GPU, or the CPU's."""
        if quick:
            return cls.quick()
        return cls.gpu() if device.startswith("cuda") else cls()


def resolve_dtype(model_id: str, device: str, dtype: str = "auto") -> str:
    """The data type a profile or validation loads the model in. ``auto``: float32 on the
    CPU (its kernels' native type); on a GPU the checkpoint's own ``torch_dtype`` when it
    is a 16-bit one, else bfloat16 (what a real-size model is served in)."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    named = model_spec(model_id).dtype       # a checkpoint's config.json, as the catalog reads it
    return named if named in ("bfloat16", "float16") else "bfloat16"


def engine_config(model_id: str, device: str = "cpu", threads: Optional[int] = 1, seed: int = 0,
                  max_num_seqs: int = 64, kv_cache_tokens: int = 1 << 17, tp: int = 1,
                  dtype: str = "float32") -> EngineConfig:
    """The torch engine a profile or a validation measures: its prefill budget per
    iteration is the one the planner simulates for the model (its context, from the
    catalog or the checkpoint's config)."""
    from raycolo.batching.limits import batched_token_budget

    return EngineConfig.model_validate({
        "backend": "torch",
        "model_loading_config": {"model_id": model_id, "seed": seed, "dtype": dtype},
        "engine_kwargs": {"max_num_seqs": max_num_seqs, "kv_cache_tokens": kv_cache_tokens,
                          "max_num_batched_tokens": batched_token_budget(model_spec(model_id)),
                          "device": device, "cpu_threads": threads, "tensor_parallel_size": tp}})


def _measure_load(model_id: str, device: str, threads: Optional[int], seed: int, repeats: int,
                  tp: int = 1, dtype: str = "float32") -> float:
    with tempfile.TemporaryDirectory() as tmp:
        source = model_id
        if not Path(model_id).is_dir():
            source = str(save_tiny_checkpoint(model_id, Path(tmp) / "ckpt", seed))
        config = engine_config(source, device, threads, seed, tp=tp, dtype=dtype)
        if device == "cpu":
            create_engine(config).release()  # warm imports
        else:   # the same without a whole load of a real-size model (16 GB for an 8B in bf16)
            _warm_device(device)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            create_engine(config).release()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _warm_device(device: str) -> None:
    """What a first engine pays once per process besides its load: the engine's and
    transformers' imports, and the device's context."""
    import torch
    import transformers  # noqa: F401

    import raycolo.engine.torch_engine  # noqa: F401

    torch.zeros(1, device=device).sum().item()


# (model id, seed, device, largest batch, dtype) -> solo and co-located DecodeSamples
ColocatedProbe = Callable[[str, int, str, int, str], list]




def time_full_sampler(engine, rng, vocab: int, batches: Sequence[int] = SAMPLER_BATCHES,
                      steps: int = SAMPLER_STEPS, repeats: int = SAMPLER_REPEATS) -> tuple[float, float]:
    """The full sampler's extra seconds per decode iteration over the plain argmax, as
    ``(f0, f1)`` for ``f0 + f1 * n`` sequences, measured on ``engine`` itself: the same
    prompts decoded ``steps`` tokens greedily, then drawn at the eCDF temperature (both
    ignoring EOS, so the iterations match one for one), the two alternating so the
    machine's drift cancels; a non-negative line through the medians of the differences
    of their mean decode iterations."""
    from raycolo.lsq import nnls

    def decode_mean(prompts, params) -> float:
        engine.stats.iterations.clear()
        engine.generate(prompts, params)
        times = [r.seconds for r in engine.stats.iterations if r.kind == StepKind.DECODE and not r.graph_capture]
        return statistics.fmean(times)

    medians = []
    for n in batches:
        prompts = random_prompts(rng, n, 64, vocab)
        greedy = SamplingParams(max_tokens=steps, ignore_eos=True)
        drawn = [SamplingParams(max_tokens=steps, ignore_eos=True, temperature=ECDF_TEMPERATURE, seed=i)
                 for i in range(n)]
        medians.append(statistics.median(decode_mean(prompts, drawn) - decode_mean(prompts, greedy)
                                         for _ in range(repeats)))
    engine.stats.iterations.clear()
    a = np.column_stack([np.ones(len(batches)), np.asarray(batches, dtype=float)])
    f0, f1 = nnls(a, np.asarray(medians))
    return float(f0), float(f1)


def reference_runner(engine, vocab: int) -> Callable[[], float]:
    """One timed run of the reference batch on ``engine``: ``REFERENCE_REQUESTS`` prompts of
    ``REFERENCE_PROMPT`` seeded random tokens, each decoding ``REFERENCE_TOKENS`` greedy
    tokens, EOS ignored; returns its wall seconds."""
    prompts = random_prompts(seeded_rng(0, "reference"), REFERENCE_REQUESTS, REFERENCE_PROMPT, vocab)
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)

    def once() -> float:
        started = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - started
    return once


def time_reference(engine, vocab: int) -> float:
    """This machine's speed on this model now: the median wall time of the reference batch
    (:func:`reference_runner`) over ``REFERENCE_REPEATS`` runs after an untimed one.
    ``raycolo profile`` times it between its runs (:mod:`raycolo.offline.speed_trace`;
    ``.fit.json``'s ``reference_s`` is the median over the profile); ``raycolo validate``
    times it again on each case's engine, so a case's error can be read against how much
    the machine moved since the profile."""
    once = reference_runner(engine, vocab)
    once()
    return statistics.median(once() for _ in range(REFERENCE_REPEATS))


def drift_warning(model: str, drift: float) -> Optional[str]:
    """The line ``raycolo profile`` prints when the reference batch's end/start ratio
    ``drift`` moved more than ``DRIFT_WARNING`` during the profile, else None."""
    if abs(drift - 1) <= DRIFT_WARNING:
        return None
    return (f"{model}: warning: this machine ran a fixed reference batch {abs(drift - 1):.0%} "
            f"{'slower' if drift > 1 else 'faster'} at the end of the profile than at its start; its "
            "iterations are rescaled to the median speed, which is itself uncertain: profile again when "
            "the machine is quiet")


def spread_warning(model: str, spread: float) -> Optional[str]:
    """The line ``raycolo profile`` prints when the reference batch's 90th over 10th
    percentile run time (``reference_spread``) exceeds ``1 + SPREAD_WARNING``, else None."""
    if spread <= 1 + SPREAD_WARNING:
        return None
    return (f"{model}: warning: this machine's speed varied while it was profiled (a fixed reference batch "
            f"took {spread - 1:.0%} longer at its 90th percentile than at its 10th); predictions on it are "
            "no better than that: profile and plan when the machine is quiet")


def profile_reference(profile_dir: Path, name: str, tp: int) -> Optional[float]:
    """The reference time recorded beside ``name``'s tp profile, or None (a profile written
    before it was recorded, or without its ``.fit.json``)."""
    try:
        value = json.loads(fit_file(profile_dir, name, tp).read_text()).get("reference_s")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def measured_on(device: str, threads: Optional[int], tp: int, dtype: str = "float32") -> str:
    """Where and when a profile is measured: the card (or CPU, cores and torch threads), the
    weights' data type, the date."""
    import datetime
    import os
    import platform

    import torch

    if device == "cuda" and torch.cuda.is_available():
        where = f"{tp} x {torch.cuda.get_device_name()}"
    else:
        where = (f"cpu {platform.machine()} ({os.cpu_count()} cores, {threads or 'all'} torch thread(s)"
                 f"{f', tp={tp} in processes' if tp > 1 else ''})")
    return f"{where}, {dtype}, {datetime.date.today().isoformat()}"


def profile_model(model_id: str, out_dir: str | Path, tp: int = 1, device: str = "cpu",
                  threads: Optional[int] = 1, seed: int = 0, settings: Optional[SweepSettings] = None,
                  progress: Optional[Callable[[str], None]] = None,
                  colocated: Optional[ColocatedProbe] = None, name: Optional[str] = None,
                  dtype: str = "auto") -> tuple[LatencyProfile, dict]:
    """Profile ``model_id``: the cost model's coefficients and eCDFs, and Harli's decode
    predictor (stage 1 from the engine's decode iterations; stage 2 from ``colocated``'s
    samples when given, :func:`raycolo.online.stages.colocated_profile.measure_colocated`
    as ``raycolo profile`` passes it, else b1 = k1 = 1: no interference). ``model_id`` is a
    tiny catalog model or a checkpoint directory; the files are named ``name`` (default: the
    catalog name, or the directory's name)."""
    settings = settings or SweepSettings.for_run(device, quick=False)
    say = progress or (lambda msg: None)
    spec = model_spec(model_id, name)
    dtype = resolve_dtype(model_id, device, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"{spec.name}: timing loads ({dtype} on {device})")
    load_s = _measure_load(model_id, device, threads, seed, settings.load_repeats, tp, dtype)

    # tp > 1: a tensor-parallel engine, its other ranks as processes of this machine
    engine = create_engine(engine_config(model_id, device, threads, seed, settings.max_num_seqs,
                                         settings.kv_cache_tokens, tp, dtype))
    rng = seeded_rng(seed, "profile", model_id)
    vocab = spec.vocab
    greedy = SamplingParams(max_tokens=settings.decode_steps, ignore_eos=True)
    # Warm-up, not recorded: every batch size of the sweep once, so no timed iteration is
    # the first of its shape (the first runs a shape's kernel set-up on the CPU, and captures
    # its CUDA graph on a GPU).
    say(f"{spec.name}: warm-up over the sweep's batch sizes")
    for batch in settings.batch_sizes:
        engine.generate(random_prompts(rng, batch, min(settings.context_lens), vocab), greedy)
    trace = SpeedTrace(reference_runner(engine, vocab))   # the machine's speed between runs
    trace.time_once()                                     # its first run, untimed
    trace.mark()
    runs: list[TracedRun] = []

    def run(prompts, params):
        """One traced engine run: its outputs; its iterations (less any graph capture's) go to runs."""
        def go():
            engine.stats.iterations.clear()
            outputs = engine.generate(prompts, params)
            return outputs, list(engine.stats.iterations)
        return traced(trace, go, runs)

    points = [(length, batch) for length in settings.context_lens for batch in settings.batch_sizes]
    sweep = round_orders(points, settings.rounds, rng.shuffle)
    for i, (length, batch) in enumerate(sweep):
        say(f"{spec.name}: sweep batch {batch} x context {length}"
            + (f" (round {i // len(points) + 1} of {settings.rounds})" if settings.rounds > 1 else ""))
        run(random_prompts(rng, batch, length, vocab), greedy)
    say(f"{spec.name}: mixed run")
    mixed_lens = rng.integers(8, 256, settings.mixed_requests)
    mixed_params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
                    for m in rng.integers(1, 128, settings.mixed_requests)]
    run(random_prompts(rng, settings.mixed_requests, mixed_lens, vocab), mixed_params)

    # The output-length run is real traffic: many requests of mixed contexts batched
    # together. Its iterations join the fit, so the fit sees batches whose contexts differ
    # (attention pads each group of similar contexts to its longest), not only the sweep's
    # uniform ones.
    say(f"{spec.name}: output lengths of {settings.ecdf_requests} sampled requests")
    prompts = random_prompts(rng, settings.ecdf_requests, rng.integers(8, 128, settings.ecdf_requests), vocab)
    params = [SamplingParams(max_tokens=ECDF_MAX_TOKENS, temperature=ECDF_TEMPERATURE, seed=seed * 7919 + i)
              for i in range(len(prompts))]
    lengths = [o.output_len for o in run(prompts, params)]
    # the same prompts decoded greedily: the lengths a greedy DAG node really produces
    greedy_lengths = [o.output_len for o in run(prompts, SamplingParams(max_tokens=ECDF_MAX_TOKENS))]
    # every iteration at the profile's median speed; a step that captured a CUDA graph also
    # ran the capture's warm-ups: not a cost the planner sees
    timed = at_median_speed(runs, trace)
    records = [r for r in timed if not r.graph_capture]
    captured = len(timed) - len(records)
    say(f"{spec.name}: the full sampler against the plain argmax, on the engine")
    sampler = time_full_sampler(engine, rng, vocab, settings.sampler_batches, repeats=settings.sampler_repeats)
    engine.release()

    from raycolo.offline.costmodel.latency import default_profile
    from raycolo.hardware import ClusterSpec
    flops_model = IterationLatency(spec, default_profile(spec, ClusterSpec(), tp))
    profile, stats = fit_profile(samples_from_records(records, flops_model), spec.name, tp, load_s,
                                 full_sampler=sampler)
    profile = profile.model_copy(update={"engine": "torch", "measured_on": measured_on(device, threads, tp, dtype)})
    profile.save(profile_file(out, spec.name, tp))
    write_ecdf(out / "ecdf" / f"{spec.name}.csv", lengths,
               f"MEASURED output lengths of {model_id} ({len(lengths)} requests, torch engine, "
               f"temperature {ECDF_TEMPERATURE}, max_tokens {ECDF_MAX_TOKENS}, seed {seed}).\n"
               "Written by raycolo profile.")
    write_ecdf(out / "ecdf" / f"{spec.name}{GREEDY_ECDF_SUFFIX}.csv", greedy_lengths,
               f"MEASURED output lengths of {model_id} ({len(greedy_lengths)} requests, torch engine, "
               f"greedy, max_tokens {ECDF_MAX_TOKENS}, seed {seed}).\n"
               "Written by raycolo profile.")
    if colocated is not None:
        say(f"{spec.name}: co-located iterations (fine-tune ops between decode iterations)")
    colocated = colocated(model_id, seed, device, max(settings.batch_sizes), dtype) if colocated is not None else []
    stats["decode_predictor"] = fit_decode_predictor(records, colocated)
    stats.update(model=spec.name, checkpoint=model_id if model_id != spec.name else None, tp=tp, device=device,
                 dtype=dtype, threads=threads, seed=seed,
                 load_s=load_s, iterations=len(records), graph_capture_iterations=captured,
                 **trace.summary(),
                 ecdf_mean=float(np.mean(lengths)), ecdf_max=int(np.max(lengths)),
                 sweep={"batch_sizes": list(settings.batch_sizes),
                        "context_lens": list(settings.context_lens),
                        "decode_steps": settings.decode_steps, "rounds": settings.rounds})
    fit_file(out, spec.name, tp).write_text(json.dumps(stats, indent=2))
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
