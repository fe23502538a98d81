"""`make gpu-check` (raycolo/gpu_check/): the skip without CUDA, and its checks run on the CPU.

`--device cpu` runs the same checks (the same references: transformers' generate()/forward
and peft's training step on CPU float64, two real stage processes over gloo) on the CPU,
so the comparison logic is exercised here; the CUDA branches themselves need a GPU.
"""
from __future__ import annotations

import json
import re
import time

import torch

from raycolo import gpu_check
from raycolo.gpu_check import executor_checks


def test_without_cuda_it_prints_skipped_and_exits_zero(tmp_path):
    """Run as make gpu-check runs it, with no CUDA device visible (CUDA_VISIBLE_DEVICES
    empty hides any GPU this machine has, so this holds on a GPU machine too)."""
    import os
    import subprocess
    import sys

    for module in ("raycolo.gpu_check", "raycolo.engine.gpu_check"):     # and the old spelling
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", module, "--json", str(tmp_path / f"{module}.json")],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == ["skipped: no CUDA device"]
        assert time.monotonic() - started < 30       # torch's import is most of it
        assert json.loads((tmp_path / f"{module}.json").read_text())["skipped"] == "no CUDA device"


def test_the_checks_pass_on_the_cpu_against_their_references(capsys, tmp_path):
    threads = torch.get_num_threads()
    rc = gpu_check.main(["--device", "cpu", "--json", str(tmp_path / "gpu.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    written = json.loads((tmp_path / "gpu.json").read_text())
    rows = {r["path"]: r for r in written["rows"]}
    assert written["complete"] is True and set(rows) == set(gpu_check.CHECKS)
    for path, row in rows.items():
        expected = ("PASS", "SKIP") if path == "vllm" else ("PASS",)   # .venv has no vllm
        assert row["result"] in expected, (path, row)
        assert re.search(rf"^{re.escape(path)} +\| {row['result']} ", out, re.M), out
    assert rows["executor.whole"]["figures"]["tokens_equal"] == "96/96"
    assert rows["executor.decode"]["figures"]["max_abs_diff"] < 1e-3
    assert rows["stage.p2p"]["figures"]["tokens_equal"] == "24/24"
    assert rows["sampler"]["figures"]["greedy_equal"] == "576/576" and rows["sampler"]["figures"]["max_logit_diff"] == 0
    assert torch.get_num_threads() == threads          # the dry run's one thread is undone


def test_a_wrong_result_is_a_failed_row_and_exit_code_one(monkeypatch, capsys):
    # patched where the executor rows look it up (executor_checks imports it from references)
    real = executor_checks._hf_last_logits
    monkeypatch.setattr(executor_checks, "_hf_last_logits", lambda model, ps: real(model, ps) + 1e-3)
    rc = gpu_check.main(["--device", "cpu", "--only", "executor.whole"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "executor.whole | FAIL" in out and "prefill logits differ" in out


def test_the_json_is_rewritten_after_every_row(tmp_path):
    """A run cut off by a lease's time limit keeps the rows it finished."""
    from raycolo.gpu_check.cli import run_checks

    seen = []
    rows = run_checks(torch.device("cpu"), ["device_stats", "vllm"], log=lambda s: None,
                      on_row=lambda so_far: seen.append([r.path for r in so_far]))
    assert seen == [["device_stats"], ["device_stats", "vllm"]] and [r.path for r in rows] == seen[-1]
