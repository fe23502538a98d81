"""The real runtime on a local Ray cluster with two logical GPUs and tiny CPU models
(tests/offline/conftest.py's ``cluster``, one per module): the three applications, killed
and dying replicas, warm swaps, resume and a disk that fills up. Every run checks the same
contract (tests/support/runtime_checks.py): each request is answered exactly once.
"""
import json
import re
from pathlib import Path

import pytest
import ray

from raycolo.actors.offline.launch import run_application
from tests.support.runtime_checks import EXAMPLES, START_S, _check_exactly_once, _config, _short_small


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
    # the same job once more: everything is done, nothing is planned or run, the report stays
    said = []
    again = run_application(config, log=said.append)
    assert again["already_done"] and {k: again[k] for k in report if k != "report_path"} == \
        {k: v for k, v in json.loads(Path(report["report_path"]).read_text()).items()}
    assert "nothing ran again" in said[-1] and _check_exactly_once(again, Path(config.output)).equals(table)
    Path(report["report_path"]).unlink()          # stopped after its last output, before its report
    short = run_application(config, log=lambda m: None)
    assert (short["requests_run"], short["requests_skipped"]) == (0, report["requests_total"])
    assert "already done" in short["notes"][0] and Path(short["report_path"]).is_file()


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
