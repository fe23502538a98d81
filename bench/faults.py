"""Online faults under load: kill one part of a live deployment at a time, then count.

    .venv/bin/python bench/faults.py [--config examples/online.yaml] [--rate 3] [--gap 40] [--replicas 2]
                                      [--faults stage_worker,train_controller,controller,serve_replica]
                                      [--json out/bench_faults.json]

One local deployment behind its HTTP front (the config's nodes x stages, tiny model on
CPU, ``resume: true``) serves a steady open-loop load of streamed completions from a
separate process on loopback (bench/serve_load.py, ``--rate`` per second) while two
training samples are posted every second. Every ``--gap`` seconds one fault is injected:

- ``stage_worker``: SIGKILL a stage worker (Ray Train restarts its node's worker group);
- ``train_controller``: SIGKILL a node's Ray Train controller, the process that owns the
  node's worker group (the node schedulers themselves run inside the deployment's
  controller, so this is the node-level process that can die on its own);
- ``controller``: ``ray.kill`` the deployment's controller (Ray restarts it; it resumes
  from the adapter checkpoints and the sample store);
- ``serve_replica``: SIGKILL the HTTP front's Serve replica (Serve replaces it).

For each fault: the time until a completion succeeds again (probed every 0.25 s) and
until every node's worker group is complete again (health "ok", no restart under way), the
requests that started in its window by outcome (done, shed, error, cut: the stream ended
with neither [DONE] nor an error, timeout: hung), and the adapter version before the
fault, the last committed checkpoint and the version after recovery. At the end, the
acknowledged training samples never trained (must be 0) and those the adapters keep more
than once, from the controller's ledger.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from common import pids_titled, write_json
from serve import ROOT, free_port

FAULTS = ("stage_worker", "train_controller", "controller", "serve_replica")
OUT = "out/bench-faults"


def inject(fault: str, controller, app: str) -> str:
    import ray

    if fault == "stage_worker":
        reg = ray.get(controller.registry.remote())
        key = sorted(reg)[-1]
        os.kill(reg[key]["pid"], signal.SIGKILL)
        return key
    if fault == "train_controller":
        pids = pids_titled("ray::TrainController")
        os.kill(pids[0], signal.SIGKILL)
        return f"pid {pids[0]} (of {len(pids)})"
    if fault == "controller":
        ray.kill(controller, no_restart=False)
        return "ray.kill(no_restart=False)"
    if fault == "serve_replica":
        pids = pids_titled(f"ray::ServeReplica:{app}")
        os.kill(pids[0], signal.SIGKILL)
        return f"pid {pids[0]}"
    raise ValueError(f"--faults: unknown fault '{fault}' (known: {', '.join(FAULTS)})")


class Samples(threading.Thread):
    """Posts two training samples every second; keeps the ids the service acknowledged."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.halt = url, threading.Event()
        self.acked: list[int] = []
        self.refused: list[tuple[float, str]] = []      # (when, the status or the client's error)

    def run(self) -> None:
        i = 0
        with httpx.Client(base_url=self.url, timeout=30) as h:
            while not self.halt.is_set():
                try:
                    r = h.post("/v1/train_samples", json={"samples": [
                        {"prompt": f"fault {i}.{k}: copy abc", "completion": "abc abc"} for k in range(2)]})
                    if r.status_code == 200:
                        self.acked += r.json()["ids"]
                    else:
                        self.refused.append((time.time(), str(r.status_code)))
                except httpx.HTTPError as exc:
                    self.refused.append((time.time(), type(exc).__name__))
                i += 1
                self.halt.wait(1.0)


def status(url: str) -> dict:
    try:
        r = httpx.get(f"{url}/v1/train_samples/status", timeout=10)
        return r.json() if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def recover(url: str, model: str, since: float, limit_s: float) -> float | None:
    """Seconds from ``since`` until a completion succeeds (None: not within ``limit_s``)."""
    while time.time() - since < limit_s:
        try:
            r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "probe", "max_tokens": 2,
                                                         "ignore_eos": True}, timeout=15)
            if r.status_code == 200:
                return time.time() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return None


def whole(controller_name: str, since: float, limit_s: float, before: dict, fault: str) -> float | None:
    """Seconds from ``since`` until every node's worker group is complete again: health
    "ok", no worker-group restart under way, every stage registered, and the processes the
    fault took replaced (``before``: the registry before it): the killed stage worker; all
    stages of one node (its Ray Train controller); all of them (the controller)."""
    import ray

    from raycolo.actors.local_cluster import NAMESPACE

    def replaced(reg: dict) -> bool:
        new = {k for k in before if k in reg and reg[k]["pid"] != before[k]["pid"]}
        nodes = {k.split("/")[0] for k in before}
        if fault == "stage_worker":
            return sorted(before)[-1] in new
        if fault == "train_controller":
            return any(all(k in new for k in before if k.startswith(n + "/")) for n in nodes)
        if fault == "controller":    # the groups outlived it (registered again) or were made anew
            return all(k in new or reg[k].get("rejoined") for k in before if k in reg)
        return True

    while time.time() - since < limit_s:
        try:
            controller = ray.get_actor(controller_name, namespace=NAMESPACE)
            health = ray.get(controller.health.remote(), timeout=10)
            stats = ray.get(controller.stats.remote(), timeout=10)
            reg = ray.get(controller.registry.remote(), timeout=10)
            if (health["status"] == "ok" and replaced(reg) and len(reg) == len(before)
                    and all(r.get("back_s") is not None or r["down"] for r in stats["restarts"])):
                return time.time() - since
        except Exception:      # the controller is restarting
            pass
        time.sleep(0.1)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "online.yaml"))
    ap.add_argument("--rate", type=float, default=3.0, help="completions per second (Poisson)")
    ap.add_argument("--gap", type=float, default=40.0, help="seconds between faults")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=2,
                    help="HTTP ingress replicas (serve.replicas): a replica's death costs no request with two")
    ap.add_argument("--json", default="out/bench_faults.json")
    args = ap.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    for f in faults:
        if f not in FAULTS:
            print(f"error: --faults: unknown fault '{f}' (known: {', '.join(FAULTS)})", file=sys.stderr)
            return 2

    import ray

    from raycolo.actors.serve import launch as serve_launch
    from raycolo.actors.local_cluster import NAMESPACE, controller_name as online_controller_name
    from raycolo.online.config import load_online_config

    shutil.rmtree(OUT, ignore_errors=True)
    base = load_online_config(args.config)
    app = "bench-faults"
    config = base.model_copy(update={
        "resume": True, "sample_store": f"{OUT}/samples", "storage_path": f"{OUT}/checkpoints",
        "serve": base.serve.model_copy(update={"port": free_port(), "app_name": app, "replicas": args.replicas})})
    started_ray, _ = serve_launch.init_ray(config)
    model = config.served_model_name()
    events_file = Path(OUT) / "requests.jsonl"
    try:
        print(f"starting {config.nodes} x {config.stages} ...", file=sys.stderr, flush=True)
        url = serve_launch.start(config)
        name = online_controller_name(app)
        controller = ray.get_actor(name, namespace=NAMESPACE)
        seconds = args.gap * (len(faults) + 1)
        load = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", url,
                                 "--model", model, "--rate", str(args.rate), "--seconds", str(seconds),
                                 "--max-tokens", str(args.max_tokens), "--timeout", "120",
                                 "--events", str(events_file)], stdout=subprocess.PIPE, text=True)
        samples = Samples(url)
        samples.start()
        t0 = time.time()
        rows = []
        for k, fault in enumerate(faults):
            time.sleep(max(0.0, t0 + args.gap * (k + 1) - time.time()))
            before = status(url)
            registry = ray.get(controller.registry.remote())
            at = time.time()
            what = inject(fault, controller, app)
            print(f"[{at - t0:5.1f} s] {fault}: {what}", file=sys.stderr, flush=True)
            back = recover(url, model, at, args.gap * 3)
            full = whole(name, at, args.gap * 3, registry, fault)
            controller = ray.get_actor(name, namespace=NAMESPACE)
            after = status(url)
            print(f"          serving again after {back} s, every worker group back after {full} s",
                  file=sys.stderr, flush=True)
            timeline = None
            if fault == "controller":        # where the restart's time went
                timeline = restart_timeline(ray.get(controller.stats.remote())["start_timeline"], at)
                print("          " + timeline["line"], file=sys.stderr, flush=True)
            rows.append({"start_timeline": timeline, "fault": fault, "what": what, "at_s": at - t0, "recovery_s": back, "whole_s": full,
                         "version_before": before.get("adapter_version"),
                         "checkpoint_before": (before.get("last_checkpoint") or {}).get("version"),
                         "version_after": after.get("adapter_version"), "resumed": after.get("resumed")})
        out, _ = load.communicate(timeout=seconds * 5 + 300)
        samples.halt.set()
        samples.join()
        totals = json.loads(out.strip().splitlines()[-1])
        deadline = time.time() + 180          # the acknowledged samples finish training
        while time.time() < deadline and status(url).get("pending", 1) > 0:
            time.sleep(1)
        ray.get(controller.drain.remote())
        ledger = ray.get(controller.sample_ledger.remote())
        trained = {int(k): v for k, v in ledger["trained"].items()}
        never = [seq for seq in samples.acked if trained.get(seq, 0) == 0]
        twice = [seq for seq in samples.acked if trained.get(seq, 0) > 1]
        events = [json.loads(line) for line in events_file.read_text().splitlines()]
        starts = [t0 + r["at_s"] for r in rows] + [float("inf")]
        for i, row in enumerate(rows):
            window = [e for e in events if starts[i] <= _window_time(e) < starts[i + 1]]
            row["requests"] = _outcomes(window, args.max_tokens)
        baseline = _outcomes([e for e in events if _window_time(e) < starts[0]], args.max_tokens)
        report = {"config": vars(args), "t0": t0, "faults": rows, "baseline": baseline, "load": totals,
                  "samples_acked": len(samples.acked), "sample_posts_refused": len(samples.refused),
                  "sample_posts_refused_at": [{"at_s": round(at - t0, 2), "why": why} for at, why in samples.refused],
                  "samples_never_trained": len(never), "samples_trained_twice": len(twice),
                  "requests": _outcomes(events, args.max_tokens)}
    finally:
        serve_launch.stop(config, started_ray)
    write_json(args.json, report)
    print_table(report)
    return 0


def restart_timeline(timeline: dict, killed_at: float) -> dict:
    """A restarted controller's start (stats()["start_timeline"], seconds after Ray
    constructed it) as seconds after the kill: when the actor was back, when its first call
    launched the worker groups, and over the new stage workers the last process start,
    model build, checkpoint restore and registration; then ready."""
    back = timeline["constructed_at_s"] - killed_at
    phases = {"actor back": back}
    for key in ("launch", "groups_found", "groups_released", "trainers_started"):
        if key in timeline:
            phases[key.replace("_", " ")] = back + timeline[key]
    for key in ("process", "train_function", "model_built", "rejoin", "restored", "registered"):
        values = [w[key] for w in timeline["workers"].values() if key in w and w[key] >= 0]
        if values:
            phases[f"last worker {key.replace('_', ' ')}"] = back + max(values)
    if "ready" in timeline:
        phases["ready"] = back + timeline["ready"]
    line = "restart: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
    return {"phases_s": phases, "line": line, "timeline": timeline}


def _window_time(event: dict) -> float:
    """When a request counts for a fault's window: its start, or for one that failed, its
    end (the fault that ended it: a stream started just before a replica's kill and cut by
    it is that kill's)."""
    return event["end"] if event["outcome"] != "done" else event["start"]


def _outcomes(events: list, max_tokens: int) -> dict:
    """Requests by outcome; TTFT p50/p99 (ms) of those done; and the done streams whose
    usage does not count exactly ``max_tokens`` tokens (a token lost or sent twice)."""
    import numpy as np

    out = {"total": len(events)}
    for e in events:
        key = e["outcome"].split()[0]
        out[key] = out.get(key, 0) + 1
    ttft = [e["ttft_s"] * 1e3 for e in events if e["outcome"] == "done" and e.get("ttft_s") is not None]
    if ttft:
        out["ttft_ms_p50"], out["ttft_ms_p99"] = (round(float(np.percentile(ttft, q)), 1) for q in (50, 99))
    out["error_streaming"] = sum(1 for e in events if e["outcome"].startswith("error") and e.get("tokens", 0) > 0)
    out["wrong_count"] = sum(1 for e in events if e["outcome"] == "done" and e.get("completion_tokens") != max_tokens)
    return out


def print_table(report: dict) -> None:
    print("| fault | at s | serving again s | all workers back s | requests started in its window (a failed one: "
          "failed in it): done / shed / error (of them after their first token) / cut / hung | TTFT p50 / p99 ms | "
          "done with a wrong token count | "
          "adapter version before (checkpoint) -> after |")
    print("|---|---:|---:|---:|---|---|---:|---|")

    def counts(q: dict) -> str:
        return (f"{q.get('done', 0)} / {q.get('shed', 0)} / {q.get('error', 0)} ({q.get('error_streaming', 0)}) / "
                f"{q.get('cut', 0)} / "
                f"{q.get('timeout', 0)} | {q.get('ttft_ms_p50', '-')} / {q.get('ttft_ms_p99', '-')} | "
                f"{q.get('wrong_count', 0)}")

    print(f"| none (before the first) | 0 | - | - | {counts(report['baseline'])} | - |")
    for r in report["faults"]:
        rec = f"{r['recovery_s']:.1f}" if r["recovery_s"] is not None else "not recovered"
        full = f"{r['whole_s']:.1f}" if r["whole_s"] is not None else "not recovered"
        print(f"| {r['fault']} | {r['at_s']:.0f} | {rec} | {full} | {counts(r['requests'])} | "
              f"{r['version_before']} ({r['checkpoint_before']}) -> {r['version_after']} |")
    q = report["requests"]
    print(f"\nrequests: {q['total']} sent, {q.get('done', 0)} done, {q.get('error', 0)} errors, "
          f"{q.get('cut', 0)} cut, {q.get('timeout', 0)} hung, {q.get('wrong_count', 0)} with a wrong token count; "
          f"training samples: {report['samples_acked']} "
          f"acknowledged, {report['samples_never_trained']} never trained, {report['samples_trained_twice']} "
          f"kept twice ({report['sample_posts_refused']} posts refused, not acknowledged"
          + "".join(f"; at {r['at_s']} s: {r['why']}" for r in report["sample_posts_refused_at"]) + ")")


if __name__ == "__main__":
    sys.exit(main())
