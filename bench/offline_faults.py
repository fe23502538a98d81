"""Offline faults: kill engine actors mid-run, kill the driver and resubmit, then count.

    .venv/bin/python bench/offline_faults.py [--dag examples/tiny_routing.yaml] [--requests 96]
                                              [--kills 3] [--seed 0] [--json out/bench_offline_faults.json]

Three runs of ``raycolo run DAG --profile cpu --gpus 2`` on the embedded local cluster,
each into its own ``--output``:

1. **baseline**: no fault; its outputs are the reference.
2. **engine kills**: ``--kills`` engine-actor processes are SIGKILLed at seeded random
   points between 20 % and 80 % of the baseline's duration (the controller restarts a
   replica and re-runs the requests it had in flight).
3. **driver kill + resubmit**: the driver's whole process group (the driver and the local
   Ray cluster it started) is SIGKILLed once its journal holds 40 % of the outputs; the
   same command is then run again with the same ``--output`` and resumes.

For each: requests lost (in the baseline, not in outputs.parquet; must be 0), outputs
duplicated in outputs.parquet (must be 0), outputs whose text differs from the baseline's
(the runs are seeded), and the extra wall time against the baseline.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd

from common import pids_titled, write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("out/bench-offline-faults")


def command(args, output: Path) -> list[str]:
    return [sys.executable, "-m", "raycolo.cli", "run", args.dag, "--profile", "cpu", "--gpus", "2",
            "--requests", str(args.requests), "--seed", str(args.seed), "--max-restarts", str(args.kills + 1),
            "--output", str(output), "--no-progress"]


def run(cmd: list[str], on_start=None) -> tuple[int, float]:
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if on_start:
        on_start(proc)
    _, err = proc.communicate(timeout=1800)
    if proc.returncode not in (0, -signal.SIGKILL):
        tail = [line for line in err.splitlines() if "WARNING" not in line][-3:]
        print(f"exit {proc.returncode}: " + " | ".join(tail), file=sys.stderr)
    return proc.returncode, time.perf_counter() - started


def count(output: Path, reference: pd.DataFrame) -> dict:
    if not (output / "outputs.parquet").exists():
        return {"outputs": 0, "lost": len(reference), "duplicated": 0, "text_differs": 0}
    table = pd.read_parquet(output / "outputs.parquet")
    ref = reference.set_index("key")["text"]
    got = table.drop_duplicates("key").set_index("key")["text"]
    common = ref.index.intersection(got.index)
    return {"outputs": len(table), "lost": int(len(ref.index.difference(got.index))),
            "duplicated": int(table["key"].duplicated().sum()),
            "text_differs": int((ref.loc[common] != got.loc[common]).sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dag", default="examples/tiny_routing.yaml")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="out/bench_offline_faults.json")
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)

    print("baseline ...", file=sys.stderr, flush=True)
    _, base_s = run(command(args, OUT / "baseline"))
    reference = pd.read_parquet(OUT / "baseline" / "outputs.parquet")

    rng = random.Random(args.seed)
    points = sorted(rng.uniform(0.2, 0.8) * base_s for _ in range(args.kills))
    killed: list[dict] = []

    def killer(proc):
        def loop():
            started = time.perf_counter()
            for at in points:
                while time.perf_counter() - started < at and proc.poll() is None:
                    time.sleep(0.05)
                while proc.poll() is None:          # an engine may be between replicas
                    pids = pids_titled("ray::EngineActor")
                    if pids:
                        pid = rng.choice(pids)
                        os.kill(pid, signal.SIGKILL)
                        killed.append({"at_s": time.perf_counter() - started, "pid": pid})
                        break
                    time.sleep(0.1)
        threading.Thread(target=loop, daemon=True).start()

    print(f"engine kills at {', '.join(f'{p:.1f}' for p in points)} s ...", file=sys.stderr, flush=True)
    rc, kills_s = run(command(args, OUT / "kills"), killer)
    kills = {"exit": rc, "seconds": kills_s, "killed": killed, **count(OUT / "kills", reference)}

    journal = OUT / "driver" / "outputs.jsonl"
    cut = {}

    def kill_driver(proc):
        def loop():
            started = time.perf_counter()
            while proc.poll() is None:
                lines = journal.read_text().count("\n") if journal.exists() else 0
                if lines >= 0.4 * len(reference):
                    os.killpg(proc.pid, signal.SIGKILL)
                    cut.update(at_s=time.perf_counter() - started, journal=lines)
                    return
                time.sleep(0.05)
        threading.Thread(target=loop, daemon=True).start()

    print("driver kill ...", file=sys.stderr, flush=True)
    rc1, first_s = run(command(args, OUT / "driver"), kill_driver)
    time.sleep(2)
    print("resubmit ...", file=sys.stderr, flush=True)
    rc2, second_s = run(command(args, OUT / "driver"))
    driver = {"exit_killed": rc1, "exit_resumed": rc2, "killed_after_s": cut.get("at_s"),
              "journal_at_kill": cut.get("journal"), "seconds": first_s + second_s,
              "resumed_s": second_s, **count(OUT / "driver", reference)}

    report = {"config": vars(args), "baseline_s": base_s, "requests": len(reference),
              "engine_kills": kills, "driver_kill": driver}
    write_json(args.json, report)
    print(f"\n{args.dag}, {len(reference)} outputs; baseline {base_s:.1f} s\n")
    print("| fault | exit | wall s | extra s | lost | duplicated | text differs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    at = ", ".join(f"{k['at_s']:.1f}" for k in killed)
    print(f"| {len(killed)} engine actors SIGKILLed (at {at} s) | "
          f"{rc} | {kills_s:.1f} | {kills_s - base_s:+.1f} | {kills['lost']} | {kills['duplicated']} | "
          f"{kills['text_differs']} |")
    print(f"| driver SIGKILLed at {cut.get('at_s', float('nan')):.1f} s ({cut.get('journal')} outputs journaled), "
          f"resubmitted | {rc2} | {first_s:.1f} + {second_s:.1f} | {first_s + second_s - base_s:+.1f} | "
          f"{driver['lost']} | {driver['duplicated']} | {driver['text_differs']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
