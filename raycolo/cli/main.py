"""``raycolo`` command line: plan and compare multi-LLM applications.

Invalid input never shows a traceback: it prints one ``error: ...`` line naming the
field or file and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from raycolo.offline.costmodel.latency import resolve_profile_dir  # noqa: F401  (also imported from here)
from raycolo.cli.online import cmd_online, cmd_serve, cmd_simulate_online, cmd_sweep_online
from raycolo.cli.measure import cmd_profile, cmd_validate
from raycolo.errors import RaycoloError, one_line
from raycolo.cli.flags import add_field_flag, add_model_flags

EXIT_USAGE = 2
EXIT_RUNTIME = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        print(f"error: {one_line(message.removeprefix('argument '))}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


PLAN_GPUS, PLAN_NVLINK_GROUP = 8, 2     # plan and compare: one 8-GPU node in NVLink pairs


def _add_problem_flags(p: argparse.ArgumentParser) -> None:
    """plan and compare: the planning fields of RunConfig (the same names, types and
    bounds as ``run``'s), for a node of PLAN_GPUS GPUs unless told otherwise."""
    from raycolo.offline.runtime.setup import RunConfig

    p.add_argument("dag", help="application graph (YAML)")
    add_field_flag(p, RunConfig, "gpus", "GPUs on the node", default=PLAN_GPUS)
    add_field_flag(p, RunConfig, "gpu_memory", "memory per GPU")
    add_field_flag(p, RunConfig, "nvlink_group", "GPUs per NVLink group; TP stays inside one",
                   default=PLAN_NVLINK_GROUP)
    add_field_flag(p, RunConfig, "requests")
    add_field_flag(p, RunConfig, "seed")
    add_field_flag(p, RunConfig, "profile", "directory of latency profiles (<model>.tp<T>.json), or 'cpu'",
                   metavar="DIR")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _online_policy_names() -> list[str]:
    from raycolo.online.policies import online_policy_names

    return online_policy_names()


def build_parser() -> argparse.ArgumentParser:
    from raycolo.cli.options import (Attach, CompareOptions, LiveOptions, PlanOptions, ProfileOptions,
                                     SweepOptions, ValidateOptions)
    from raycolo.online.config import OnlineConfig, ServeSpec
    from raycolo.online.tasks import Arrivals, LiveReplay

    parser = _Parser(prog="raycolo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="plan an application's execution stages")
    _add_problem_flags(plan)
    add_model_flags(plan, PlanOptions)
    plan.add_argument("--gantt", default=None, metavar="PNG", help="write a Gantt chart")
    compare = sub.add_parser("compare", help="run every policy on the same sampled workload")
    _add_problem_flags(compare)
    add_model_flags(compare, CompareOptions)
    profile = sub.add_parser("profile", help="measure a model on the torch engine and fit the cost model")
    add_model_flags(profile, ProfileOptions)
    profile.add_argument("--quick", action="store_true", help="a smaller sweep (~30 s)")
    profile.add_argument("--json", action="store_true",
                         help="print the fit statistics as JSON on stdout (progress stays on stderr)")
    validate = sub.add_parser("validate", help="compare predicted and measured run times")
    add_model_flags(validate, ValidateOptions)
    validate.add_argument("--json", action="store_true",
                          help="print the report as JSON on stdout (progress stays on stderr)")
    run = sub.add_parser("run", help="run an application for real on an embedded local Ray cluster")
    run.add_argument("dag", help="application graph (YAML)")
    _add_run_flags(run, local=True)
    # jobs/run_dag.py: the same, on the cluster the job was submitted to
    online = sub.add_parser("simulate-online", help="simulate co-located serving and retraining")
    _add_online_flags(online)
    add_field_flag(online, OnlineConfig, "policy", f"online policy: {', '.join(_online_policy_names())}")
    add_field_flag(online, Arrivals, "rate", "requests per second")
    add_field_flag(online, OnlineConfig, "train_rate", "fraction of training tasks α")
    online.add_argument("--trace", default=None, metavar="CSV", help="replay a trace instead of Poisson arrivals")
    online.add_argument("--plot", default=None, metavar="PNG", help="active nodes over time and the TTFT CDF")
    online.add_argument("--json", action="store_true")
    sweep = sub.add_parser("sweep-online", help="online policies across request and training rates")
    _add_online_flags(sweep)
    add_model_flags(sweep, SweepOptions)
    sweep.add_argument("--json", action="store_true")
    live = sub.add_parser("online", help="live co-located serving and retraining on Ray")
    live_sub = live.add_subparsers(dest="online_command", required=True, parser_class=_Parser)
    orun = live_sub.add_parser("run", help="replay arrivals against a live deployment; prints "
                               "simulate-online's metrics")
    orun.add_argument("config", help="online deployment config (YAML), e.g. examples/online.yaml")
    orun.add_argument("--trace", default=None, metavar="CSV", help="replay a trace instead of Poisson arrivals")
    add_field_flag(orun, Arrivals, "rate", "tasks per second", default=2.0)
    add_field_flag(orun, OnlineConfig, "train_rate", "fraction of training tasks α (none: the config's)",
                   default=None)
    add_field_flag(orun, Arrivals, "tasks", "tasks to replay", default=20)
    add_model_flags(orun, LiveReplay)
    add_model_flags(orun, LiveOptions)
    orun.add_argument("--plot", default=None, metavar="PNG", help="active nodes over time and the TTFT CDF")
    orun.add_argument("--json", action="store_true")
    srv = sub.add_parser("serve", help="serve the online deployment over OpenAI-compatible HTTP "
                         "(Ray Serve) on a local cluster, until Ctrl-C")
    srv.add_argument("config", help="online deployment config (YAML), e.g. examples/online.yaml")
    add_model_flags(srv, Attach)
    add_field_flag(srv, ServeSpec, "host", "HTTP host (none: the config's serve.host)", default=None)
    add_field_flag(srv, ServeSpec, "port", "HTTP port (none: the config's serve.port)", default=None)
    run_dag = sub.add_parser("run-dag", help="what jobs/run_dag.py runs under 'ray job submit'")
    run_dag.add_argument("--dag", required=True, help="application graph (YAML)")
    _add_run_flags(run_dag, local=False)
    return parser


def _add_online_flags(p: argparse.ArgumentParser) -> None:
    from raycolo.cli.options import SimulatedCluster
    from raycolo.online.lemix_params import LemixParams
    from raycolo.online.tasks import Arrivals

    add_model_flags(p, SimulatedCluster)
    add_field_flag(p, Arrivals, "tasks", "tasks to simulate")
    add_field_flag(p, LemixParams, "slo_multiplier", "SLO = k x forward latency")
    add_field_flag(p, LemixParams, "slo_ms", "absolute TTFT SLO in ms (overrides the multiplier)")


RUN_FLAGS_BY_HAND = ("dag", "output", "progress", "gantt")   # positional or per command; switches


def _add_run_flags(p: argparse.ArgumentParser, local: bool) -> None:
    """``run`` and ``run-dag``: a flag per RunConfig field (raycolo/offline/runtime/setup.py)."""
    from raycolo.offline.runtime.setup import RunConfig

    p.add_argument("--output", required=not local, default=None, metavar="DIR",
                   help="output directory; rerunning into it resumes" + (" (default out/<app>)" if local else ""))
    for name in RunConfig.model_fields:
        if name in RUN_FLAGS_BY_HAND:
            continue
        if name == "gpus" and local:
            add_field_flag(p, RunConfig, name, "logical GPUs of the local cluster", default=2)
        else:
            add_field_flag(p, RunConfig, name)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report JSON before the last line")


def _problem(args):
    from raycolo.offline.dag import load_app
    from raycolo.hardware import make_cluster
    from raycolo.offline.planner.problem import PlanningProblem
    from raycolo.offline.workload import build_workload

    profile_dir = resolve_profile_dir(args.profile) if args.profile is not None else None
    cluster = make_cluster(args.gpus, args.gpu_memory, args.nvlink_group)
    app = load_app(args.dag)
    workload = build_workload(app, seed=args.seed, requests=args.requests,
                              ecdf_dir=profile_dir / "ecdf" if profile_dir else None)
    return PlanningProblem(workload, cluster, profile_dir=profile_dir)


def _stage_table(plan) -> str:
    lines = [f"{'stage':>5}  {'start_s':>9}  {'end_s':>9}  models (node plan@GPUs; * = loaded, ! = finishes)"]
    for i, s in enumerate(plan.stages):
        parts = []
        for m in s.models:
            gpus = ",".join(str(g) for g in m.gpus)
            parts.append(f"{m.node} dp{m.dp}xtp{m.tp}@{gpus}{'*' if m.reloaded else ''}"
                         f"{'!' if m.finishes else ''}")
        lines.append(f"{i:>5}  {s.start_s:>9.1f}  {s.end_s:>9.1f}  " + "  ".join(parts))
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from raycolo.offline.policies import get_policy

    policy = get_policy(args.policy)
    problem = _problem(args)
    plan = policy(problem)
    if args.gantt:
        from raycolo.offline.planner.gantt import plot_gantt
        plot_gantt(plan, args.gantt)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(_stage_table(plan))
    print("\n".join(plan.costed_from_lines()))
    gap = plan.makespan_s / plan.lower_bound_s - 1 if plan.lower_bound_s else float("nan")
    print(f"policy {plan.policy}: makespan {plan.makespan_s:.1f}s, search {plan.search_s:.2f}s, "
          f"lower bound {plan.lower_bound_s:.1f}s (gap {gap:+.1%}), "
          f"{len(plan.stages)} stages, {plan.simulations} simulations")
    if plan.proven_optimal:
        print("proven optimal (branch and bound over all stage sequences)")
    elif plan.optimality_gap is not None:
        print(f"not proven optimal: at most {plan.optimality_gap:.1%} above the best possible "
              f"(lower bound {plan.lower_bound_s:.1f}s)")
    if args.gantt:
        print(f"gantt: {args.gantt}")
    return 0


def comparable_policies(problem) -> list[str]:
    from raycolo.offline.policies import optimal_applies, policy_names
    return [p for p in policy_names() if p != "optimal" or optimal_applies(problem)]


def run_comparison(problem, names: Sequence[str], progress: bool = True) -> dict:
    from tqdm import tqdm

    from raycolo.offline.policies import get_policy

    plans = {}
    for name in tqdm(names, desc="policies", disable=not progress, file=sys.stderr, leave=False):
        plans[name] = get_policy(name)(problem)
    lower = max(p.lower_bound_s for p in plans.values())
    ref = plans.get("samullm")
    results = []
    for name, p in plans.items():
        results.append({
            "policy": name, "makespan_s": p.makespan_s, "search_s": p.search_s,
            "end_to_end_s": p.end_to_end_s,
            "samullm_speedup": p.end_to_end_s / ref.end_to_end_s if ref else None,
            "gap_to_lower_bound": p.makespan_s / lower - 1 if lower else None,
            "stages": len(p.stages),
            "lower_bound_s": p.lower_bound_s,       # this policy's own bound
            "proven_optimal": p.proven_optimal,
            "optimality_gap": p.optimality_gap,     # None: this policy bounds no optimum
            "notes": list(p.notes),
        })
    report = {"results": results, "lower_bound_s": lower}
    if "optimal" in plans:
        o = plans["optimal"]
        report["optimal"] = {"proven_optimal": o.proven_optimal, "optimality_gap": o.optimality_gap,
                             "lower_bound_s": o.lower_bound_s, "makespan_s": o.makespan_s}
    return report


def format_comparison(report: dict) -> str:
    head = (f"{'policy':<18} {'makespan_s':>10} {'search_s':>9} {'end_to_end_s':>12} "
            f"{'samullm_speedup':>15} {'gap_to_LB':>9} {'stages':>6} {'proven':>6} {'opt_gap':>7}")
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        speed = f"{r['samullm_speedup']:.2f}x" if r["samullm_speedup"] else "-"
        proven = "yes" if r.get("proven_optimal") else ("no" if r.get("optimality_gap") is not None else "-")
        opt_gap = f"{r['optimality_gap']:.1%}" if r.get("optimality_gap") is not None else "-"
        lines.append(f"{r['policy']:<18} {r['makespan_s']:>10.1f} {r['search_s']:>9.2f} "
                     f"{r['end_to_end_s']:>12.1f} {speed:>15} {r['gap_to_lower_bound']:>+9.1%} "
                     f"{r['stages']:>6} {proven:>6} {opt_gap:>7}")
    lines.append(f"lower bound: {report['lower_bound_s']:.1f}s   "
                 "(samullm_speedup = this policy's end-to-end time / samullm's; "
                 "proven/opt_gap: a branch and bound's certificate, its makespan / its lower bound - 1)")
    o = report.get("optimal")
    if o is not None:
        lines.append("optimal: proven optimal" if o["proven_optimal"] else
                     f"optimal: NOT proven (time limit), at most {o['optimality_gap']:.1%} above the "
                     f"optimum (lower bound {o['lower_bound_s']:.1f}s)")
    return "\n".join(lines)


def cmd_compare(args) -> int:
    from raycolo.offline.policies import get_policy

    problem = _problem(args)
    if args.policies is not None:
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        if not names:
            raise RaycoloError(f"--policies: no policy named in '{args.policies}'")
        for n in names:
            try:
                get_policy(n)
            except RaycoloError as exc:
                raise RaycoloError(f"--policies: {str(exc).removeprefix('--policy: ')}") from None
    else:
        names = comparable_policies(problem)
    report = run_comparison(problem, names, progress=not args.json)
    print(json.dumps(report, indent=2) if args.json else format_comparison(report))
    return 0


def cmd_run(args) -> int:
    from raycolo.offline.runtime.setup import parse_run_config

    values = {k: v for k, v in vars(args).items() if k not in ("command", "no_progress", "json")}
    if args.command == "run" and args.output is None:
        from raycolo.offline.dag import load_app
        values["output"] = str(Path("out") / load_app(args.dag).name)
    values["progress"] = not args.no_progress
    config = parse_run_config({k: v for k, v in values.items() if v is not None})
    from raycolo.actors.offline.failures import RunFailed
    from raycolo.actors.offline.launch import dump, report_line, run_application
    from raycolo.errors import StoreFull
    try:
        report = run_application(config)
    except (RunFailed, StoreFull) as exc:     # StoreFull: the output directory's disk filled up
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_RUNTIME
    if args.json:
        print(dump(report))
    print(report_line(report))
    return 0


COMMANDS = {"serve": cmd_serve, "online": cmd_online, "simulate-online": cmd_simulate_online, "sweep-online": cmd_sweep_online,
            "plan": cmd_plan, "compare": cmd_compare, "profile": cmd_profile,
            "validate": cmd_validate, "run": cmd_run, "run-dag": cmd_run}


# Flags a command writes to: (dest, is a directory, suffixes, example). Checked before any work.
OUTPUTS = (("gantt", False, "image", "out/gantt.png"), ("plot", False, "image", "out/plot.png"),
           ("save_profile", False, (".json",), "out/profile.json"), ("out", True, (), "out/dir"),
           ("output", True, (), "out/run"))


# Files a command reads from a flag: (dest, what). Checked before any work, with the outputs.
INPUTS = (("trace", "trace file (--trace)"),)


def _check_paths(args) -> None:
    from raycolo.paths import check_input, check_output
    from raycolo.plots import IMAGE_SUFFIXES

    for dest, what in INPUTS:
        if getattr(args, dest, None) is not None:
            check_input(getattr(args, dest), what)

    for dest, directory, suffixes, example in OUTPUTS:
        value = getattr(args, dest, None)
        if isinstance(value, str):
            check_output(value, "--" + dest.replace("_", "-"), directory=directory,
                         suffixes=IMAGE_SUFFIXES if suffixes == "image" else suffixes, example=example)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_paths(args)
        return COMMANDS[args.command](args)
    except RaycoloError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
