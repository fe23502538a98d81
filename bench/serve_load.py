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


async def one(client, model, i, max_tokens, out, events=None):
    """One streamed completion; its outcome: done (ended with [DONE]), shed (429), error
    (another status, or an error event), cut (the stream ended with neither [DONE] nor an
    error: an accepted request lost silently) or timeout (no end within the client's
    timeout: a hung request)."""
    started = time.perf_counter()
    wall = time.time()
    times = []
    outcome = "cut"
    completion = None         # completion_tokens of the stream's usage chunk
    try:
        async with client.stream("POST", "/v1/completions", json={
                "model": model, "prompt": f"load {i}", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}) as r:
            if r.status_code == 429:
                out["shed"] += 1
                out["retry_after_ok"] += "retry-after" in r.headers
                outcome = "shed"
            elif r.status_code != 200:
                out["errors"] += 1
                outcome = f"error {r.status_code}"
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"choices":[]' in line.replace(" ", ""):
                        completion = json.loads(line[6:])["usage"]["completion_tokens"]   # the usage chunk
                    elif line.startswith("data: {") and '"error"' not in line:
                        times.append(time.perf_counter())
                    elif '"error"' in line:
                        out["errors"] += 1
                        outcome = "error event"
                        break
                    elif line.strip() == "data: [DONE]":
                        outcome = "done"
    except httpx.TimeoutException:
        out["errors"] += 1
        outcome = "timeout"
    except httpx.HTTPError as exc:
        out["errors"] += 1
        outcome = f"error {type(exc).__name__}"
    if outcome == "cut":
        out["cut"] += 1
    if outcome == "done" and times:
        out["ttft"].append(times[0] - started)
        out["ttft_at"].append(started)
        out["tbt"].extend(np.diff(times).tolist())
        out["done"] += 1
    if events is not None:
        events.append({"i": i, "start": wall, "end": time.time(), "outcome": outcome, "tokens": len(times),
                       "completion_tokens": completion, "ttft_s": times[0] - started if times else None})


def drift(at, ttft, started, seconds, pct) -> dict:
    """Latency drift: p50/p99 TTFT of the requests sent in the first and in the last
    quarter of the run."""
    first = [x for t, x in zip(at, ttft) if t - started < seconds / 4]
    last = [x for t, x in zip(at, ttft) if t - started >= seconds * 3 / 4]
    return {"ttft_ms_p50_first_quarter": pct(first, 50), "ttft_ms_p99_first_quarter": pct(first, 99),
            "ttft_ms_p50_last_quarter": pct(last, 50), "ttft_ms_p99_last_quarter": pct(last, 99)}


async def run(args):
    if not args.url.startswith("http://127.0.0.1"):
        raise SystemExit("error: --url: loopback only (http://127.0.0.1:...)")
    rng = random.Random(args.seed)
    out = {"shed": 0, "errors": 0, "done": 0, "cut": 0, "ttft": [], "ttft_at": [], "tbt": [], "retry_after_ok": 0}
    events = [] if args.events else None
    tasks = []
    started = time.perf_counter()
    timeout = args.timeout or args.seconds * 5 + 60
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout) as client:
        i = 0
        while time.perf_counter() - started < args.seconds and i < args.max_requests:
            tasks.append(asyncio.create_task(one(client, args.model, i, args.max_tokens, out, events)))
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    sent = len(tasks)
    pct = lambda v, q: float(np.percentile(v, q) * 1e3) if v else float("nan")
    print(json.dumps({"offered_rps": sent / args.seconds, "sent": sent, "done": out["done"],
                      "done_rps": out["done"] / wall, "shed_rate": out["shed"] / max(1, sent),
                      "shed_with_retry_after": out["retry_after_ok"], "error_rate": out["errors"] / max(1, sent),
                      "cut": out["cut"],
                      "ttft_ms_p50": pct(out["ttft"], 50), "ttft_ms_p99": pct(out["ttft"], 99),
                      "tbt_ms_p50": pct(out["tbt"], 50), "tbt_ms_p99": pct(out["tbt"], 99),
                      **drift(out["ttft_at"], out["ttft"], started, args.seconds, pct)}))
    if events is not None:
        with open(args.events, "w") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="per request (default: 5 x --seconds + 60)")
    ap.add_argument("--events", default=None, help="write each request's start, end and outcome here (JSONL)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
