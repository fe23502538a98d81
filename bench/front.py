"""The HTTP front alone, at GPU token rates: how many streamed tokens/s it sustains and
what each chunk costs in CPU, in every process on the path.

A token source stands where a node's stage 0 stands: it is the deployment's controller
actor to the ingress (it admits each request and takes cancels), and it writes every
admitted request's tokens to the admitting replica's token inbox with the real
:class:`~raycolo.online.serving.token_wire.TokenSender`, one frame per replica per
decode step, as stage 0 does. Everything after that is the real front: the inbox, the
replica's detokenizer and server-sent events (raycolo/actors/serve), then uvicorn in the
replica itself (``--ingress replica``, the default) or Ray Serve's proxy (``--ingress
proxy``), to streaming HTTP clients on loopback (aiohttp, in this process).

For each number of concurrent streams, offered rates go up until one is not sustained
(the clients received < 95 % of what the source wrote in the window, which is the
offered rate less the gaps while a stream's next request is admitted; or the p99 added
latency passes ``--max-p99-s``; or chunks carry more than ``--max-tokens-per-chunk``
tokens on average: a replica that falls behind sends the tokens that came together as
one chunk, and the client counts a chunk's tokens by its text, a character per token).
The table gives the highest sustained rate, the tokens per chunk and the CPU per chunk of
each process there (replica, proxy, token source, client), and the added latency per
token (from the source's write to the client's read, p50 and p99).

    .venv/bin/python bench/front.py                               # 64, 256, 1024 streams
    .venv/bin/python bench/front.py --streams 256 --replicas 2 --json out/bench_front.json
    .venv/bin/python bench/front.py --ingress proxy               # through Ray Serve's proxy
    .venv/bin/python bench/front.py --ingress proxy --serve-mode throughput   # RAY_SERVE_THROUGHPUT_OPTIMIZED=1

Loopback only; a measured benchmark, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from raycolo.online.config import Ingress, ServeSpec  # noqa: E402

SERVE_MODES = {"default": {}, "throughput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
               "direct": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
               "direct-loop": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
FIRST_TOKEN, TOKEN_SPAN = 97, 26      # the source's tokens: FIRST_TOKEN + position % TOKEN_SPAN
PROCESS_TITLES = {"replica": "ray::ServeReplica:", "proxy": "ray::ProxyActor", "source": "ray::TokenSource"}


def token_source_class():
    import ray

    from raycolo.generation import FinishReason
    from raycolo.online.scheduling.node_loop import TokenOut
    from raycolo.online.serving.messages import Admission
    from raycolo.online.serving.token_wire import TokenSender

    @ray.remote(num_cpus=0)
    class TokenSource:
        """The controller as the ingress sees it, with a stage 0's token writes."""

        def __init__(self, step_s: float, first_token: int):
            self.step_s, self.first_token = step_s, first_token
            self.sender = TokenSender()
            self.lock = threading.Lock()
            self.active: dict[int, list] = {}      # rid -> [front, tokens left, position]
            self.sent: dict[tuple, float] = {}     # (rid, position) -> when it was written
            self.next_id, self.chunks, self.cancels = 0, 0, 0
            self.running = True
            threading.Thread(target=self._loop, daemon=True).start()

        # -- the controller's interface to the ingress (raycolo/actors/online/requests.py) --
        async def start(self, timeout_s: float = 0.0) -> dict:
            return {}

        async def attach(self, front: str) -> None:
            return None

        async def detach(self, front: str) -> None:
            return None

        async def resolve_adapter(self, name: str):
            return None

        async def monitor(self) -> dict:
            return {"running": len(self.active), "waiting": 0, "samples_trained": 0, "samples_pending": 0,
                    "optimizer_steps": 0, "adapter_version": 0, "adapter_staleness_s": 0.0,
                    "slo_attainment": 1.0, "decision_us_p50": 0.0, "nodes_alive": 1, "restarting_nodes": [],
                    "stages": []}

        async def admit(self, prompt, max_tokens=None, temperature=0.0, top_p=1.0, seed=0, ignore_eos=False,
                        base=False, version=None, params=None, front=None) -> Admission:
            with self.lock:
                rid, self.next_id = self.next_id, self.next_id + 1
                self.sender.watch(rid, front)
                self.active[rid] = [front, params.max_tokens, 0]
            return Admission(id=rid)

        async def cancel(self, rid: int, reason: str = "stop") -> None:
            with self.lock:
                self.cancels += self.active.pop(rid, None) is not None

        async def front_events(self, front: str):
            while self.running:        # every token goes through the inbox
                await asyncio.sleep(3600)
            yield []

        def stop(self) -> dict:
            self.running = False
            return {}

        # -- stage 0's side --------------------------------------------------------------
        def _loop(self) -> None:
            next_at = time.perf_counter()
            while self.running:
                next_at += self.step_s
                with self.lock:
                    out, now = [], time.time()
                    for rid, state in list(self.active.items()):
                        state[1] -= 1
                        last = state[1] == 0
                        out.append(TokenOut(rid, self.first_token + state[2] % TOKEN_SPAN, True,
                                            FinishReason.LENGTH if last else None, None, state[2]))
                        self.sent[(rid, state[2])] = now
                        state[2] += 1
                        if last:
                            del self.active[rid]
                    if out:
                        self.sender.send(out)
                        self.chunks += len(out)
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_at = time.perf_counter()      # behind: no catching up in a burst

        def take_sent(self) -> dict:
            with self.lock:
                sent, self.sent = self.sent, {}
            return sent

        def set_step(self, step_s: float) -> None:
            self.step_s = step_s

    return TokenSource


async def _stream(session, url: str, model: str, max_tokens: int, got: list, stop_at: float) -> None:
    """One streamed completion after another until ``stop_at``: each chunk's (rid,
    position, time read) into ``got``."""
    import aiohttp

    body = {"model": model, "prompt": "front", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    while time.perf_counter() < stop_at:
        try:
            await _one(session, url, body, got, stop_at)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            got.append(("error", repr(exc), time.time()))


TEXT = b'"text": "'


async def _one(session, url: str, body: dict, got: list, stop_at: float) -> None:
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            await asyncio.sleep(0.05)
            return
        rid, position = None, 0
        async for line in r.content:
            if time.perf_counter() >= stop_at:      # the window ends: the client goes away
                return
            if not line.startswith(b"data: {"):
                continue
            now = time.time()
            if rid is None:
                rid = int(json.loads(line[6:])["id"].split("-")[1])
            start = line.index(TEXT) + len(TEXT)
            tokens = line.index(b'"', start) - start     # a character per token (main checks)
            if tokens == 0:                  # the closing chunk (its finish_reason)
                continue
            got.append((rid, position, now, tokens))     # tokens that fell behind come as one chunk
            position += tokens


async def _drive(url: str, model: str, streams: int, max_tokens: int, warm_s: float, seconds: float,
                 pids: dict) -> tuple[list, dict, dict, float]:
    """``streams`` streams for ``warm_s + seconds``; the chunks read, and every process's
    CPU seconds (this one's: "client") at the start and the end of the measured window
    (after ``warm_s``, once every stream has started), and the window's length."""
    import aiohttp

    got: list = []
    marks: list = []

    async def mark(at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        marks.append((time.perf_counter(), {**_cpu(pids), "client": time.process_time()}))

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        begin = time.perf_counter()
        stop_at = begin + warm_s + seconds
        await asyncio.gather(mark(begin + warm_s), mark(stop_at - 0.05),
                             *[_stream(session, url, model, max_tokens, got, stop_at) for _ in range(streams)])
    (t0, before), (t1, after) = marks
    wall0 = time.time() - (time.perf_counter() - t0)
    wall1 = time.time() - (time.perf_counter() - t1)
    window = [g for g in got if g[0] == "error" or wall0 <= g[2] < wall1]
    return window, before, after, (wall0, wall1)


def _cpu(pids: dict) -> dict:
    import psutil

    out = {}
    for name, group in pids.items():
        total = 0.0
        for pid in group:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        out[name] = total
    return out


def measure(url, model, source, pids, streams, rate, seconds, max_tokens) -> dict:
    import ray

    ray.get(source.set_step.remote(streams / rate))
    ray.get(source.take_sent.remote())
    warm_s = max(2.0, streams / 200)      # every stream admitted and streaming before the window
    got, before, after, (wall0, wall1) = asyncio.run(_drive(url, model, streams, max_tokens, warm_s, seconds, pids))
    wall = wall1 - wall0
    sent = ray.get(source.take_sent.remote())
    # what the source wrote in the window: the offered rate less the gaps while a stream's
    # next request is admitted (the front is measured against what reached it)
    written = sum(wall0 <= t < wall1 for t in sent.values())
    errors = [g for g in got if g[0] == "error"]
    got = [g for g in got if g[0] != "error"]
    lat = np.array([t - sent[(rid, pos + i)] for rid, pos, t, n in got for i in range(n) if (rid, pos + i) in sent])
    chunks, tokens = max(1, len(got)), sum(g[3] for g in got)
    cpu = {name: (after[name] - before[name]) / chunks * 1e3 for name in before}
    return {"streams": streams, "offered_tokens_per_s": rate, "written_tokens_per_s": written / wall,
            "received_tokens_per_s": tokens / wall, "tokens_per_chunk": tokens / chunks,
            "chunks": len(got), "errors": len(errors), "cpu_ms_per_chunk": cpu,
            "front_cpu_ms_per_chunk": cpu["replica"] + cpu["proxy"],
            "latency_p50_ms": float(np.percentile(lat, 50) * 1e3) if len(lat) else None,
            "latency_p99_ms": float(np.percentile(lat, 99) * 1e3) if len(lat) else None}


def _check_one_character_tokens(model_id: str) -> None:
    """The client counts a chunk's tokens by its text's characters (a replica that fell
    behind sends the tokens that came together as one chunk): each source token must
    decode to one character that JSON writes as itself."""
    from raycolo.engine.models import load_tokenizer

    tokenizer = load_tokenizer(model_id)
    for token in range(FIRST_TOKEN, FIRST_TOKEN + TOKEN_SPAN):
        text = tokenizer.decode([token])
        if len(text) != 1 or json.dumps(text) != f'"{text}"':
            raise SystemExit(f"error: model_id: {model_id}'s token {token} decodes to {text!r}, not one "
                             "character JSON writes as itself; the client could not count tokens")


def _replica_url(pids: list, proxy_url: str) -> str:
    """Under direct ingress, the replica's own HTTP listener (Serve's 30000-31000 range)."""
    import psutil

    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and 30000 <= c.laddr.port <= 31000:
                return proxy_url.replace(proxy_url.split("/")[2], f"{c.laddr.ip}:{c.laddr.port}")
    raise SystemExit("error: --to-replica: no replica listens on Serve's direct-ingress ports")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--rates", type=float, nargs="+", default=[1000, 2000, 4000, 8000, 16000, 32000],
                   help="offered streamed tokens/s to try, ascending")
    p.add_argument("--seconds", type=float, default=6.0, help="each measurement's length")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per streamed completion")
    p.add_argument("--replicas", type=int, default=1, help="ingress replicas (serve.replicas)")
    p.add_argument("--ingress", choices=[i.value for i in Ingress], default=ServeSpec().ingress.value,
                   help="serve.ingress: each replica's own listener on the port, or Ray Serve's proxy")
    p.add_argument("--serve-mode", choices=sorted(SERVE_MODES), default="default",
                   help="Ray Serve's environment: its default, RAY_SERVE_THROUGHPUT_OPTIMIZED=1, or "
                        "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (the clients still use the proxy's URL)")
    p.add_argument("--to-replica", action="store_true",
                   help="with --serve-mode direct: stream from the replica's own port, past the proxy")
    p.add_argument("--refine", type=int, default=2,
                   help="bisections between the last sustained offered rate and the first that was not")
    p.add_argument("--max-p99-s", type=float, default=1.0)
    p.add_argument("--max-tokens-per-chunk", type=float, default=1.1,
                   help="sustained only while chunks carry at most this many tokens on average (a replica "
                        "that falls behind sends the tokens that came together as one chunk)")
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from common import pids_titled, write_json
    from raycolo.actors.local_cluster import NAMESPACE, controller_name, start_local
    from raycolo.actors.serve.launch import start
    from raycolo.online.config import load_online_config

    config = load_online_config(str(ROOT / "examples" / "online.yaml"))
    config = config.model_copy(update={"serve": config.serve.model_copy(update={
        "port": args.port, "replicas": args.replicas, "ingress": Ingress(args.ingress), "max_ongoing_requests": 4 * max(args.streams),
        "api_key_env": None})})
    _check_one_character_tokens(config.model_loading_config.model_id)
    start_local(env={**config.cluster_env(), **SERVE_MODES[args.serve_mode]}, num_cpus=2, num_gpus=0,
                include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)   # loopback only
    source = token_source_class().options(name=controller_name(config.serve.app_name), namespace=NAMESPACE,
                                           lifetime="detached").remote(0.01, FIRST_TOKEN)
    rows = []
    try:
        url = start(config)
        model = config.served_model_name()
        pids = {name: pids_titled(title) for name, title in PROCESS_TITLES.items()}
        if args.to_replica:
            url = _replica_url(pids["replica"], url)
        print(f"front: {args.replicas} replica(s), ingress {args.ingress}, Serve mode {args.serve_mode}, {url}, "
              f"pids {pids}", flush=True)
        measure(url, model, source, pids, 8, 400, 2.0, args.max_tokens)       # warm-up
        for streams in args.streams:
            best, failed = None, None

            def attempt(rate: float) -> bool:
                row = measure(url, model, source, pids, streams, rate, args.seconds, args.max_tokens)
                row["sustained"] = ok = (
                    row["received_tokens_per_s"] >= 0.95 * row["written_tokens_per_s"]
                    and row["latency_p99_ms"] is not None and row["latency_p99_ms"] <= args.max_p99_s * 1e3
                    and row["tokens_per_chunk"] <= args.max_tokens_per_chunk)
                print(f"  {streams:5d} streams, offered {rate:8.0f}/s, written {row['written_tokens_per_s']:8.0f}/s: "
                      f"received {row['received_tokens_per_s']:8.0f}/s "
                      f"({row['tokens_per_chunk']:.2f} tokens/chunk), "
                      f"front {row['front_cpu_ms_per_chunk']:.3f} ms CPU/chunk, "
                      f"p99 {row['latency_p99_ms'] or float('nan'):.1f} ms {'ok' if ok else 'NOT sustained'}",
                      flush=True)
                rows.append(row)
                return row if ok else None

            for rate in args.rates:
                row = attempt(rate)
                if row is None:
                    failed = rate
                    break
                best = row
            for _ in range(args.refine if best is not None and failed is not None else 0):
                rate = (best["offered_tokens_per_s"] + failed) / 2        # between the two: bisect
                row = attempt(rate)
                best, failed = (row, failed) if row is not None else (best, rate)
            if best is not None:
                best["best"] = True
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print("| streams | sustained tokens/s | tokens/chunk | replica ms/chunk | proxy ms/chunk | front ms/chunk | "
          "source ms/chunk | client ms/chunk | added latency p50 / p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if row.get("best"):
            c = row["cpu_ms_per_chunk"]
            print(f"| {row['streams']} | {row['received_tokens_per_s']:.0f} | {row['tokens_per_chunk']:.2f} | {c['replica']:.3f} | {c['proxy']:.3f} | "
                  f"{row['front_cpu_ms_per_chunk']:.3f} | {c['source']:.3f} | {c['client']:.3f} | "
                  f"{row['latency_p50_ms']:.1f} / {row['latency_p99_ms']:.1f} |")
    if args.json:
        write_json(args.json, {"ingress": args.ingress, "serve_mode": args.serve_mode, "replicas": args.replicas,
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
