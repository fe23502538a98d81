"""`make gpu-bench` (bench/gpu_realsize.py): its dry run on the CPU, so that the script a
GPU session runs unattended works end to end (every path, the table, the JSON), and its
figures are computed from the right quantities. The speeds themselves are GPU figures
(docs/benchmarks.md); nothing here is timed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_realsize  # noqa: E402
import realsize_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_dry_run_covers_every_path_and_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    rc = gpu_realsize.main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--batches", "1,4",
                            "--prompt", "32", "--output", "6", "--eager-output", "4", "--stage-steps", "3",
                            "--train-rows", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out.read_text())["results"][0]
    paths = {(r["path"], r["batch"]) for r in result["rows"]}
    assert paths == {("engine.graphs", 1), ("engine.graphs", 4), ("engine.eager", 1), ("engine.unfused", 1),
                     ("stage.versions", 4), ("stage.versions1p", 4), ("transformers", 1),
                     ("attention.torch", 1), ("attention.torch", 4),
                     ("prefill", None), ("stage.graphs", 1), ("stage.graphs", 4), ("stage.eager", 1),
                     ("lora.train", 2), ("stage.split2", 1), ("stage.split2p", 1)}
    # float32 on the CPU: the engine's greedy tokens are transformers' argmax, every one
    agree = result["agreement"]
    assert agree["argmax"] == agree["tokens"] == 4 * 6 and agree["within_tie"]
    assert "| tiny | engine.graphs | 1 |" in text and "| tiny | agreement |" in text


def test_a_short_time_limit_skips_the_optional_rows_and_saves_each_row(tmp_path, capsys):
    """--time-limit under OPTIONAL_ROWS_S: the rows a lease can spare (versions1p, split2p)
    are skipped and say so; the JSON is written as each row comes (a run cut off by the
    device's limit keeps what it measured)."""
    out = tmp_path / "gpu.json"
    seen = []
    save = gpu_realsize.SavedRows(lambda: seen.append(json.loads(out.read_text()) if out.exists() else None))
    save.append({"path": "x"})
    assert seen == [None] and save == [{"path": "x"}]
    rc = gpu_realsize.main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--batches", "1",
                            "--prompt", "16", "--output", "4", "--eager-output", "3", "--stage-steps", "2",
                            "--train-rows", "1", "--time-limit", "5", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "stage.versions1p: skipped" in text and "stage.split2p: skipped" in text
    written = json.loads(out.read_text())
    assert written["complete"] and "clock" not in written["args"]
    paths = {r["path"] for r in written["results"][0]["rows"]}
    assert "stage.versions" in paths and not paths & {"stage.versions1p", "stage.split2p"}


def test_roofline_bytes_by_hand():
    """The decode roofline's bytes for a hand-sized model: every parameter but the (untied)
    input embedding, the step's embedding rows, and each sequence's K/V at its context."""
    model, _ = realsize_models.build_model("tiny", torch.device("cpu"), torch.float32)
    m = realsize_models.Model(model)
    cfg = realsize_models.SHAPES["tiny"]
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    assert m.read_params == sum(p.numel() for p in model.parameters()) - embed
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    assert m.kv_per_token == kv
    assert m.decode_bytes(3, 100) == (m.read_params + 3 * cfg["hidden_size"]) * 4 + 3 * 100 * kv


def test_without_cuda_it_skips():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_realsize.py")], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "skipped: no CUDA device (--device cpu for a dry run)"


@pytest.mark.parametrize("flag,value,need", [("--eager-output", "2", "at least 3"), ("--output", "1", "at least 3"),
                                             ("--batches", "1,x", "comma-separated integers >= 1"),
                                             ("--shapes", "llama3-8b,nope", "some of"), ("--tie-ulps", "-1", "at least 0")])
def test_a_bad_flag_is_one_error_line_naming_it(flag, value, need, capsys):
    assert gpu_realsize.main(["--device", "cpu", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}: must be {need}")


def test_the_near_tie_margin_is_units_in_the_last_place_of_the_best_logit():
    """bf16 by hand: a token k ulps below the best logit (ulp = 2^-7 * 2^floor(log2 |best|))
    passes where k <= tie_ulps (the second-best token) and fails beyond (the third); the
    floor ``tie`` in logits holds whatever the dtype."""
    model, _ = realsize_models.build_model("tiny", torch.device("cpu"), torch.bfloat16)
    prompt = [5, 9, 2, 7, 11]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    best = float(logits.max())
    ulp = 2.0 ** -7 * 2.0 ** torch.floor(torch.log2(torch.tensor(abs(best)))).item()
    gaps_ulp = (best - logits) / ulp
    order = torch.argsort(gaps_ulp)
    near, far = int(order[1]), int(order[2])             # the second and third best tokens
    k_near, k_far = float(gaps_ulp[near]), float(gaps_ulp[far])
    assert 0 < k_near < k_far
    between = (k_near + k_far) / 2
    for token, k in ((near, k_near), (far, k_far)):
        a = gpu_realsize.agreement(model, [prompt], [[token]], tie=0.0, tie_ulps=between)
        assert a["argmax"] == 0 and a["worst_gap_ulps"] == pytest.approx(k)
        assert a["worst_gap"] == pytest.approx(k * ulp)
        assert a["within_tie"] == (token == near)
    assert gpu_realsize.agreement(model, [prompt], [[far]], tie=best - float(logits[far]), tie_ulps=0.0)["within_tie"]
    top = int(logits.argmax())
    assert gpu_realsize.agreement(model, [prompt], [[top]], tie=0.0, tie_ulps=0.0) == pytest.approx(
        {"argmax": 1, "tokens": 1, "worst_gap": 0.0, "worst_gap_ulps": 0.0, "within_tie": True, "tie": 0.0,
         "tie_ulps": 0.0, "margin_at_worst": 0.0})
