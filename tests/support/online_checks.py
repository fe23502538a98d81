"""Checks the live online tests share."""
from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path
from typing import Callable, Optional


_PORTS = random.Random(os.getpid())     # successive calls try different ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server a test starts: below the kernel's
    ephemeral range, as a configured port is (8000), so that no connection the cluster opens
    meanwhile gets it as its own end while the server restarts."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    for port in _PORTS.sample(range(max(1024, low - 12000), low), 2000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:          # none free down there: any
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trained_exactly_once(drain: Callable[[], None], sample_ledger: Callable[[], dict], timeout_s: float,
                         explain: Optional[Callable[[], str]] = None) -> dict:
    """Wait (draining) until every stored sample is trained exactly once in what the
    adapters keep, for at most ``timeout_s``; then assert it. ``explain`` says what the
    deployment was doing when it was not."""
    deadline = time.monotonic() + timeout_s
    while True:
        drain()
        ledger = sample_ledger()
        counts = {seq: ledger["trained"].get(seq, 0) for seq in range(ledger["stored"])}
        if set(counts.values()) <= {1} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    expected = {seq: 1 for seq in range(ledger["stored"])}
    assert counts == expected, explain() if explain is not None else counts
    return ledger


def data_plane() -> dict:
    """The stage section's ``data_plane`` to test with: RAYCOLO_TEST_DATA_PLANE (node or
    controller) where set, else the config's default."""
    plane = os.environ.get("RAYCOLO_TEST_DATA_PLANE")
    return {"data_plane": plane} if plane else {}


def small_online_config(out, *, nodes: int, stages: int, model: str = "tiny-llama-s", lemix: Optional[dict] = None,
                        lora: Optional[dict] = None, stage: Optional[dict] = None, **fields):
    """The live tests' deployment: a tiny model in float32 on CPU, LeMix with a 5 s SLO,
    LoRA rank 4, one thread per stage worker, 8 output tokens, its stores under ``out``.
    ``lemix``, ``lora`` and ``stage`` add to (or override) those sections' keys, and
    ``fields`` the top-level ones."""
    from raycolo.online.config import parse_online_config

    return parse_online_config({
        "model_loading_config": {"model_id": str(model), "dtype": "float32"},
        "nodes": nodes, "stages": stages, "policy": "lemix",
        "lemix": {"slo_ms": 5000, "max_batch": 8, "profile_warmup": 2, **(lemix or {})},
        "lora": {"rank": 4, "alpha": 8, "lr": 0.01, "micro_batch": 2, **(lora or {})},
        "stage": {"cpus_per_worker": 0.5, "cpu_threads": 1, "kv_cache_tokens": 4096, **data_plane(),
                  **(stage or {})},
        "max_tokens": 8,
        "sample_store": str(out / "samples"), "storage_path": str(out / "checkpoints"),
        **fields,
    })
