"""Runtime benchmark: real runs of tiny applications on a local Ray cluster.

    .venv/bin/python bench/runtime.py [--repeats 3] [--gpus 2]

Measures, on a local cluster with logical GPUs and the shipped CPU profiles:

1. the planner's predicted makespan against the executed makespan (samullm plans);
2. the samullm plan against the max and min heuristics, each executed for real on the
   same application and requests (end-to-end ratios, planning included);
3. the runtime's own overhead: controller time per request, decision time and drain
   time per stage switch, and how long a replica takes to start.

Each run starts its warm pool of engine actors before planning (one per GPU) and plans
with the times that pool measured (cold start, warm swap, wake, keep: low medians) and the
compute scale its probes measured against the profiles, as ``raycolo run`` does; ``--replica-start-s`` plans every run with one given time instead
(no pre-started pool). Figures are medians over ``--repeats``; the machine is shared and
noisy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.actors.offline.launch import run_application  # noqa: E402
from raycolo.offline.planner.engines import SWITCH_KINDS  # noqa: E402
from raycolo.offline.runtime.setup import RunConfig  # noqa: E402

PREDICTION_APPS = ("tiny.yaml", "tiny_chain.yaml")
POLICY_APP = "tiny.yaml"
POLICIES = ("samullm", "samullm-search", "max", "min")


UNPARKED = "samullm, no parking"   # the samullm run of POLICY_APP with --parked-engines 0
PARKED_DEFAULT = RunConfig.model_fields["parked_engines"].default


def _run(app: str, policy: str, gpus: int, start_s: float, requests, workdir: Path, tag: str,
         parked: int = PARKED_DEFAULT) -> dict:
    config = RunConfig(dag=str(ROOT / "examples" / app), output=str(workdir / tag), profile="cpu",
                       policy=policy, gpus=gpus, nvlink_group=1, replica_start_s=start_s,
                       requests=requests, progress=False, gantt=False, parked_engines=parked)
    started = time.perf_counter()
    report = run_application(config, log=lambda m: None)
    report["end_to_end_s"] = time.perf_counter() - started
    assert report["requests_done"] == report["requests_total"], tag
    return report


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--requests", type=int, default=None, help="override every source's count")
    parser.add_argument("--replica-start-s", type=float, default=None,
                        help="plan with this replica start time (default: each run's pool measures it)")
    args = parser.parse_args(argv)

    ray.init(address="local", num_gpus=args.gpus, num_cpus=args.gpus + 2, include_dashboard=False,
             log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        start_s = args.replica_start_s
        print(f"local cluster: {args.gpus} logical GPUs; replica start: "
              + (f"{start_s:.2f}s (given)" if start_s is not None else "measured by each run's warm pool") + "\n")

        runs: dict[tuple[str, str], list[dict]] = {}
        # (app, label in the tables, policy, parked engines)
        jobs = [(app, "samullm", "samullm", PARKED_DEFAULT) for app in PREDICTION_APPS]
        jobs += [(POLICY_APP, p, p, PARKED_DEFAULT) for p in POLICIES if p != "samullm"]
        jobs.append((POLICY_APP, UNPARKED, "samullm", 0))
        for r in range(args.repeats):
            for app, label, policy, parked in jobs:
                tag = f"{Path(app).stem}-{policy}-parked{parked}-{r}"
                report = _run(app, policy, args.gpus, start_s, args.requests, workdir, tag, parked)
                runs.setdefault((app, label), []).append(report)
                print(f"  run {tag}: predicted {report['predicted_makespan_s']:.1f}s, "
                      f"actual {report['actual_makespan_s']:.1f}s", flush=True)
    ray.shutdown()

    print("\n1. Predicted vs actual makespan (samullm plan, median over repeats). 'error' is the plan's")
    print("   prediction, with the compute scales each run's pool measured; 'profiles only' replays the")
    print("   same plan on the shipped profiles as they are (switch costs measured in both)")
    print(f"{'application':<18} {'requests':>8} {'predicted_s':>11} {'actual_s':>9} {'error':>8} "
          f"{'profiles only':>13}  errors per run")
    for app in PREDICTION_APPS:
        reps = runs[(app, "samullm")]
        errors = [r["prediction_error"] for r in reps]
        print(f"{Path(app).stem:<18} {reps[0]['requests_total']:>8} "
              f"{_median(r['predicted_makespan_s'] for r in reps):>11.1f} "
              f"{_median(r['actual_makespan_s'] for r in reps):>9.1f} {_median(errors):>+8.1%} "
              f"{_median(r['profile_only_error'] for r in reps):>+13.1%}  "
              + ", ".join(f"{e:+.1%}" for e in errors))
    scales: dict[str, list[float]] = {}
    for reps in runs.values():
        for r in reps:
            for model, entry in ((r.get("compute_scales") or {}).get("models") or {}).items():
                if entry["scale"] is not None:
                    scales.setdefault(model, []).append(entry["scale"])
    if scales:
        print("compute scale (measured / profile, median over runs): "
              + ", ".join(f"{m} x{_median(v):.2f}" for m, v in sorted(scales.items())))

    print(f"\n2. Policies executed for real on {Path(POLICY_APP).stem} (median makespan; ratio = policy / samullm)")
    print(f"{'policy':<15} {'predicted_s':>11} {'actual_s':>9} {'end_to_end_s':>12} {'ratio':>7} {'stages':>6} {'restarts':>8}")
    base = _median(r["actual_makespan_s"] for r in runs[(POLICY_APP, "samullm")])
    for policy in POLICIES:
        reps = runs[(POLICY_APP, policy)]
        actual = _median(r["actual_makespan_s"] for r in reps)
        print(f"{policy:<15} {_median(r['predicted_makespan_s'] for r in reps):>11.1f} {actual:>9.1f} "
              f"{_median(r['end_to_end_s'] for r in reps):>12.1f} {actual / base:>7.2f} "
              f"{len(reps[0]['actual_stages']):>6} {sum(r['restarts'] for r in reps):>8}")

    print("\n3. Runtime overhead (all runs)")
    everything = [r for reps in runs.values() for r in reps]
    per_request = _median(r["overhead"]["per_request_ms"] for r in everything)
    decision = _median(r["overhead"]["switch_decision_ms_median"] for r in everything)
    drain = _median(r["overhead"]["switch_stop_s_median"] for r in everything)
    start = _median(r["overhead"]["replica_start_s_median"] for r in everything)
    print(f"controller + communicator per request: {per_request:.2f} ms (median over {len(everything)} runs)")
    print(f"per stage switch: decision {decision:.2f} ms, draining preempted replicas {1e3 * drain:.0f} ms, "
          f"replica start {start:.2f} s")
    print("\n4. Giving a GPU a model (median over runs)")
    print(f"{'way':<6} {'pool probe_s':>12} {'replicas':>8} {'in runs_s':>10}")
    for kind in SWITCH_KINDS:
        probed = _median((r.get("switch_costs") or {}).get(kind, {}).get("estimate_s") for r in everything)
        counts = sum(r["overhead"]["replica_switches"][kind]["count"] for r in everything)
        in_runs = _median(r["overhead"]["replica_switches"][kind]["median_s"] for r in everything)
        print(f"{kind:<6} {probed:>12.3f} {counts:>8} {in_runs:>10.3f}")
    busy = _median(r["gpu_busy_fraction"] for r in runs[(POLICY_APP, "samullm")])
    print(f"GPU busy fraction ({Path(POLICY_APP).stem}, samullm, median): {busy:.2f}")

    print(f"\n5. Parked engines ({Path(POLICY_APP).stem}, samullm, median over repeats): a swap to a model the")
    print("   actor parked asleep is a wake; --parked-engines 0 releases every old engine instead")
    print(f"{'parked engines':<15} {'actual_s':>9} {'busy':>6} {'swaps':>6} {'wakes':>6} {'swap_s':>7} {'wake_s':>7}")
    for label, key in ((f"{PARKED_DEFAULT} (default)", "samullm"), ("0", UNPARKED)):
        reps = runs[(POLICY_APP, key)]
        sw = [r["overhead"]["replica_switches"] for r in reps]
        print(f"{label:<15} {_median(r['actual_makespan_s'] for r in reps):>9.2f} "
              f"{_median(r['gpu_busy_fraction'] for r in reps):>6.2f} "
              f"{_median(s['swap']['count'] for s in sw):>6.0f} {_median(s['wake']['count'] for s in sw):>6.0f} "
              f"{_median(s['swap']['median_s'] for s in sw):>7.3f} {_median(s['wake']['median_s'] for s in sw):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
