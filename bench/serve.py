"""HTTP front benchmark: what HTTP adds to streaming latency, and an open-loop load.

    .venv/bin/python bench/serve.py [--config examples/online.yaml] [--policies lemix,separate]
                                     [--seconds 20] [--json out/bench_serve.json]

For each policy, on one local deployment (the config's nodes x stages, tiny model on CPU):

1. **HTTP overhead.** ``--overhead-requests`` streamed completions one at a time through
   HTTP (httpx, server-sent events), and the same requests through the in-process Python
   API (the controller actor's stream, as ``OnlineDeployment.stream`` uses): TTFT and
   time between tokens (TBT) for each, and the added latency (HTTP minus Python), p50/p99.
   Both time a chunk when it carries new text (the front holds back half a UTF-8
   character until its other bytes come, and the tiny models' random bytes often are
   one), so TTFT is "first visible text" on both paths; the Python path also reports its
   first token's own arrival (``python_first_token_ms_p50``).
2. **Capacity.** A closed loop of ``--concurrency`` clients for ``--seconds``: completed
   requests per second.
3. **Open-loop load** at ``--levels`` (default 0.5x, 1x, 2x and 4x) that capacity,
   Poisson arrivals for ``--seconds`` each, from a separate process on loopback
   (bench/serve_load.py): p50/p99 TTFT and TBT, throughput, shed rate (429 with
   Retry-After), error rate; meanwhile two training samples are posted every 2 s and the
   resident memory of the cluster's processes is read every 5 s: the samples trained
   during the level, and memory's first, last and largest reading and its drift (a
   least-squares slope, MB per minute) over the whole level and over its second half,
   the processes that grew most, and TTFT in the level's first and last quarter
   (``--plot`` draws memory over time).

``make soak`` is the long run: ``--policies lemix --levels 1 --seconds 1800
--capacity-seconds 20 --skip-overhead --plot out/soak_memory.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def rss_by_process() -> dict[str, float]:
    """Resident MB of each Ray process, keyed ``<title>:<pid>`` (ray::OnlineController, raylet, ...)."""
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if ("ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "ray/" in cmd) and p.info.get("memory_info"):
            title = cmd.split()[0].split(".")[0] if cmd.startswith("ray::") else cmd.split()[0].rsplit("/", 1)[-1]
            out[f"{title}:{p.info['pid']}"] = p.info["memory_info"].rss / 2 ** 20
    return out


def rss_growth(before: dict, after: dict, top: int = 5) -> list[tuple[str, float]]:
    """The processes whose resident memory grew most between two readings (MB)."""
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    return sorted(grew.items(), key=lambda kv: -kv[1])[:top]


async def http_stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return {"status": 200, "ttft": times[0] - started, "tbt": list(np.diff(times))}


async def python_stream(controller, tokenizer, prompt: str, max_tokens: int) -> dict:
    """The same request through the controller's stream. Times are taken where the HTTP
    front would send a chunk: when a token makes new text safe to show (TextStream holds
    back half a UTF-8 character, and the tiny models' random bytes often are), so both
    paths time the same thing; ``first_token`` is the first token's own arrival."""
    from raycolo.online.serving.text import TextStream

    started = time.perf_counter()
    admitted = await controller.admit.remote(tokenizer.encode(prompt), max_tokens, 0.0, 1.0, 0, True)
    text, times, first = TextStream(tokenizer), [], None
    async for ref in controller.stream.options(num_returns="streaming").remote(admitted.id):
        kind, value = await ref
        if kind in ("token", "stop_token"):
            now = time.perf_counter()
            first = now if first is None else first
            if text.add(value):
                times.append(now)
    if not times:            # no visible text at all: time the first token instead
        times = [first]
    return {"ttft": times[0] - started, "tbt": list(np.diff(times)), "first_token": first - started}


async def overhead(url, controller, tokenizer, model, n, max_tokens) -> dict:
    out = {"http": [], "python": []}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for i in range(n):     # alternate, so drift hits both
            out["http"].append(await http_stream(client, model, f"overhead probe {i}", max_tokens))
            out["python"].append(await python_stream(controller, tokenizer, f"overhead probe {i}", max_tokens))
    row = {}
    for k in ("http", "python"):
        row[f"{k}_ttft_ms_p50"] = pct([r["ttft"] * 1e3 for r in out[k]], 50)
        row[f"{k}_ttft_ms_p99"] = pct([r["ttft"] * 1e3 for r in out[k]], 99)
        row[f"{k}_tbt_ms_p50"] = pct([t * 1e3 for r in out[k] for t in r["tbt"]], 50)
        row[f"{k}_tbt_ms_p99"] = pct([t * 1e3 for r in out[k] for t in r["tbt"]], 99)
    row["python_first_token_ms_p50"] = pct([r["first_token"] * 1e3 for r in out["python"]], 50)
    added = [(h["ttft"] - p["ttft"]) * 1e3 for h, p in zip(out["http"], out["python"])]
    row["added_ttft_ms_p50"], row["added_ttft_ms_p99"] = pct(added, 50), pct(added, 99)
    return row


async def capacity(url, model, concurrency, seconds, max_tokens) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(client, w):
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            r = await http_stream(client, model, f"capacity {w}-{i}", max_tokens)
            done += r["status"] == 200
            i += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*[worker(client, w) for w in range(concurrency)])
    return done / (time.perf_counter() - started)


def load(url, model, rate, seconds, max_tokens, seed) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url", url, "--model", model,
           "--rate", str(rate), "--seconds", str(seconds), "--max-tokens", str(max_tokens), "--seed", str(seed),
           "--max-requests", str(int(rate * seconds * 2) + 100)]      # bounded, but never before --seconds
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


class Sidecar(threading.Thread):
    """During a load level: posts 2 training samples every 2 s (does the service still
    train?) and reads each Ray process's resident memory every 5 s (does it grow, and
    which process?)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.halt = url, threading.Event()
        self.series: list[tuple[float, dict]] = []       # (seconds, {process: MB})
        self.posted = self.refused = 0
        self.started = time.perf_counter()

    def run(self) -> None:
        started, next_rss = self.started, 0.0
        with httpx.Client(base_url=self.url, timeout=60) as h:
            self.trained0 = h.get("/v1/train_samples/status").json()["trained"]
            i = 0
            while not self.halt.is_set():
                now = time.perf_counter() - started
                if now >= next_rss:
                    self.series.append((now, rss_by_process()))
                    next_rss = now + 5.0
                r = h.post("/v1/train_samples", json={"samples": [
                    {"prompt": f"soak {i}.{k}: copy abc", "completion": "abc abc"} for k in range(2)]})
                self.posted += 2 if r.status_code == 200 else 0
                self.refused += r.status_code != 200
                i += 1
                self.halt.wait(2.0)

    def stop(self) -> dict:
        self.halt.set()
        self.join()
        self.series.append((time.perf_counter() - self.started, rss_by_process()))
        deadline = time.time() + 60          # the samples posted last get a moment to train
        with httpx.Client(base_url=self.url, timeout=60) as h:
            while True:
                status = h.get("/v1/train_samples/status").json()
                if status["pending"] <= 1 or time.time() > deadline:
                    break
                time.sleep(1)
        return {**memory_figures(self.series), "samples_posted": self.posted,
                "sample_posts_refused": self.refused, "samples_trained": status["trained"] - self.trained0}


def slope_mb_per_min(t, mb) -> float:
    """Least-squares drift of a memory series, MB per minute."""
    t, mb = np.asarray(t, float), np.asarray(mb, float)
    return float(np.polyfit(t, mb, 1)[0] * 60) if len(t) >= 3 and np.ptp(t) > 0 else 0.0


def memory_figures(series: list[tuple[float, dict]]) -> dict:
    """First, last and largest total; the drift over the whole level and over its second
    half (what is left once caches and bounded stores have filled); the processes that grew
    most, overall and in the second half; and the series itself (total and top growers)."""
    t = [x for x, _ in series]
    total = [sum(d.values()) for _, d in series]
    half = [i for i, x in enumerate(t) if x >= t[-1] / 2]
    first, mid, last = series[0][1], series[half[0]][1], series[-1][1]
    growers = rss_growth(first, last)
    keys = [k for k, _ in growers]
    return {"rss_before_mb": total[0], "rss_after_mb": total[-1], "rss_max_mb": max(total),
            "rss_mb_per_min": slope_mb_per_min(t, total),
            "rss_mb_per_min_second_half": slope_mb_per_min([t[i] for i in half], [total[i] for i in half]),
            "rss_growth_mb": growers, "rss_growth_mb_second_half": rss_growth(mid, last),
            "rss_series": {"t_s": t, "total_mb": total,
                           **{k: [d.get(k, float("nan")) for _, d in series] for k in keys}}}


def plot_memory(report: dict, path: str) -> None:
    """Resident memory over each load level: the total (left) and the processes that grew
    most (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{policy} {mult}x", r["rss_series"]) for policy, row in report["policies"].items()
            for mult, r in row["load"].items()]
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 3.2 * len(rows)), squeeze=False)
    for (name, s), (left, right) in zip(rows, axes):
        minutes = np.asarray(s["t_s"]) / 60
        left.plot(minutes, s["total_mb"], color="black")
        left.set(title=f"{name}: all Ray processes", xlabel="minutes", ylabel="RSS, MB")
        for k, v in s.items():
            if k not in ("t_s", "total_mb"):
                right.plot(minutes, np.asarray(v) - v[0], label=k)
        right.set(title=f"{name}: growth of the top growers", xlabel="minutes", ylabel="MB since start")
        right.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"memory plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "online.yaml"))
    ap.add_argument("--policies", default="lemix,separate")
    ap.add_argument("--seconds", type=float, default=20.0, help="per load level")
    ap.add_argument("--capacity-seconds", type=float, default=None, help="the capacity probe (default: --seconds)")
    ap.add_argument("--overhead-requests", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--levels", default="0.5,1,2,4", help="load levels, x the measured capacity")
    ap.add_argument("--skip-overhead", action="store_true", help="skip the HTTP-overhead probes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="draw memory over time here (PNG)")
    args = ap.parse_args()
    levels = [float(x) for x in args.levels.split(",") if x.strip()]

    import ray

    from raycolo.actors.serve import launch as serve_launch
    from raycolo.actors.local_cluster import NAMESPACE, controller_name
    from raycolo.engine.models import load_tokenizer
    from raycolo.online.config import load_online_config

    base = load_online_config(args.config)
    report = {"config": vars(args), "policies": {}}
    started_all = time.perf_counter()
    for policy in args.policies.split(","):
        shutil.rmtree(f"out/bench-serve/{policy}", ignore_errors=True)   # each run from an empty store
        config = base.model_copy(update={
            "policy": policy, "resume": False, "sample_store": f"out/bench-serve/{policy}/samples",
            "storage_path": f"out/bench-serve/{policy}/checkpoints",
            "serve": base.serve.model_copy(update={"port": free_port(), "app_name": f"bench-{policy}",
                                                   "max_ongoing_requests": 4 * args.concurrency})})
        started, _ = serve_launch.init_ray(config)
        try:
            print(f"[{policy}] starting {config.nodes} x {config.stages} ...", file=sys.stderr, flush=True)
            url = serve_launch.start(config)
            controller = ray.get_actor(controller_name(config.serve.app_name), namespace=NAMESPACE)
            model = config.served_model_name()
            tokenizer = load_tokenizer(config.model_loading_config.model_id)
            row = {"overhead": None if args.skip_overhead else asyncio.run(
                overhead(url, controller, tokenizer, model, args.overhead_requests, args.max_tokens))}
            cap = asyncio.run(capacity(url, model, args.concurrency, args.capacity_seconds or args.seconds,
                                       args.max_tokens))
            row["capacity_rps"] = cap
            print(f"[{policy}] capacity {cap:.2f} requests/s", file=sys.stderr, flush=True)
            row["load"] = {}
            for mult in levels:
                side = Sidecar(url)
                side.start()
                res = load(url, model, cap * mult, args.seconds, args.max_tokens, args.seed)
                res.update(side.stop(), health=httpx.get(url + "/health", timeout=30).status_code)
                row["load"][mult] = res
                print(f"[{policy}] {mult}x: {json.dumps({k: v for k, v in res.items() if k != 'rss_series'})}",
                      file=sys.stderr, flush=True)
            report["policies"][policy] = row
        finally:
            serve_launch.stop(config, started)
    print_tables(report)
    print(f"wall time {time.perf_counter() - started_all:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        plot_memory(report, args.plot)
    return 0


def print_tables(report) -> None:
    print("\nHTTP overhead (streamed completions one at a time; ms):")
    print("| policy | HTTP TTFT p50/p99 | Python TTFT p50/p99 | added TTFT p50/p99 | HTTP TBT p50/p99 | Python TBT p50/p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy, row in report["policies"].items():
        o = row["overhead"]
        if o is None:
            continue
        print(f"| {policy} | {o['http_ttft_ms_p50']:.1f}/{o['http_ttft_ms_p99']:.1f} | "
              f"{o['python_ttft_ms_p50']:.1f}/{o['python_ttft_ms_p99']:.1f} | "
              f"{o['added_ttft_ms_p50']:.1f}/{o['added_ttft_ms_p99']:.1f} | "
              f"{o['http_tbt_ms_p50']:.1f}/{o['http_tbt_ms_p99']:.1f} | {o['python_tbt_ms_p50']:.1f}/{o['python_tbt_ms_p99']:.1f} |")
    print("\nOpen-loop load (Poisson, separate process; capacity from a closed loop):")
    print("| policy | load | offered/s | done/s | TTFT p50/p99 ms | TBT p50/p99 ms | shed | errors | cut | "
          "RSS MB first -> last (max) | MB/min all / 2nd half | samples posted/trained | /health |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy, row in report["policies"].items():
        for mult, r in row["load"].items():
            print(f"| {policy} | {mult}x of {row['capacity_rps']:.2f}/s | {r['offered_rps']:.2f} | {r['done_rps']:.2f} | "
                  f"{r['ttft_ms_p50']:.0f}/{r['ttft_ms_p99']:.0f} | {r['tbt_ms_p50']:.0f}/{r['tbt_ms_p99']:.0f} | "
                  f"{r['shed_rate']:.2f} | {r['error_rate']:.2f} | {r['cut']} | {r['rss_before_mb']:.0f} -> "
                  f"{r['rss_after_mb']:.0f} ({r['rss_max_mb']:.0f}) | {r['rss_mb_per_min']:+.1f} / "
                  f"{r['rss_mb_per_min_second_half']:+.1f} | {r['samples_posted']}/{r['samples_trained']} | "
                  f"{r['health']} |")
    print("\nDrift within each level (TTFT of the requests sent in its first and last quarter; "
          "the processes that grew most, MB):")
    print("| policy | load | TTFT p50/p99 first quarter | last quarter | top growers, whole level | second half |")
    print("|---|---:|---:|---:|---|---|")
    fmt = lambda growers: ", ".join(f"{k.split(':')[0]} {v:+.0f}" for k, v in growers[:3])
    for policy, row in report["policies"].items():
        for mult, r in row["load"].items():
            print(f"| {policy} | {mult}x | {r['ttft_ms_p50_first_quarter']:.0f}/{r['ttft_ms_p99_first_quarter']:.0f} | "
                  f"{r['ttft_ms_p50_last_quarter']:.0f}/{r['ttft_ms_p99_last_quarter']:.0f} | "
                  f"{fmt(r['rss_growth_mb'])} | {fmt(r['rss_growth_mb_second_half'])} |")

if __name__ == "__main__":
    sys.exit(main())
