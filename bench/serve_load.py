"""Open-loop load on the HTTP front, run as its own process (bench/serve.py starts it):
Poisson arrivals at ``--rate`` for ``--seconds``, each a streamed completion; loopback
only, bounded in count and time. Prints one JSON line of results."""
import argparse
import asyncio
import json
import random
import time

import httpx
import numpy as np


async def one(client, model, i, max_tokens, out):
    started = time.perf_counter()
    times = []
    try:
        async with client.stream("POST", "/v1/completions", json={
                "model": model, "prompt": f"load {i}", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}) as r:
            if r.status_code == 429:
                out["shed"] += 1
                out["retry_after_ok"] += "retry-after" in r.headers
                return
            if r.status_code != 200:
                out["errors"] += 1
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' not in line:
                    times.append(time.perf_counter())
                elif '"error"' in line:
                    out["errors"] += 1
                    return
    except httpx.HTTPError:
        out["errors"] += 1
        return
    if times:
        out["ttft"].append(times[0] - started)
        out["tbt"].extend(np.diff(times).tolist())
        out["done"] += 1


async def run(args):
    if not args.url.startswith("http://127.0.0.1"):
        raise SystemExit("error: --url: loopback only (http://127.0.0.1:...)")
    rng = random.Random(args.seed)
    out = {"shed": 0, "errors": 0, "done": 0, "ttft": [], "tbt": [], "retry_after_ok": 0}
    tasks = []
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url, timeout=args.seconds * 5 + 60) as client:
        i = 0
        while time.perf_counter() - started < args.seconds and i < args.max_requests:
            tasks.append(asyncio.create_task(one(client, args.model, i, args.max_tokens, out)))
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    sent = len(tasks)
    pct = lambda v, q: float(np.percentile(v, q) * 1e3) if v else float("nan")
    print(json.dumps({"offered_rps": sent / args.seconds, "sent": sent, "done": out["done"],
                      "done_rps": out["done"] / wall, "shed_rate": out["shed"] / max(1, sent),
                      "shed_with_retry_after": out["retry_after_ok"], "error_rate": out["errors"] / max(1, sent),
                      "ttft_ms_p50": pct(out["ttft"], 50), "ttft_ms_p99": pct(out["ttft"], 99),
                      "tbt_ms_p50": pct(out["tbt"], 50), "tbt_ms_p99": pct(out["tbt"], 99)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
