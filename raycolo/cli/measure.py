"""``raycolo profile`` (measure a model on the torch engine and fit the cost model) and
``raycolo validate`` (predicted against measured run times). Neither imports Ray: both run
on a lent GPU machine under its own Python."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from raycolo.errors import RaycoloError
from raycolo.offline.costmodel.latency import profile_file, resolve_profile_dir


def _require_device(device: str) -> None:
    """``--device cuda`` where torch sees no GPU is refused before any work."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RaycoloError("--device: 'cuda' asked for, but torch sees no CUDA device here")


def _spec(model: str, flag: str, name, not_tiny: str):
    """The ModelSpec of ``model``: a checkpoint directory's (named ``name``), or a tiny
    catalog model's (the torch engine builds it with random weights); refused naming
    ``flag`` otherwise (``not_tiny`` says what to give instead of a large catalog model)."""
    from raycolo.catalog import get_model, spec_of_checkpoint
    from raycolo.engine.models import MAX_RANDOM_PARAMS
    from raycolo.errors import ConfigError

    try:
        if Path(model).is_dir():
            return spec_of_checkpoint(model, name)
        spec = get_model(model)
    except ConfigError as exc:
        raise RaycoloError(f"{flag}: {str(exc).removeprefix('--model: ')}") from None
    if spec.hf_architecture is None or spec.num_params > MAX_RANDOM_PARAMS:
        raise RaycoloError(f"{flag}: '{model}' {not_tiny}")
    return spec


def cmd_profile(args) -> int:
    from raycolo.offline.profiler import SweepSettings, drift_warning, profile_model, spread_warning
    from raycolo.online.stages.colocated_profile import measure_colocated

    spec = _spec(args.model, "--model", args.name,
                 "has no checkpoint here; give a tiny catalog model or a checkpoint directory")
    if args.tp != 1:
        from raycolo.tp_rules import tp_split_error
        error = tp_split_error(args.tp, spec.heads, spec.kv_heads, spec.intermediate)
        if error:
            raise RaycoloError(f"--tp: {error}")
    _require_device(args.device)
    settings = SweepSettings.for_run(args.device, args.quick)
    profile, stats = profile_model(args.model, args.out, tp=args.tp, device=args.device,
                                   threads=args.threads, seed=args.seed, settings=settings,
                                   progress=progress, colocated=measure_colocated, name=args.name,
                                   dtype=args.dtype)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        dropped = f" ({stats['outlier_iterations']} one-off iteration(s) dropped)" if stats["outlier_iterations"] else ""
        print(f"{stats['model']}: {stats['iterations']} iterations{dropped}, fit R2 {stats['r2']:.3f}, "
              f"median |error| {stats['median_abs_error']:.1%}, load {stats['load_s']:.2f}s, "
              f"output length mean {stats['ecdf_mean']:.0f} (max {stats['ecdf_max']})")
        for warning in (drift_warning(stats["model"], stats["machine_drift"]),
                        spread_warning(stats["model"], stats["reference_spread"])):
            if warning:
                print(warning)
        dp = stats["decode_predictor"]
        print(f"{stats['model']}: Harli decode predictor (bs*b0 + c0 + bs*k0*seqlen) b0 {dp['b0']:.3g} s, "
              f"c0 {dp['c0']:.3g} s, k0 {dp['k0']:.3g} s; held-out error {dp['held_out_mape']:.1%} "
              f"on {dp['held_out_iterations']} decode iterations")
        if "colocated_held_out_mape" in dp:
            print(f"{stats['model']}: stage 2 (co-located, time shares) b1 {dp['b1']:.3f}, k1 {dp['k1']:.3f}; "
                  f"held-out error {dp['colocated_held_out_mape']:.1%} on {dp['colocated_held_out_iterations']} "
                  f"co-located iterations (set lemix.harli_b1 / harli_k1 to use them online)")
        print(f"profile: {profile_file(args.out, stats['model'], args.tp)}")
    return 0


def progress(msg: str) -> None:
    """Progress of ``profile`` and ``validate``: on stderr even with --json (stdout holds only
    the JSON), so a run cut off by a time limit still shows how far it got."""
    print(msg, file=sys.stderr, flush=True)


def cmd_validate(args) -> int:
    from raycolo.offline.calibration import TINY_MODELS, BatchRuns, format_report, validate
    profile_dir = resolve_profile_dir(args.profile)
    models = [m.strip() for m in args.models.split(",")] if args.models else list(TINY_MODELS)
    runs = None
    if args.batches is not None:
        runs = BatchRuns(_batch_sizes(args.batches), args.prompt_len, args.output_len)
    _require_device(args.device)
    if runs is None and (args.device != "cpu" or args.dtype != "auto"):
        flag = "--device" if args.device != "cpu" else "--dtype"
        raise RaycoloError(f"{flag}: the sampled request sets run the tiny models on the CPU in float32; "
                           "give --batches to validate elsewhere or in another dtype")
    names = {}
    for m in models:
        names[m] = _validated_model(m, args, profile_dir, runs is not None)
    report = validate(profile_dir, models, args.requests, args.seed, args.threads, progress, tp=args.tp,
                      repeats=args.repeats, batches=runs, device=args.device, dtype=args.dtype, names=names)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _batch_sizes(text: str) -> tuple[int, ...]:
    from raycolo.cli.options import MAX_BATCH

    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise RaycoloError(f"--batches: comma-separated whole numbers, got '{text}'") from None
    if not sizes or any(not 1 <= b <= MAX_BATCH for b in sizes):
        raise RaycoloError(f"--batches: each size must be in [1, {MAX_BATCH}], got '{text}'")
    return sizes


def _validated_model(model: str, args, profile_dir: Path, batches: bool) -> str:
    """The name of ``model``'s profile, once ``validate`` can run it: a tiny catalog model,
    or with ``--batches`` a checkpoint directory whose profile names a catalog model."""
    from raycolo.catalog import get_model
    from raycolo.tp_rules import tp_split_error

    if Path(model).is_dir() and not batches:
        raise RaycoloError(f"--models: {model} is a checkpoint directory: validate it with --batches "
                           "(fixed lengths; a sampled set needs the model's own output lengths)")
    spec = _spec(model, "--models", args.name,
                 "is not a tiny model the torch engine can build (give its checkpoint directory with --batches)")
    if Path(model).is_dir():
        try:
            get_model(spec.name)
        except Exception as exc:
            raise RaycoloError(f"--name: the planner costs catalog models; {exc} (give --name of the catalog "
                               "model this checkpoint has the shape of, as raycolo profile --name did)") from None
    error = tp_split_error(args.tp, spec.heads, spec.kv_heads, spec.intermediate)
    if error:
        raise RaycoloError(f"--tp: {spec.name}: {error}")
    if not profile_file(profile_dir, spec.name, args.tp).exists():
        raise RaycoloError(f"--profile: {profile_dir} has no tp={args.tp} profile for {spec.name} "
                           f"(run: raycolo profile --model {model} --tp {args.tp} --out {profile_dir})")
    return spec.name
