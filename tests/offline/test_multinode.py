"""Real multi-node Ray clusters: joining one, running across its nodes, losing a node.

One ``ray.cluster_utils.Cluster`` serves the module: a head and one worker raylet, each
declaring 2 logical GPUs, both on 127.0.0.1 (this machine's default interface is not
loopback, which is what made joining such a cluster hang). The runtime runs as a user
runs it: ``jobs/run_dag.py --address 127.0.0.1:PORT`` in a subprocess, with a timeout.
The last test removes the worker raylet mid-run.
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raycolo.offline.runtime.setup import RunConfig

from tests.support.ray_clusters import two_raylets

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RUN_DAG = [sys.executable, str(ROOT / "jobs" / "run_dag.py")]
NODE_LOSS_S = RunConfig.model_fields["node_loss_s"].default   # --node-loss-s's default
FAIL_FAST_S = 20.0   # a refused --address must be an error well within this (probe: 3 s)


def _env() -> dict:
    """The CLI's environment: no RAY_ADDRESS, and no single-machine flag (join_cluster must
    find out by itself that the cluster is on loopback)."""
    drop = ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def cluster():
    with two_raylets("raycolo-mn-", dict(num_gpus=2, num_cpus=2), dict(num_gpus=2, num_cpus=2)) as c:
        yield c


def test_a_loopback_address_that_nothing_answers_fails_fast_naming_address(tmp_path):
    port = _closed_port()
    runs = {
        "run_dag": (RUN_DAG + ["--dag", str(EXAMPLES / "tiny.yaml"), "--output", str(tmp_path / "o"),
                               "--profile", "cpu", "--address", f"127.0.0.1:{port}"], {}),
        "serve": ([sys.executable, "-m", "raycolo.cli", "serve", str(EXAMPLES / "online.yaml"),
                   "--address", f"127.0.0.1:{port}"], {}),
        # ray job submit's way: the address comes in RAY_ADDRESS
        "job": (RUN_DAG + ["--dag", str(EXAMPLES / "tiny.yaml"), "--output", str(tmp_path / "j"),
                           "--profile", "cpu"], {"RAY_ADDRESS": f"127.0.0.1:{port}"}),
    }
    for name, (argv, extra) in runs.items():
        started = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**_env(), **extra})
        took = time.perf_counter() - started
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        errors = _error_lines(proc.stderr)
        assert len(errors) == 1 and errors[0].startswith("error: --address"), (name, proc.stderr[-2000:])
        assert f"127.0.0.1:{port}" in errors[0] and "Traceback" not in proc.stderr, name
        assert took < FAIL_FAST_S, (name, took)


def test_a_malformed_address_is_named_before_anything_connects():
    from raycolo.actors.local_cluster import resolve_cluster_address
    from raycolo.errors import ConfigError

    for bad in ("nonsense", "127.0.0.1:http", "127.0.0.1:70000", "ray://"):
        with pytest.raises(ConfigError, match=r"^--address: expected HOST:PORT"):
            resolve_cluster_address(bad)


def _run_dag(out: Path, address: str, *flags: str) -> list[str]:
    return RUN_DAG + ["--dag", str(EXAMPLES / "tiny.yaml"), "--output", str(out), "--profile", "cpu",
                      "--address", address, "--nvlink-group", "1", "--no-progress", *flags]


def _journal(out: Path) -> list[dict]:
    path = out / "outputs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_exactly_once(report: dict, out: Path) -> None:
    journal = _journal(out)
    keys = [r["key"] for r in journal]
    assert report["requests_done"] == report["requests_total"] == len(keys) == len(set(keys))


def test_a_run_uses_both_nodes_and_the_report_says_which_ran_what(cluster, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(_run_dag(out, cluster.address, "--requests", "8"),
                          capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Failed to connect" not in proc.stderr
    report = json.loads((out / "report.json").read_text())
    _check_exactly_once(report, out)
    assert report["gpus"] == 4                       # the cluster's GPUs, both nodes
    head, worker = cluster.head_node.node_id, cluster.worker.node_id
    ran = {n["node_id"]: n for n in report["ray_nodes"]}
    assert set(ran) == {head, worker}, report["ray_nodes"]
    for n in report["ray_nodes"]:
        assert n["ip"] == "127.0.0.1" and n["replicas"]
    # planner GPUs 0-1 on one raylet and 2-3 on the other (in node-id order), and every
    # replica (from the warm pool or cold) on the raylet of its planned GPUs
    assert report["gpu_nodes"] == [n for n in sorted((head, worker)) for _ in range(2)]
    for r in report["replicas"]:
        assert r["ray_node_id"] in (head, worker) and r["ray_node_ip"] == "127.0.0.1"
        assert {report["gpu_nodes"][g] for g in r["gpus"]} == {r["ray_node_id"]}, r
        assert r["name"] in ran[r["ray_node_id"]]["replicas"]
        # the Ray actor it ran in: its own name, or the warm actor it took over
        assert r["actor"].startswith((r["name"] + "~", "raycolo-pool-", "tiny/")), r


def test_losing_a_node_mid_run_replans_on_the_gpus_left_and_loses_nothing(cluster, tmp_path):
    out = tmp_path / "out"
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(_run_dag(out, cluster.address, "--requests", "24", "--replica-start-s", "3"),
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_env())
        try:
            deadline = time.monotonic() + 150
            while len(_journal(out)) < 6 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None and len(_journal(out)) >= 6, stderr.read_text()[-3000:]
            cluster.remove_node(cluster.worker)
            removed = time.monotonic()
            while ("planning what is left" not in stderr.read_text() and proc.poll() is None
                   and time.monotonic() < removed + 60):
                time.sleep(0.2)
            replanned = time.monotonic() - removed
            stdout, _ = proc.communicate(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = stderr.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "planning what is left on 2 GPUs" in text, text[-3000:]
    report = json.loads((out / "report.json").read_text())
    _check_exactly_once(report, out)
    (replan,) = report["replans"]
    assert replan["gpus_before"] == 4 and replan["gpus_after"] == 2
    assert [n["node_id"] for n in replan["lost_nodes"]] == [cluster.worker.node_id]
    assert report["gpus"] == 2 and report["requests_skipped"] == replan["requests_done_before"] >= 6
    assert {n["node_id"] for n in report["ray_nodes"]} == {cluster.head_node.node_id}
    # noticed within --node-loss-s (default 5 s) plus the 1 s check interval, with slack
    # for a loaded 2-core machine
    assert replanned < NODE_LOSS_S + 10, replanned
    assert stdout.strip().splitlines()[-1] == f"report: {out.resolve() / 'report.json'}"
