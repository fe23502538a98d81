"""gpu-check's entry: the rows' registry, running them, the table and ``main``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from typing import Callable

from raycolo.gpu_check.common import FAIL, CheckFailed, Row
from raycolo.gpu_check.engine_checks import check_device_stats, check_torch_engine, check_vllm
from raycolo.gpu_check.executor_checks import (check_executor_decode, check_executor_graphs,
                                                      check_executor_slices, check_executor_whole,
                                                      check_executor_windows)
from raycolo.gpu_check.kernel_checks import check_executor_triton, check_stage_graphs, check_tp
from raycolo.gpu_check.sampler_checks import check_sampler
from raycolo.gpu_check.stage_checks import check_stage_inproc, check_stage_p2p, check_stage_versions

CHECKS: dict[str, Callable] = {
    "executor.whole": check_executor_whole,
    "executor.slices": check_executor_slices,
    "executor.windows": check_executor_windows,
    "executor.decode": check_executor_decode,
    "executor.graphs": check_executor_graphs,
    "executor.triton": check_executor_triton,
    "torch_engine": check_torch_engine,
    "sampler": check_sampler,
    "stage.inproc": check_stage_inproc,
    "stage.p2p": check_stage_p2p,
    "stage.graphs": check_stage_graphs,
    "stage.versions": check_stage_versions,
    "device_stats": check_device_stats,
    "vllm": check_vllm,
    "tp": check_tp,        # last: ranks that hang would hold up only this row
}


def run_checks(device, only=None, log=print, on_row=None) -> list[Row]:
    """Every check (or those in ``only``) in turn; ``on_row(rows so far)`` after each."""
    rows = []
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            row = fn(device)
        except Exception as exc:   # noqa: BLE001 - every failure is a row, the rest still run
            msg = str(exc).strip().splitlines()
            row = Row(name, FAIL, {}, f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300])
            if not isinstance(exc, CheckFailed):
                traceback.print_exc(limit=4, file=sys.stderr)
        row.seconds = round(time.perf_counter() - started, 1)
        rows.append(row)
        log(f"  {row.path}: {row.result} ({row.seconds} s)")
        if on_row is not None:
            on_row(rows)
    return rows


def table(rows: list[Row]) -> str:
    cells = [("path", "result", "figures")] + [(r.path, r.result, r.figures_text()) for r in rows]
    w0 = max(len(c[0]) for c in cells)
    w1 = max(len(c[1]) for c in cells)
    lines = [f"{a:<{w0}} | {b:<{w1}} | {c}" for a, b, c in cells]
    lines.insert(1, f"{'-' * w0}-+-{'-' * w1}-+-{'-' * 40}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycolo.gpu_check",
                                     description="Run raycolo's CUDA paths against independent references.")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto/cuda: the first CUDA device (skipped without one); cpu: a dry run "
                             "of the same checks on the CPU")
    parser.add_argument("--only", default="", help=f"comma-separated rows ({', '.join(CHECKS)})")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown rows {unknown}")

    import torch

    if args.device == "cpu":
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("skipped: no CUDA device")
        print(f"(torch {torch.__version__}: "
              f"{'built without CUDA' if torch.version.cuda is None else 'no device visible'})", file=sys.stderr)
        if args.json:
            _write_json(args.json, {"device": None, "skipped": "no CUDA device", "rows": []})
        return 0
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu-check on {name} (torch {torch.__version__}, {torch.cuda.device_count() if device.type == 'cuda' else 0} "
          f"CUDA devices)", flush=True)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)    # a dry run: one thread never spins against a busy machine
    started = time.perf_counter()

    def dump(rows: list[Row], complete: bool) -> None:
        """The JSON, rewritten after every row: a run cut off by a time limit keeps its rows."""
        if args.json:
            _write_json(args.json, {"device": name, "torch": torch.__version__, "complete": complete,
                                    "rows": [asdict(r) for r in rows]})

    try:
        rows = run_checks(device, only, log=lambda s: print(s, flush=True), on_row=lambda rows: dump(rows, False))
    finally:
        torch.set_num_threads(threads)
    print()
    print(table(rows))
    failed = [r.path for r in rows if r.result == FAIL]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} rows passed or skipped in "
          f"{time.perf_counter() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    dump(rows, True)
    return 1 if failed else 0


def _write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
