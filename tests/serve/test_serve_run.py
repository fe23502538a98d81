"""``serve run`` with the shipped examples/serve.yaml, as a user runs it: a Ray cluster
started with ``ray start --head --num-gpus=4`` (logical GPUs for the stage workers), then
``serve run`` on it, a completion through the official ``openai`` client, Ctrl-C."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import yaml

from tests.support.online_checks import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _stop_cluster(temp_dir: str, gcs_port: int) -> None:
    """``ray stop --force`` for this test's cluster only: ``ray stop`` kills every Ray
    process on the machine, and another cluster may run beside this one. The
    cluster's processes name its temp dir or its GCS port; their children (workers, agents)
    go with them."""
    mine = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if temp_dir in line or f"127.0.0.1:{gcs_port}" in line or f"--gcs_server_port={gcs_port}" in line:
            mine.append(p)
    for p in list(mine):
        try:
            mine += p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in mine:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(mine, timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)
    current = Path("/tmp/ray/ray_current_cluster")      # where `ray start` wrote the address
    if current.exists() and current.read_text().strip() == f"127.0.0.1:{gcs_port}":
        current.unlink()


def test_serve_run_with_the_shipped_config(tmp_path):
    shipped = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
    assert shipped["http_options"]["host"] == "127.0.0.1"
    assert shipped["applications"][0]["import_path"] == "raycolo.actors.serve.app:build_app"
    # the shipped file, with a free port and this test's directories
    port, gcs = free_port(), free_port()
    shipped["http_options"]["port"] = port
    online = shipped["applications"][0]["args"]["config"]
    online["sample_store"], online["storage_path"] = str(tmp_path / "samples"), str(tmp_path / "ckpt")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(shipped))
    # Ray 2.60 authenticates with the token in ~/.ray/auth_token; both sides must agree
    env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{gcs}", RAY_AUTH_MODE="token")
    temp = tempfile.mkdtemp(prefix="raycolo-sr-", dir="/tmp")     # short: Ray's socket paths live in it
    subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-gpus=4", "--num-cpus=4",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    proc = None
    try:
        # Ctrl-C must reach it as KeyboardInterrupt even when this suite runs as a background
        # job (whose children start with SIGINT ignored, so Python would never raise it)
        proc = subprocess.Popen([str(BIN / "serve"), "run", str(config)], env=env, cwd=tmp_path,
                                stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline, healthy = time.time() + 300, False
        while time.time() < deadline and proc.poll() is None and not healthy:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                time.sleep(2)
        assert healthy, (tmp_path / "serve.log").read_text()[-3000:]
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny-llama-s", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGINT)                   # Ctrl-C: serve run shuts the app down
        stopping = time.time()
        proc.wait(timeout=300)
        print(f"serve run exited {time.time() - stopping:.1f} s after Ctrl-C")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _stop_cluster(temp, gcs)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0     # nothing listens any more
