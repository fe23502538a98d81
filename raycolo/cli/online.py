"""``raycolo simulate-online``, ``sweep-online``, ``online run`` and ``serve``: the online
half's commands (their flags are built in :mod:`raycolo.cli.main`)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from raycolo.errors import RaycoloError
from raycolo.cli.flags import field_type


def _online_setup(args):
    from raycolo.online.lemix_params import LemixParams
    from raycolo.online.profiles import preset

    values = {}      # the flags' types held them to their bounds
    if args.slo_multiplier is not None:
        values["slo_multiplier"] = args.slo_multiplier
    if args.slo_ms is not None:
        values["slo_ms"] = args.slo_ms
    return preset(args.model, args.stages), LemixParams(**values)


def _check_online_policy(name: str, flag: str = "--policy") -> None:
    from raycolo.online.policies import get_online_policy
    try:
        get_online_policy(name)
    except RaycoloError as exc:
        raise RaycoloError(f"{flag}: {str(exc).split(': ', 1)[-1]}") from None


def cmd_simulate_online(args) -> int:
    from raycolo.online.simulation.sim import simulate
    from raycolo.online.tasks import load_trace, poisson_workload

    profile, params = _online_setup(args)
    _check_online_policy(args.policy)
    if args.trace:
        tasks = load_trace(args.trace, seed=args.seed, limit=args.tasks)
    else:
        tasks = poisson_workload(args.rate, args.train_rate, args.tasks, lengths=args.lengths, seed=args.seed)
    from raycolo.online.policies import make_online_policy
    policy = make_online_policy(args.policy, params, nodes=args.nodes, train_rate=args.train_rate)
    result = simulate(tasks, profile, args.nodes, policy, params)
    summary = online_summary(result, args.model, args.nodes, args.stages, args.rate, args.train_rate)
    return _report_online(result, summary, args,
                          f"{args.policy}: {args.nodes} x {args.stages} {args.model}, {args.rate:g} rps, "
                          f"training {args.train_rate:.0%}",
                          f"{args.policy} on {args.nodes} x {args.stages} {args.model}, {len(tasks)} tasks "
                          f"({result.inference} inference, {result.train} training)")


def online_summary(result, model: str, nodes: int, stages: int, rate: float, train_rate: float,
                   stats: Optional[dict] = None) -> dict:
    """What ``simulate-online --json`` and ``online run --json`` print, with the same keys:
    the run's shape, its OnlineResult's summary, and the live runtime's own figures from
    the controller's ``stats`` (a simulation has none: no actor hops, no adapter
    checkpoints, no errors). ``online run --preference-share`` adds ``preference`` and
    ``--plot`` adds ``plot`` (both commands)."""
    stats = stats or {}
    return {"model": model, "nodes": nodes, "stages": stages, "rate": rate, "train_rate": train_rate,
            **result.summary(), "actor_hops": stats.get("actor_hops", 0),
            "controller_cpu_ms_per_task": stats.get("controller_cpu_ms_per_task"),
            "controller_sustains_tasks_per_s": stats.get("controller_sustains_tasks_per_s"),
            "controller_cpu_share": stats.get("controller_cpu_share"),
            "adapter_version": stats.get("adapter_version"), "errors": stats.get("errors", [])}


def _report_online(result, summary: dict, args, title: str, heading: str) -> int:
    """What simulate-online and online run print: JSON, or a few lines; a timeline plot."""
    if args.plot:
        from raycolo.online.simulation.sweep import plot_timeline
        summary["plot"] = str(plot_timeline(result, args.plot, title))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    ms = lambda v, digits=0: "-" if v is None else f"{v * 1e3:.{digits}f} ms"  # noqa: E731
    print(heading)
    print(f"  throughput {summary['throughput']:.2f} tasks/s, SLO attainment {summary['slo_attainment']:.1%} "
          f"(TTFT <= {summary['slo_s'] * 1e3:.0f} ms)")
    print(f"  TTFT p50 {ms(summary['ttft_p50_s'])}, p99 {ms(summary['ttft_p99_s'])}; TBT p50 {ms(summary['tbt_p50_s'], 1)}")
    print(f"  GPU idle {summary['idle_fraction']:.1%}, active nodes {summary['active_nodes_mean']:.2f}, "
          f"training done {summary['train_done']}, staleness {summary['staleness_mean']:.1f} tasks, "
          f"decision {summary['decision_us_mean']:.0f} us/task")
    if summary.get("controller_cpu_ms_per_task") is not None:     # live runs only
        share = summary.get("controller_cpu_share")
        print(f"  controller CPU {summary['controller_cpu_ms_per_task']:.1f} ms/task"
              + (f", {share:.2f} of a core since the run started" if share is not None else "")
              + f": one controller would sustain ~{summary['controller_sustains_tasks_per_s']:.0f} tasks/s at this "
              "cost per task (it admits, places and reads the nodes' reports; the ops run in the node loops, "
              "or pass through it with stage.data_plane: controller)")
    if args.plot:
        print(f"plot: {summary['plot']}")
    return 0


def _float_list(text: str, flag: str, model, field: str) -> list[float]:
    """Comma-separated values of ``model``'s field ``field``, each held to its bounds."""
    from raycolo.errors import ConfigError
    parse = field_type(model, field)
    try:
        values = [parse(x.strip()) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if not values:
        raise ConfigError(f"{flag}: empty")
    return values


def cmd_sweep_online(args) -> int:
    from raycolo.errors import ConfigError
    from raycolo.online.simulation.sweep import format_tables, plot, sweep

    profile, params = _online_setup(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError(f"--policies: no policy named in '{args.policies}'")
    for policy in policies:
        _check_online_policy(policy, "--policies")
    from raycolo.online.config import OnlineConfig
    from raycolo.online.tasks import Arrivals
    rates = _float_list(args.rates, "--rates", Arrivals, "rate")
    alphas = _float_list(args.train_rates, "--train-rates", OnlineConfig, "train_rate")
    say = None if args.json else (lambda m: print(m, file=sys.stderr))
    from raycolo.online.policies import make_online_policy
    rows = sweep(profile, args.nodes, policies, rates, alphas, args.tasks, args.seed, args.lengths,
                 params, say, make_policy=make_online_policy)
    paths = plot(rows, policies, args.out, f"{args.nodes} x {args.stages} {args.model}, {args.tasks} tasks")
    if args.json:
        print(json.dumps({"rows": rows, "plots": [str(p) for p in paths]}, indent=2))
        return 0
    print(format_tables(rows, policies))
    for path in paths:
        print(f"plot: {path}")
    return 0


def replay_online(dep, config, tasks, rate: float, seed: int = 0, preference_share: float = 0.0,
                  progress=None, save_profile=None) -> tuple:
    """``online run`` on the started deployment ``dep`` (of ``config``): replay ``tasks``;
    returns the run's OnlineResult and its summary (:func:`online_summary`; with
    ``preference_share``, the held-out win rate and CLPD before and after as ``preference``)."""
    preference = {"before": dep.held_out_preference(node=None)} if preference_share else None
    result = dep.replay(tasks, seed=seed, progress=progress, preference_share=preference_share)
    summary = online_summary(result, config.model_loading_config.model_id, config.nodes, config.stages, rate,
                             config.train_rate, dep.stats())
    if preference:
        preference["after"] = dep.held_out_preference(node=None)
        summary["preference"] = preference
    if save_profile:
        dep.save_profile(save_profile)
    return result, summary


def cmd_online(args) -> int:
    from raycolo.online.config import layer_bounds, load_online_config, model_hf_config
    from raycolo.online.tasks import load_trace, poisson_workload

    # a trace replay measures one run from the base model: it takes up no earlier run's training
    config = load_online_config(args.config).model_copy(update={"resume": False})
    config.check_paths()         # first: the model's config below imports torch and transformers (~5 s)
    layer_bounds(model_hf_config(config.model_loading_config.model_id).num_hidden_layers, config.stages)
    if args.train_rate is not None:
        config = config.model_copy(update={"train_rate": args.train_rate})
    if args.trace:
        tasks = load_trace(args.trace, seed=args.seed, limit=args.tasks)
    else:
        tasks = poisson_workload(args.rate, config.train_rate, args.tasks, lengths=args.lengths, seed=args.seed)
    for t in tasks:  # tiny CPU models: keep prompts and outputs short
        t.length = max(2, min(t.length, args.max_length))
        if not t.is_train:
            t.decode_tokens = max(1, min(t.decode_tokens, args.max_decode))
            t.max_tokens = t.decode_tokens
    from raycolo.actors.online.launch import OnlineDeployment

    say = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    say(f"starting {config.nodes} x {config.stages} stage workers ({config.model_loading_config.model_id}, "
        f"policy {config.policy})")
    dep = OnlineDeployment.start(config, address=args.address)
    try:
        result, summary = replay_online(dep, config, tasks, args.rate, seed=args.seed,
                                        preference_share=args.preference_share, progress=say,
                                        save_profile=args.save_profile)
    finally:
        dep.stop()
    preference = summary.get("preference")
    if preference and not args.json:
        b, a = preference["before"], preference["after"]
        say(f"held-out preference pairs ({b['pairs']}): win rate {b['win_rate']:.0%} -> {a['win_rate']:.0%}, "
            f"CLPD {b['clpd']:+.2f} -> {a['clpd']:+.2f}")
    return _report_online(result, summary, args,
                          f"{config.policy} live: {config.nodes} x {config.stages} {config.model_loading_config.model_id}",
                          f"{config.policy} live on {config.nodes} x {config.stages} "
                          f"{config.model_loading_config.model_id}, {summary['tasks']} tasks "
                          f"({result.inference} inference, {result.train} training)")


def cmd_serve(args) -> int:
    from raycolo.online.config import layer_bounds, load_online_config, model_hf_config

    config = load_online_config(args.config)
    config.check_paths()         # first: the model's config below imports torch and transformers (~5 s)
    layer_bounds(model_hf_config(config.model_loading_config.model_id).num_hidden_layers, config.stages)
    update = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if update:
        config = config.model_copy(update={"serve": config.serve.model_copy(update=update)})
    from raycolo.actors.serve.launch import serve_until_stopped

    return serve_until_stopped(config, address=args.address,
                               say=lambda m: print(m, file=sys.stderr, flush=True))
