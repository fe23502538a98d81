"""Cost-model calibration benchmark: predicted vs measured run times on this machine.

Runs ``raycolo validate`` for the tiny models and a 2-model application against a
profile directory (default: the shipped CPU profiles), ``--repeats`` times, and prints
each case's median error and the MAPE. SamuLLM reports about 6 % on A100s, Vidur < 9 %.

    .venv/bin/python bench/costmodel.py [--profile cpu] [--repeats 3] [--requests 48]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.offline.calibration import TINY_MODELS, validate  # noqa: E402
from raycolo.offline.costmodel.latency import resolve_profile_dir  # noqa: E402
from common import write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    profile_dir = resolve_profile_dir(args.profile)
    started = time.perf_counter()
    runs = []
    for r in range(args.repeats):
        runs.append(validate(profile_dir, TINY_MODELS, args.requests, seed=4242 + r, threads=args.threads,
                             progress=lambda m: print(f"[run {r + 1}/{args.repeats}] {m}", file=sys.stderr)))
    names = [c["name"] for c in runs[0]["cases"]]
    print(f"Cost model vs torch engine, profile {profile_dir}, {args.threads} thread(s), "
          f"{args.repeats} runs with different request seeds")
    print("| case | predicted s | measured s | error | errors per run | known-lengths error | per run |")
    print("|---|---:|---:|---:|---|---:|---|")
    for i, name in enumerate(names):
        cases = [run["cases"][i] for run in runs]
        errors = [c["error"] for c in cases]
        known = [c["error_known_lengths"] for c in cases]
        print(f"| {name} | {statistics.median(c['predicted_s'] for c in cases):.2f} "
              f"| {statistics.median(c['measured_s'] for c in cases):.2f} "
              f"| {statistics.median(errors):+.1%} | {', '.join(f'{e:+.1%}' for e in errors)} "
              f"| {statistics.median(known):+.1%} | {', '.join(f'{e:+.1%}' for e in known)} |")
    mapes = [run["mape"] for run in runs]
    known_mapes = [run["mape_known_lengths"] for run in runs]
    print(f"\nMAPE (sampled output lengths, the planner's prediction) per run: "
          f"{', '.join(f'{m:.1%}' for m in mapes)}; median {statistics.median(mapes):.1%} (target <= 10%)")
    print(f"MAPE (output lengths the engine produced) per run: "
          f"{', '.join(f'{m:.1%}' for m in known_mapes)}; median {statistics.median(known_mapes):.1%}")
    print(f"benchmark wall time {time.perf_counter() - started:.0f}s")
    if args.json:
        write_json(args.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
