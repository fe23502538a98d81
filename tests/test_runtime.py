"""The real runtime on a local Ray cluster with two logical GPUs and tiny CPU models.

One cluster serves the whole module (a Ray start costs ~5 s, an engine actor ~5 s).
Every run checks the same contract: each request of the application is answered
exactly once, in the journal and in outputs.parquet, and the report agrees.
"""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import ray

from raycolo.actors.offline.launch import run_application
from raycolo.offline.runtime.setup import RunConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Planning needs a replica start time; tests give it rather than measure it each run.
START_S = 5.0


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(tmp_path, dag, **kw) -> RunConfig:
    values = dict(dag=str(EXAMPLES / dag), output=str(tmp_path / "out"), profile="cpu",
                  gpus=2, nvlink_group=1, replica_start_s=START_S, progress=False, gantt=False)
    values.update(kw)
    return RunConfig(**values)


def _check_exactly_once(report: dict, out: Path) -> pd.DataFrame:
    table = pd.read_parquet(out / "outputs.parquet")
    journal = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines() if line]
    assert report["requests_done"] == report["requests_total"] == len(table) == len(journal)
    assert table["key"].is_unique and len({r["key"] for r in journal}) == len(journal)
    for node, size in report["models"].items():
        got = sorted(table.loc[table["node"] == node, "index"])
        assert got == list(range(len(got))), node
    assert (table["output_tokens"] >= 1).all()
    assert set(table["finish_reason"]) <= {"stop", "length"}
    return table


def test_ensemble_with_a_judge_runs_every_request_once(cluster, tmp_path):
    config = _config(tmp_path, "tiny.yaml", requests=10, gantt=True)
    report = run_application(config, log=lambda m: None)
    out = Path(config.output)
    table = _check_exactly_once(report, out)
    assert report["requests_total"] == 30
    assert {"predicted_makespan_s", "actual_makespan_s", "requests_total", "requests_done"} <= set(report)
    assert report["actual_makespan_s"] > 0 and report["predicted_makespan_s"] > 0
    assert (out / "gantt.png").stat().st_size > 0
    assert json.loads((out / "report.json").read_text())["requests_done"] == 30
    # the judge saw both answers of its item (concat), rendered into its template
    by_key = table.set_index("key")
    for _, row in table[table["node"] == "judge"].iterrows():
        small = table[(table["node"] == "small") & (table["item"] == row["item"])]["text"].item()
        medium = table[(table["node"] == "medium") & (table["item"] == row["item"])]["text"].item()
        assert row["prompt"] == f"Which answer is better? A: {small} B: {medium}"
    # every replica that ran is named after its node, replica and GPUs
    names = [r["name"] for r in report["replicas"]]
    assert all(n.startswith("tiny/") and "@gpu" in n for n in names)
    assert set(by_key["replica"]) <= set(names)
    assert 0 < report["gpu_busy_fraction"] <= 1


def test_routing_sends_each_request_to_one_model(cluster, tmp_path):
    """The medium model loads from a real checkpoint directory (a node's ``checkpoint``)."""
    from raycolo.engine.models import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint("tiny-llama-m", tmp_path / "ckpt")
    dag = tmp_path / "routing.yaml"
    dag.write_text((EXAMPLES / "tiny_routing.yaml").read_text().replace(
        "{name: medium, model: tiny-llama-m,", f"{{name: medium, model: tiny-llama-m, checkpoint: '{checkpoint}',"))
    assert "checkpoint:" in dag.read_text()
    config = _config(tmp_path, str(dag), requests=16)
    report = run_application(config, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    assert report["requests_total"] == 16
    assert sorted(table["item"]) == list(range(16))  # each item once, on one model
    assert (table["node"] == "small").sum() == 12 and (table["node"] == "medium").sum() == 4
    loaded = {r["node"]: r["model_id"] for r in report["replicas"] if r["ready_s"] is not None}
    assert loaded == {"small": "tiny-llama-s", "medium": str(checkpoint)}


def test_chain_summary_carries_each_summary_into_the_next_part(cluster, tmp_path):
    config = _config(tmp_path, "tiny_chain.yaml", requests=4)
    report = run_application(config, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    summ = table[table["node"] == "summarizer"].sort_values("index")
    evals = table[table["node"] == "evaluator"]
    assert len(evals) == 2 * 4  # repeat 2 of each document's final summary
    for item, parts in summ.groupby("item"):
        parts = parts.sort_values("index")
        previous = ""
        for _, row in parts.iterrows():
            assert row["prompt"].startswith(f"Summary so far: {previous} Next part: ")
            previous = row["text"]
        for _, row in evals[evals["item"] == item].iterrows():
            assert row["prompt"] == f"Rate this summary from 1 to 10. Summary: {previous} Rating:"


def test_a_killed_engine_actor_loses_nothing(cluster, tmp_path):
    killed = []

    def kill_one(controller, record):
        if killed or controller.run_requests < 3:
            return
        for reps in controller.replicas.values():
            for rep in reps:
                if rep.outstanding and rep.ready_s is not None:
                    ray.kill(rep.actor, no_restart=True)
                    killed.append(rep.name)
                    return

    # 48 requests: enough that a replica still has work in flight after the first outputs
    # (the executor answers 24 of them within one 0.2 s run slice).
    config = _config(tmp_path, "tiny_routing.yaml", requests=48)
    report = run_application(config, on_output=kill_one, log=lambda m: None)
    assert killed
    _check_exactly_once(report, Path(config.output))
    assert report["restarts"] == 1
    restarted = [r for r in report["replicas"] if r["name"] == killed[0]]
    assert restarted[0]["restarts"] == 1


def _kill_on_sight(matches) -> tuple:
    """Kill the first named actor whose name ``matches``, the moment it exists (while it is
    still starting), from a thread; returns the list its name goes into, and the thread."""
    import threading
    import time

    killed: list[str] = []

    def killer():
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            for actor in ray.util.list_named_actors(all_namespaces=True):
                if matches(actor["name"]):
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
                    killed.append(actor["name"])
                    return
            time.sleep(0.005)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return killed, thread


def test_a_replica_killed_while_it_starts_is_restarted(cluster, tmp_path):
    """Kill the first replica the moment its actor is created (it is still starting): a
    crash, not a start failure (a constructor that raises fails the run at once, below),
    so the replica is started again and nothing is lost. Found by bench/offline_faults.py:
    the run failed with "The actor never ran - it was cancelled before it started"."""
    killed, thread = _kill_on_sight(lambda name: "/r0@gpu" in name and "#restart" not in name)
    config = _config(tmp_path, "tiny_routing.yaml", requests=8)
    report = run_application(config, log=lambda m: None)
    thread.join()
    assert killed
    _check_exactly_once(report, Path(config.output))
    assert report["restarts"] == 1


def test_the_replica_start_probe_survives_a_probe_that_dies(cluster, tmp_path):
    """A pool actor killed while it starts gives no sample and is not pooled; the others
    still time the start (before, the whole run failed: found by bench/offline_faults.py)."""
    from raycolo.actors.offline.launch import prepare
    from raycolo.actors.offline.pool import start_pool
    from raycolo.actors.offline.replicas import stop_actor
    from raycolo.offline.planner.problem import PlanningProblem

    killed, thread = _kill_on_sight(lambda name: name.startswith("raycolo-pool-0~"))
    run = prepare(_config(tmp_path, "tiny_routing.yaml", requests=4))
    problem = PlanningProblem(run.workload, run.cluster(2), profile_dir=run.profile_dir)
    pooled, costs, scales = start_pool(run, problem, 2)
    thread.join()
    assert killed and [p.gpus for p in pooled] == [(1,)]
    models = {w.model.name for w in run.workload.nodes.values()}
    rounds = max(len(models), 2)
    # then back to the previous round's model, which the actor parked asleep: a wake
    assert len(costs.cold) == 1 and len(costs.swap) == rounds and len(costs.wake) == 1
    assert len(costs.keep) == 1
    # the survivor ran each model's probe once: a positive time, compared with the profile's
    assert set(scales.samples) == models
    for model, samples in scales.samples.items():
        assert len(samples) == 1 and samples[0]["measured_s"] > 0 and samples[0]["predicted_s"] > 0
        assert scales.scales(models)[model] == samples[0]["measured_s"] / samples[0]["predicted_s"]
    # a swap reuses the process: far cheaper than a cold start, a keep cheaper still
    assert 0 < costs.estimate("keep") < costs.estimate("swap") < costs.estimate("cold") < 120
    for p in pooled:
        stop_actor(p.actor, p.pg)


def _generate(actor, prompts: list, seed: int) -> dict:
    """Run ``prompts`` on an engine actor to the end: {key: generated text}."""
    from raycolo.engine.replica_messages import EngineRequest
    from raycolo.generation import SamplingParams

    requests = [EngineRequest(f"q{i}", p, SamplingParams(max_tokens=24, temperature=0.8 if i % 2 else 0.0,
                                                           seed=seed + i))
                for i, p in enumerate(prompts)]
    out = {}
    while len(out) < len(prompts):
        got = ray.get(actor.run.remote(requests, 5.0))
        requests = []
        out.update({o.request_id: (o.text, tuple(o.token_ids)) for o in got.outputs})
    return out


def test_a_warm_swap_gives_the_outputs_of_a_cold_start(cluster):
    """An engine actor that served one model, drained mid-request, then swapped to another
    answers exactly as a fresh actor of that model (greedy and seeded sampling); taking
    the same config again is a keep, with the same answers too. The first model was
    parked asleep meanwhile: swapping back to it wakes it (no new engine), and it answers
    as a fresh engine of that model does."""
    from raycolo.actors.offline.engine_actor import EngineActor
    from raycolo.engine.replica_messages import EngineRequest
    from raycolo.generation import SamplingParams

    def config(model: str) -> dict:
        return {"model_loading_config": {"model_id": model, "seed": 0},
                "engine_kwargs": {"cpu_threads": 1, "device": "auto", "kv_cache_tokens": 4096}}

    prompts = ["The warm pool keeps", "a process and", "swaps the weights of a model", "x" * 40]
    cold = EngineActor.options(num_gpus=1).remote(config("tiny-llama-m"), "cold", 1)
    warm = EngineActor.options(num_gpus=1).remote(config("tiny-llama-s"), "warm", 1)
    try:
        expected = _generate(cold, prompts, seed=7)
        ray.get(warm.run.remote([EngineRequest("busy", "left mid-way",
                                               SamplingParams(max_tokens=500, ignore_eos=True))], 0.05))
        pid = ray.get(warm.info.remote()).pid
        drained = ray.get(warm.drain.remote())
        assert [u.key for u in drained.unfinished] == ["busy"]
        info = ray.get(warm.swap.remote(config("tiny-llama-m"), "warm-2"))
        assert info.switch == "swap" and info.model_id == "tiny-llama-m" and info.pid == pid
        assert _generate(warm, prompts, seed=7) == expected
        ray.get(warm.drain.remote())
        info = ray.get(warm.swap.remote(config("tiny-llama-m"), "warm-3"))
        assert info.switch == "keep" and info.swaps == 2 and info.parked == 1
        assert _generate(warm, prompts, seed=7) == expected
        ray.get(cold.drain.remote())
        assert ray.get(cold.swap.remote(config("tiny-llama-s"), "cold-2")).switch == "swap"
        expected_s = _generate(cold, prompts, seed=3)
        ray.get(warm.drain.remote())
        info = ray.get(warm.swap.remote(config("tiny-llama-s"), "warm-4"))
        assert info.switch == "wake" and info.model_id == "tiny-llama-s" and info.parked == 1
        assert info.pid == pid
        assert _generate(warm, prompts, seed=3) == expected_s
    finally:
        for actor in (cold, warm):
            ray.kill(actor, no_restart=True)


def test_a_grown_replica_keeps_its_requests_and_later_stages_reuse_actors(cluster, tmp_path):
    """small finishes first; the plan then grows medium from dp1 to dp2: medium's replica
    r0 runs on (not drained) keeping its share of the requests, a new r1 on small's pooled
    actor takes the other half with their tokens (nothing generated twice), and the
    judge's replicas take over the pooled actors (swaps, no new process)."""
    from raycolo.actors.offline.controller import Controller
    from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
    from raycolo.offline.planner.search import replay_selections, run_policy
    from raycolo.offline.runtime.setup import prepare

    dag = _short_small(tmp_path / "grow.yaml")
    config = _config(tmp_path, str(dag), requests=8)
    run = prepare(config)
    problem = PlanningProblem(run.workload, run.cluster(2), profile_dir=run.profile_dir,
                              max_num_seqs=config.max_num_seqs, replica_start_s=START_S)
    one, two = ExecPlan(1, 1), ExecPlan(2, 1)
    plan = run_policy(problem, "grow", replay_selections(
        [{"small": one, "medium": one}, {"medium": two}, {"judge": two}]))
    controller = Controller(run, problem, plan)
    controller.execute()
    run.store.close()
    summary = controller.summary()
    assert run.communicator.done == run.communicator.total == 24
    stages = [{m["node"]: m["dp"] for m in stage["models"]} for stage in summary["stages"]]
    assert stages[0] == {"small": 1, "medium": 1} and stages[1] == {"medium": 2}
    medium = [r for r in summary["replicas"] if r["node"] == "medium"]
    assert [r["name"].split("/")[2].split("@")[0] for r in medium] == ["r0", "r1"]
    r0 = medium[0]
    assert r0["created_s"] < summary["stages"][1]["start_s"] < r0["stopped_s"]   # it ran on
    assert summary["requests_moved_by_preemption"] == 0
    moved = summary["requests_moved_to_new_replicas"]    # half of those still unfinished then
    assert 1 <= moved <= 4
    assert medium[0]["tokens"] > 0 and medium[1]["tokens"] > 0
    done = [r for r in run.store.done.values() if r["node"] == "medium"]
    assert sum(r["preemptions"] for r in done) <= moved  # those that had started continue
    assert medium[0]["tokens"] + medium[1]["tokens"] == sum(r["output_tokens"] for r in done)
    # medium r1 took small's pooled actor; the judges took medium's two (swaps, not starts)
    assert medium[1]["switch"] == "swap"
    judges = [r for r in summary["replicas"] if r["node"] == "judge"]
    assert [r["switch"] for r in judges] == ["swap", "swap"]
    assert summary["overhead"]["replica_switches"]["cold"]["count"] == 2


class StopJob(Exception):
    pass


def test_the_plan_foresees_how_each_replica_gets_its_engine(cluster, tmp_path):
    """With the warm pool started before planning, the planner follows which engine each
    pool actor holds and has parked, and says per replica how it will get its engine
    (cold, swap, wake or keep). Executed, every replica got its engine that way: the
    planner's model against the engine actors' own account. (A planned replica with no
    started replica is a grown node's kept one, which runs on: a keep.)"""
    report = run_application(_config(tmp_path, "tiny.yaml", requests=24, replica_start_s=None),
                             log=lambda m: None)
    planned = {}
    for i, stage in enumerate(report["planned_stages"]):
        for m in stage["models"]:
            assert m["switches"] or all(m["node"] != r["node"] or f"#s{i}" not in r["name"]
                                        for r in report["replicas"])   # continuing: nothing new
            for gpus, kind in zip(m["replica_gpus"], m["switches"]):
                planned[i, m["node"], tuple(gpus)] = kind
    actual = {}
    for r in report["replicas"]:
        stage = int(re.search(r"#s(\d+)", r["name"]).group(1))
        actual[stage, r["node"], tuple(r["gpus"])] = r["switch"]
    assert actual and set(actual) <= set(planned)
    assert {k: actual.get(k, "keep") for k in planned} == planned
    assert "wake" in actual.values()   # the pool's start leaves engines parked to wake
    _check_exactly_once(report, tmp_path / "out")


def test_resume_skips_finished_requests(cluster, tmp_path):
    def stop_after(limit):
        def hook(controller, record):
            if controller.run_requests >= limit:
                raise StopJob()
        return hook

    config = _config(tmp_path, "tiny_chain.yaml", requests=4)
    with pytest.raises(StopJob):
        run_application(config, on_output=stop_after(5), log=lambda m: None)
    journal = Path(config.output) / "outputs.jsonl"
    first = {json.loads(line)["key"]: json.loads(line) for line in journal.read_text().splitlines()}
    assert len(first) >= 5
    report = run_application(config, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    assert report["requests_skipped"] == len(first)
    assert report["requests_run"] == report["requests_total"] - len(first)
    assert f"cover the {report['requests_run']} that were left" in report["notes"][0]
    kept = table.set_index("key").loc[list(first)]
    assert list(kept["text"]) == [first[k]["text"] for k in first]  # finished work untouched


def test_a_disk_that_fills_up_mid_run_loses_nothing_acknowledged(cluster, tmp_path):
    """After 5 outputs the output journal's disk is full (its handle moves to /dev/full,
    where every write fails with ENOSPC): the run stops with StoreFull naming --output;
    the same job run again (space freed) keeps those 5 untouched and runs the rest, each
    request once."""
    from raycolo.errors import StoreFull

    def fill_disk_after(limit):
        def hook(controller, record):
            store = controller.run_.store
            if controller.run_requests >= limit and store._journal._file.name != "/dev/full":
                store._journal._file.close()
                store._journal._file = open("/dev/full", "a", encoding="utf-8")
        return hook

    config = _config(tmp_path, "tiny_chain.yaml", requests=4)
    with pytest.raises(StoreFull, match=r"--output: .*outputs.jsonl: No space left on device; nothing was stored"):
        run_application(config, on_output=fill_disk_after(5), log=lambda m: None)
    journal = Path(config.output) / "outputs.jsonl"
    first = {json.loads(line)["key"]: json.loads(line) for line in journal.read_text().splitlines()}
    assert len(first) >= 5
    report = run_application(config, log=lambda m: None)
    table = _check_exactly_once(report, Path(config.output))
    assert report["requests_skipped"] == len(first)
    kept = table.set_index("key").loc[list(first)]
    assert list(kept["text"]) == [first[k]["text"] for k in first]


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


def _short_small(dag: Path) -> Path:
    """tiny.yaml with 'small' answering in at most 4 tokens and 'medium' in up to 512."""
    dag.write_text((EXAMPLES / "tiny.yaml").read_text().replace(
        "{name: small, model: tiny-llama-s, max_output_tokens: 64}",
        "{name: small, model: tiny-llama-s, max_output_tokens: 4}").replace(
        "{name: medium, model: tiny-llama-m, max_output_tokens: 64}",
        "{name: medium, model: tiny-llama-m, max_output_tokens: 512}"))
    return dag


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
    from hf_checkpoints import greedy_cases

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
    edges = "".join(f"  - {{from: input, to: {kind}}}\n" for kind in hf_checkpoints)
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
