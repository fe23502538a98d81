"""The grid the default online policy must hold: every cell, its SLO attainment is at least
every baseline's, and its throughput at least SEPARATE's (within the seeds' spread).

Simulated (raycolo.online.simulation.sim), 4 nodes x 2 stages. Cells: the paper's three
Llama presets (LeMix Figs. 11-12; plus gpt-2.5b, the model of its Figs. 5, 15-16) x four
request rates per model, from light load to past saturation (the rates scale with the
model: one llama-70b node serves ~2 tasks/s, one llama-8b node ~15) x alpha (training
share) in {0.15, 0.5, 0.9} x Poisson and bursty (LogNormal mixture, SIRIUS §6) arrivals x
--seeds seeds. Every policy of a cell runs the same task list.

A cell *holds* when, for each baseline B, median(default SLO) >= median(B SLO) - spread and
median(default throughput) >= median(separate throughput) - spread, where spread is the
larger of the two policies' seed ranges (max - min) over the seeds (0 with one seed).

Prints one table per model (the default's SLO and throughput, the best baseline's, the
margins) and a summary; --plot writes a heat map of the SLO margins (default minus the best
baseline) per model x arrivals, rate across, alpha down.

    .venv/bin/python bench/online_grid.py [--tasks 1000] [--seeds 3] [--jobs 2]
        [--models llama-8b,llama-13b,llama-70b,gpt-2.5b] [--arrivals poisson,bursty]
        [--plot out/online_grid.png] [--json out/bench_online_grid.json]

``make bench-online-grid`` runs it with the defaults (about 30 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path

import yaml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.bounds import describe  # noqa: E402
from raycolo.online.config import OnlineConfig  # noqa: E402
from raycolo.online.lemix_params import LemixParams  # noqa: E402
from raycolo.online.policies import make_online_policy  # noqa: E402
from raycolo.online.profiles import preset  # noqa: E402
from raycolo.online.simulation.sim import simulate  # noqa: E402
from raycolo.online.tasks import bursty_workload, poisson_workload  # noqa: E402
from common import holds_within_spread, write_json  # noqa: E402

NODES, STAGES = 4, 2
DEFAULT = OnlineConfig.model_fields["policy"].default     # the default online policy
PEERS = ("mix-rr", "mix-luf", "separate")          # the paper's baselines: the other policies a user picks
BASELINES = PEERS + ("lemix-noprofile", "lemix-noprioritize", "lemix-nomemory")
ALPHAS = (0.15, 0.5, 0.9)
# light, busy, about saturated, past saturation (tasks/s over the 4 nodes)
RATES = {"llama-8b": (10, 30, 60, 150), "llama-13b": (5, 15, 30, 60), "llama-70b": (1, 3, 7, 15),
         "gpt-2.5b": (10, 50, 100, 150)}
WORKLOADS = {"poisson": poisson_workload, "bursty": bursty_workload}


def run_cell(args: tuple) -> dict:
    """Every policy on one (model, rate, alpha, arrivals, seed) task list."""
    model, rate, alpha, arrivals, seed, tasks, overrides = args
    work = WORKLOADS[arrivals](rate, alpha, tasks, seed=seed)
    profile, params = preset(model, STAGES), LemixParams(**overrides)
    out = {}
    for name in (DEFAULT,) + BASELINES:
        policy = make_online_policy(name, params, nodes=NODES, train_rate=alpha)
        result = simulate(work, profile, NODES, policy, params)
        out[name] = (result.slo_attainment, result.throughput)
    return {"model": model, "rate": rate, "alpha": alpha, "arrivals": arrivals, "seed": seed, "runs": out}


def judge(runs: list[dict]) -> dict:
    """One cell over its seeds: medians, margins and whether it holds (module docstring)."""
    def series(policy, k):
        return [r["runs"][policy][k] for r in runs]

    med = {p: (statistics.median(series(p, 0)), statistics.median(series(p, 1))) for p in runs[0]["runs"]}
    slo_fail = [b for b in BASELINES if not holds_within_spread(series(DEFAULT, 0), series(b, 0))]
    tput_ok = holds_within_spread(series(DEFAULT, 1), series("separate", 1))
    best = max(BASELINES, key=lambda b: med[b][0])
    peer = max(PEERS, key=lambda b: med[b][0])
    return {"median": med, "best_baseline": best, "slo_margin": med[DEFAULT][0] - med[best][0],
            "best_peer": peer, "peer_margin": med[DEFAULT][0] - med[peer][0],
            "tput_vs_separate": med[DEFAULT][1] / med["separate"][1] if med["separate"][1] else float("inf"),
            "slo_losers_to": slo_fail, "tput_ok": bool(tput_ok), "holds": bool(not slo_fail and tput_ok)}


def table(model: str, cells: dict) -> list[str]:
    lines = [f"\n### {model} ({NODES} x {STAGES}, SLO attainment / throughput in tasks/s, medians)\n",
             f"| arrivals | rate | α | {DEFAULT} | best of mix-rr, mix-luf, separate | margin | best of all "
             "baselines | margin | separate tput | tput ratio | holds |",
             "|---|---:|---:|---|---|---:|---|---:|---:|---:|---|"]
    for (m, arrivals, rate, alpha), c in sorted(cells.items()):
        if m != model:
            continue
        d, b, q = c["median"][DEFAULT], c["median"][c["best_baseline"]], c["median"][c["best_peer"]]
        why = "yes" if c["holds"] else "no: " + ", ".join(
            [f"SLO < {x}" for x in c["slo_losers_to"]] + ([] if c["tput_ok"] else ["tput < separate"]))
        lines.append(f"| {arrivals} | {rate:g} | {alpha:g} | {d[0]:.3f} / {d[1]:.2f} | {c['best_peer']} "
                     f"{q[0]:.3f} / {q[1]:.2f} | {c['peer_margin']:+.3f} | {c['best_baseline']} "
                     f"{b[0]:.3f} / {b[1]:.2f} | {c['slo_margin']:+.3f} | {c['median']['separate'][1]:.2f} | "
                     f"{c['tput_vs_separate']:.2f}x | {why} |")
    return lines


def summary(cells: dict, models: list[str], arrivals: list[str]) -> list[str]:
    """One row per model and arrival process: cells held, the SLO margins over the best of
    mix-rr, mix-luf and separate, and the throughput against separate."""
    lines = [f"\n### Summary ({DEFAULT}; margins in SLO attainment, medians over the seeds)\n",
             "| model | arrivals | cells held | SLO margin over the best of mix-rr, mix-luf, separate: min / median / "
             "max | at the highest rate | throughput / separate: min - max |",
             "|---|---|---:|---|---:|---|"]
    for m in models:
        for arr in arrivals:
            cs = [c for (mm, a, _, _), c in cells.items() if mm == m and a == arr]
            if not cs:
                continue
            margins = sorted(c["peer_margin"] for c in cs)
            top = [c["peer_margin"] for (mm, a, r, _), c in cells.items() if mm == m and a == arr and r == max(RATES[m])]
            ratios = [c["tput_vs_separate"] for c in cs]
            lines.append(f"| {m} | {arr} | {sum(c['holds'] for c in cs)} / {len(cs)} | {margins[0]:+.3f} / "
                         f"{statistics.median(margins):+.3f} / {margins[-1]:+.3f} | {statistics.median(top):+.3f} | "
                         f"{min(ratios):.2f}x - {max(ratios):.2f}x |")
    return lines


def heat_map(cells: dict, models: list[str], arrivals: list[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(arrivals), len(models), figsize=(3.2 * len(models), 2.8 * len(arrivals)),
                             squeeze=False)
    for i, arr in enumerate(arrivals):
        for j, model in enumerate(models):
            rates = RATES[model]
            grid = np.array([[cells[(model, arr, r, a)]["peer_margin"] for r in rates] for a in ALPHAS])
            ax = axes[i][j]
            ax.imshow(grid, cmap="RdYlGn", vmin=-0.5, vmax=0.5, aspect="auto")
            for y, a in enumerate(ALPHAS):
                for x, r in enumerate(rates):
                    mark = "" if cells[(model, arr, r, a)]["holds"] else "✗"
                    ax.text(x, y, f"{grid[y, x]:+.2f}{mark}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(rates)), [str(r) for r in rates])
            ax.set_yticks(range(len(ALPHAS)), [str(a) for a in ALPHAS])
            ax.set_title(f"{model}, {arr}", fontsize=9)
            ax.set_xlabel("rate (tasks/s)", fontsize=8)
            ax.set_ylabel("α", fontsize=8)
    fig.suptitle(f"SLO attainment: {DEFAULT} minus the best of mix-rr, mix-luf, separate "
                 "(✗: the cell does not hold against every baseline)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--models", default="llama-8b,llama-13b,llama-70b,gpt-2.5b")
    ap.add_argument("--arrivals", default="poisson,bursty")
    ap.add_argument("--alphas", default=",".join(map(str, ALPHAS)))
    ap.add_argument("--plot", default="out/online_grid.png")
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-json", default=None, help="print and plot the runs of an earlier --json, run nothing")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a LemixParams field for every policy of the grid (YAML value), e.g. backlog_aware=false")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in LemixParams.model_fields:
            ap.error(f"--set {item!r}: expected KEY=VALUE with KEY a LemixParams field")
        overrides[key] = yaml.safe_load(value)
    try:
        LemixParams(**overrides)
    except ValidationError as exc:
        ap.error(f"--set {describe(exc)}")
    models, arrivals = args.models.split(","), args.arrivals.split(",")
    alphas = tuple(float(a) for a in args.alphas.split(","))
    for m in models:
        if m not in RATES:
            ap.error(f"--models: no rates for {m!r} (choose {', '.join(RATES)})")
    jobs = [(m, r, a, arr, s, args.tasks, overrides) for m in models for arr in arrivals for r in RATES[m]
            for a, s in product(alphas, range(args.seeds))]
    started = time.perf_counter()
    results = []
    if args.from_json:
        import json

        results = json.loads(Path(args.from_json).read_text())["runs"]
        jobs = [j for j in jobs if any((r["model"], r["rate"], r["alpha"], r["arrivals"], r["seed"]) == j[:5]
                                       for r in results)]
        results = [r for r in results if r["model"] in models and r["arrivals"] in arrivals and r["alpha"] in alphas]
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for k, res in enumerate(pool.map(run_cell, jobs), 1):
                results.append(res)
                if k % 10 == 0 or k == len(jobs):
                    print(f"  {k}/{len(jobs)} cells x seeds, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    by_cell: dict = {}
    for r in results:
        by_cell.setdefault((r["model"], r["arrivals"], r["rate"], r["alpha"]), []).append(r)
    cells = {key: judge(runs) for key, runs in by_cell.items()}
    print(f"# Online grid: {DEFAULT} against {', '.join(BASELINES)}")
    print(f"{args.tasks} tasks, seeds 0..{args.seeds - 1}, {NODES} x {STAGES}"
          + (f", {', '.join(args.set)}" if args.set else "") + "; "
          f"{time.perf_counter() - started:.0f} s on {args.jobs} processes")
    for m in models:
        print("\n".join(table(m, cells)))
    print("\n".join(summary(cells, models, arrivals)))
    held = sum(c["holds"] for c in cells.values())
    print(f"\n**{held} of {len(cells)} cells hold** (SLO >= every baseline's, throughput >= separate's, "
          "within the seeds' spread).")
    for key, c in sorted(cells.items()):
        if not c["holds"]:
            print(f"- does not hold: {key}: SLO below {c['slo_losers_to'] or '-'}; "
                  f"throughput vs separate {c['tput_vs_separate']:.2f}x")
    if args.plot and set(alphas) == set(ALPHAS):
        heat_map(cells, models, arrivals, args.plot)
        print(f"\nheat map: {args.plot}")
    if args.json:
        write_json(args.json, {"cells": [{"model": k[0], "arrivals": k[1], "rate": k[2], "alpha": k[3],
                                          **{x: y for x, y in v.items() if x != "median"},
                                          "median": {p: {"slo": s, "throughput": t} for p, (s, t) in
                                                     v["median"].items()}} for k, v in sorted(cells.items())],
                               "runs": results})
    return 0 if held == len(cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
