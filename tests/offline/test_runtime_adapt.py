"""The real runtime adapting: bad input refused before Ray starts, the ``ray job submit``
script, preemption onto new replicas, models finishing in another order, a replica that
cannot start, real Hugging Face checkpoints against transformers, and a tp=2 replica.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raycolo.actors.offline.launch import run_application
from tests.support.runtime_checks import EXAMPLES, ROOT, START_S, _check_exactly_once, _config, _short_small


def test_bad_dag_or_input_fails_before_ray_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "tiny.yaml").read_text().replace("max_output_tokens: 32", "max_output_tokens: -1"))
    env = {**os.environ, "RAY_ADDRESS": ""}
    messages = []
    for args in (["run", str(EXAMPLES / "ensemble.yaml")],  # real models need checkpoints
                 ["run", str(bad)],
                 ["run", str(EXAMPLES / "tiny.yaml"), "--input", str(tmp_path / "missing.jsonl")],
                 ["run", str(EXAMPLES / "tiny.yaml"), "--policy", "nope"],
                 ["run", str(EXAMPLES / "tiny.yaml"), "--gpus", "0"]):
        proc = subprocess.run([sys.executable, "-m", "raycolo.cli", *args, "--output", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr and "Ray" not in proc.stdout + proc.stderr
        messages.append(lines[0])
    assert "nodes[vicuna]" in messages[0] and "checkpoint" in messages[0]
    assert "max_output_tokens" in messages[1]
    assert "missing.jsonl" in messages[2]
    assert "policy" in messages[3] and "nope" in messages[3]
    assert messages[4].startswith("error: --gpus")


def test_run_dag_job_script_runs_directly(tmp_path):
    """``python jobs/run_dag.py`` starts its own local cluster; the last line names the report."""
    out = tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "run_dag.py"), "--dag", str(EXAMPLES / "tiny_routing.yaml"),
         "--output", str(out), "--requests", "6", "--profile", "cpu", "--gpus", "1",
         "--replica-start-s", str(START_S), "--no-progress"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"report: {out.resolve() / 'report.json'}"
    report = json.loads((out / "report.json").read_text())
    _check_exactly_once(report, out)


def test_preempted_requests_continue_on_new_replicas_without_redoing_tokens(cluster, tmp_path):
    preempted = []

    def preempt_medium(controller, record):
        if preempted or record["node"] != "medium":
            return
        reps = controller.replicas.get("medium", [])
        if any(r.outstanding for r in reps):  # the first medium answer: the rest are mid-way
            preempted.append(sum(len(r.outstanding) for r in reps))
            controller.preempt("medium")

    config = _config(tmp_path, "tiny.yaml", requests=12)
    report = run_application(config, on_output=preempt_medium, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    assert preempted and report["requests_moved_by_preemption"] >= preempted[0] > 0
    medium = table[table["node"] == "medium"]
    assert (medium["preemptions"] >= 1).sum() >= 1
    # nothing done twice: the medium replicas generated exactly the tokens that were kept
    generated = sum(r["tokens"] for r in report["replicas"] if r["node"] == "medium")
    assert generated == medium["output_tokens"].sum()
    assert len([r for r in report["replicas"] if r["node"] == "medium"]) >= 2


def test_the_runtime_adapts_when_models_finish_in_another_order(cluster, tmp_path):
    """Plan with a wrong belief (the small model's answers 1000 tokens long): the
    plan expects 'medium' to finish first, reality finishes 'small' first, and the stage
    adjuster takes the next stage from there."""
    from raycolo.actors.offline.controller import Controller
    from raycolo.offline.planner.problem import PlanningProblem
    from raycolo.offline.policies import get_policy
    from raycolo.offline.runtime.setup import prepare

    # 'small' really answers in at most 4 tokens and 'medium' in up to 512 (seconds of work
    # even on the fast executor, more than replica starts vary), so the real order does not
    # hang on timing noise; the plan believes small's answers are 1000 tokens.
    dag = _short_small(tmp_path / "short_small.yaml")
    config = _config(tmp_path, str(dag), requests=8)
    run = prepare(config)
    believed = run.workload.nodes["small"].output_len.copy()
    problem = PlanningProblem(run.workload, run.cluster(2), profile_dir=run.profile_dir,
                              max_num_seqs=config.max_num_seqs, replica_start_s=START_S)
    run.workload.nodes["small"].output_len = np.full_like(believed, 1000)
    plan = get_policy("samullm")(problem)
    run.workload.nodes["small"].output_len = believed
    assert plan.node_finish_s["medium"] < plan.node_finish_s["small"]
    controller = Controller(run, problem, plan)
    controller.execute()
    run.store.close()
    summary = controller.summary()
    assert run.communicator.done == run.communicator.total == 24
    finish = {n: max(r["finished_s"] for r in run.store.done.values() if r["node"] == n)
              for n in ("small", "medium")}
    assert finish["small"] < finish["medium"]  # reality disagreed with the plan
    stages = [{m["node"] for m in stage["models"]} for stage in summary["stages"]]
    assert stages[0] == {"small", "medium"}
    # the boundary came at small's real finish: medium runs on without it
    assert "medium" in stages[1] and "small" not in stages[1]
    assert stages[-1] == {"judge"}


def _dag_with_broken_checkpoint(tmp_path) -> Path:
    """tiny_routing with 'small' loading a checkpoint whose weights file is gone."""
    from raycolo.engine.models import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint("tiny-llama-s", tmp_path / "broken")
    for weights in checkpoint.glob("*.safetensors"):
        weights.unlink()
    dag = tmp_path / "broken.yaml"
    dag.write_text((EXAMPLES / "tiny_routing.yaml").read_text().replace(
        "{name: small, model: tiny-llama-s,", f"{{name: small, model: tiny-llama-s, checkpoint: '{checkpoint}',"))
    return dag


def test_a_replica_that_cannot_start_fails_the_run_at_once(cluster, tmp_path):
    """A checkpoint whose weights are missing passes the driver's checks (its config and
    tokenizer are fine) but cannot load in the actor: one clear error, no restarts."""
    from raycolo.actors.offline.failures import ReplicaFailed

    dag = _dag_with_broken_checkpoint(tmp_path)
    with pytest.raises(ReplicaFailed, match=r"small/r0@gpu\d#s0 failed to start: .*"):
        run_application(_config(tmp_path, str(dag), requests=4), log=lambda m: None)


def test_cli_reports_a_replica_failure_as_one_error_line(tmp_path):
    dag = _dag_with_broken_checkpoint(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "raycolo.cli", "run", str(dag), "--gpus", "1",
                           "--requests", "4", "--replica-start-s", str(START_S), "--no-progress",
                           "--output", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: replica tiny_routing/small/r0")
    assert "Traceback" not in proc.stderr


def test_real_checkpoints_greedy_outputs_equal_transformers(cluster, tmp_path, hf_checkpoints):
    """raycolo run on checkpoints as users have them (a Llama 3-style one whose <|eot_id|>
    is an EOS only through generation_config.json, a Qwen2 and a GPT-2 one): greedy nodes
    (temperature 0) write the token ids, text and finish reasons transformers' generate()
    gives on the same directory, to outputs.parquet."""
    import torch

    from tests.support.hf_checkpoints import eos_ids, greedy_cases, load

    max_new = 16
    cases = {kind: [c for c in greedy_cases(path, max_new, n=8) if isinstance(c["prompt"], str)]
             for kind, path in hf_checkpoints.items()}
    prompts = sorted({c["prompt"] for cs in cases.values() for c in cs})
    long_prompt = "the quiet river and the silver road " * 120     # beyond the checkpoints' 512 positions
    prompts.append(long_prompt)
    requests = tmp_path / "prompts.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    nodes = "".join(f"  - {{name: {kind}, model: tiny-llama-s, checkpoint: '{path}', max_output_tokens: {max_new}, "
                    f"temperature: 0}}\n" for kind, path in hf_checkpoints.items())
    # a node constrained by a regex (vLLM's structured_outputs) and one with bad_words
    from tests.support.constrained import banned_word, constrained_reference, vllm_sequences

    regex = {"regex": r"(yes|no), [a-z]{2,5}\."}
    _, qwen_tok = load(hf_checkpoints["qwen2"])
    word = banned_word(qwen_tok, cases["qwen2"][0]["output_ids"])
    nodes += (f"  - {{name: regex, model: tiny-llama-s, checkpoint: '{hf_checkpoints['llama3']}', max_output_tokens: "
              f"{max_new}, temperature: 0, structured_outputs: {json.dumps(regex)}}}\n"
              f"  - {{name: banned, model: tiny-llama-s, checkpoint: '{hf_checkpoints['qwen2']}', max_output_tokens: "
              f"{max_new}, temperature: 0, bad_words: [{json.dumps(word)}]}}\n")
    edges = "".join(f"  - {{from: input, to: {kind}}}\n" for kind in [*hf_checkpoints, "regex", "banned"])
    dag = tmp_path / "real.yaml"
    dag.write_text(f"name: real\nrequests: {{file: '{requests}'}}\nnodes:\n{nodes}edges:\n{edges}")
    config = _config(tmp_path, str(dag))
    report = run_application(config, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    reasons = set()
    for kind, cs in cases.items():
        rows = table[table["node"] == kind].set_index("prompt")
        for c in cs:
            row = rows.loc[c["prompt"]]
            assert list(row["token_ids"]) == c["output_ids"], (kind, c["prompt"])
            assert row["text"] == c["text"] and row["finish_reason"] == c["finish_reason"]
            assert row["output_tokens"] == len(c["output_ids"]) and row["prompt_tokens"] == len(c["prompt_ids"])
            reasons.add(c["finish_reason"])
    assert reasons == {"stop", "length"}
    qwen, _ = load(hf_checkpoints["qwen2"])
    for c in cases["llama3"][:2]:        # transformers' greedy tokens under xgrammar's own processor
        ids, reason = constrained_reference(hf_checkpoints["llama3"], c["prompt_ids"], regex, max_new)
        row = table[table["node"] == "regex"].set_index("prompt").loc[c["prompt"]]
        assert list(row["token_ids"]) == ids and row["finish_reason"] == reason
    for c in cases["qwen2"][:2]:         # generate()'s bad_words_ids with vLLM's sequences
        with torch.no_grad():
            out = qwen.generate(torch.tensor([c["prompt_ids"]]), do_sample=False, max_new_tokens=max_new,
                                bad_words_ids=vllm_sequences(qwen_tok, [word]), eos_token_id=eos_ids(hf_checkpoints["qwen2"]),
                                pad_token_id=0)[0, len(c["prompt_ids"]):].tolist()
        row = table[table["node"] == "banned"].set_index("prompt").loc[c["prompt"]]
        assert list(row["token_ids"]) == out and word not in row["text"].split()
    # the overlong prompt was cut to the checkpoint's own context (512), not the catalog model's (1024)
    for kind in hf_checkpoints:
        row = table[(table["node"] == kind) & (table["item"] == len(prompts) - 1)].iloc[0]
        assert row["prompt_tokens"] + max_new <= 512 and row["output_tokens"] >= 1


def test_a_tp2_replica_computes_on_both_its_ranks_with_the_tp1_outputs(cluster, tmp_path):
    """With 32 MiB GPUs the judge fits only with tp=2 (its 2 GPUs' bundles): rank 0 is the
    engine actor, rank 1 an actor in the other bundle, each with its own GPU. Rank 1 is
    killed once while the judge has requests in flight: the replica is restarted as one
    unit, and every output still equals the run where the GPUs are large enough for tp=1
    plans, each request once."""
    import signal

    import psutil

    killed = []

    def kill_rank(controller, record):
        if killed:
            return
        judge = [r for r in controller.replicas.get("judge", []) if r.outstanding and r.ready_s is not None]
        ranks = [p for p in psutil.process_iter(["cmdline"])
                 if (p.info["cmdline"] or [""])[0].startswith("ray::TPRankActor")]
        if judge and ranks:
            os.kill(ranks[0].pid, signal.SIGKILL)
            killed.append(ranks[0].pid)

    tp2 = _config(tmp_path / "tp2", "tiny.yaml", requests=24, nvlink_group=2, gpu_memory="32MiB")
    report = run_application(tp2, on_output=kill_rank, log=lambda m: None)
    table = _check_exactly_once(report, Path(tp2.output))
    assert killed and report["restarts"] == 1
    judge = [r for r in report["replicas"] if r["node"] == "judge"]
    assert judge and all(r["tp"] == 2 for r in judge) and sum(r["restarts"] for r in judge) == 1
    for rep in judge:
        ranks = rep["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["pid"] != ranks[1]["pid"] and killed[0] != ranks[1]["pid"]   # a new rank 1
        assert len({g for r in ranks for g in r["ray_gpu_ids"]}) == 2      # a GPU each
    tp1 = _config(tmp_path / "tp1", "tiny.yaml", requests=24)
    report1 = run_application(tp1, log=lambda m: None)
    assert all(r["tp"] == 1 for r in report1["replicas"])
    table1 = _check_exactly_once(report1, Path(tp1.output))
    got = table.set_index("key")["text"].to_dict()
    assert got == table1.set_index("key")["text"].to_dict()


def test_every_tiny_catalog_model_runs(cluster, tmp_path):
    """``raycolo run --profile cpu`` of a graph with one node per tiny catalog model (three
    LLaMAs of four sizes, a Qwen2, a Mistral): every request of every node answered once."""
    from raycolo.catalog import _builtin_catalog
    from raycolo.engine.models import MAX_RANDOM_PARAMS

    tiny = sorted(name for name, spec in _builtin_catalog().items()
                  if spec.hf_architecture and spec.num_params <= MAX_RANDOM_PARAMS)
    assert len(tiny) >= 6
    nodes = "".join(f"  - {{name: n{i}, model: {m}, max_output_tokens: 6}}\n" for i, m in enumerate(tiny))
    edges = "".join(f"  - {{from: input, to: n{i}}}\n" for i in range(len(tiny)))
    dag = tmp_path / "catalog.yaml"
    dag.write_text("name: catalog\nrequests: {count: 4, input_tokens: {distribution: uniform, min: 8, max: 24}}\n"
                   f"nodes:\n{nodes}edges:\n{edges}")
    config = _config(tmp_path, str(dag))
    report = run_application(config, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    assert table.groupby("node").size().to_dict() == {f"n{i}": 4 for i in range(len(tiny))}
    assert {c["model"] for c in report["costed_from"]} == set(tiny)
