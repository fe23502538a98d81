"""The live online runtime on a real local Ray cluster: Ray Train stage workers (gloo,
logical GPUs) of a tiny Llama serving and training LoRA, placed by the same Cluster the
simulator runs. One deployment per data plane serves the module (a start costs 30-60 s on
2 cores); policies are switched on it between traces, and its last tests kill a stage
worker, a node's Ray Train controller and the online controller itself. (A whole
deployment stopped and started on its storage: tests/serve/deployment/test_deployment_faults.py.)
"""
from __future__ import annotations

import json
import os
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from tests.support.online_checks import small_online_config, trained_exactly_once
from raycolo.actors.local_cluster import start_local
from raycolo.actors.online.launch import OnlineDeployment, learnable_pair, learnable_preference
from raycolo.rng import seeded_rng
from raycolo.online.tasks import poisson_workload
from tests.support.tiny_reference import hf_greedy

ROOT = Path(__file__).resolve().parents[2]


PLANES = [os.environ["RAYCOLO_TEST_DATA_PLANE"]] if os.environ.get("RAYCOLO_TEST_DATA_PLANE") else ["node", "controller"]


@pytest.fixture(scope="module", params=PLANES)
def deployment(tmp_path_factory, request):
    """One deployment per data plane (stage.data_plane): each node's loop on its stage 0
    (the default), or every op through the controller; the latter's two stages of a node
    share one (logical) GPU, Ray Train placing them with half a GPU each."""
    out = tmp_path_factory.mktemp("online")
    shared = {"gpus_per_worker": 0.5} if request.param == "controller" else {}
    config = small_online_config(out, nodes=2, stages=2, train_rate=0.5, lemix={"sync_every": 2},
                                 lora={"checkpoint_every": 3}, stage={"data_plane": request.param, **shared})
    assert config.gpus_needed() == (2 if shared else 4)
    # as raycolo starts a local cluster for a deployment: its processes get cluster_env()
    start_local(env=config.cluster_env(), num_gpus=config.gpus_needed(), num_cpus=4, include_dashboard=False,
                log_to_driver=False, namespace="raycolo")
    dep = OnlineDeployment.start(config, timeout_s=240)
    yield dep, config, out
    try:
        dep.stop()
    finally:
        ray.shutdown()


def test_workers_register_by_node_and_stage(deployment):
    dep, _, _ = deployment
    reg = dep.registry()
    assert sorted(reg) == ["node-0/stage-0", "node-0/stage-1", "node-1/stage-0", "node-1/stage-1"]
    assert len({w["pid"] for w in reg.values()}) == 4
    # the workers started with the configured OpenMP wait policy in their environment,
    # and the driver's own environment is as it was
    assert {w["omp_wait_policy"] for w in reg.values()} == {"PASSIVE"}
    assert "OMP_WAIT_POLICY" not in os.environ


def test_streamed_greedy_completion_equals_the_unsplit_model(deployment):
    dep, _, _ = deployment
    prompt = [1] + [40 + i % 50 for i in range(17)]
    rid = dep.submit(prompt, max_tokens=6, ignore_eos=True)
    tokens = list(dep.stream(rid))
    assert tokens == hf_greedy("tiny-llama-s", prompt, 6)   # fresh LoRA (B = 0): the base model's tokens


def test_samples_are_persisted_before_the_ack_and_training_changes_the_adapter(deployment, tmp_path):
    dep, config, out = deployment
    rng = seeded_rng(0, "test-live")
    ack = dep.add_samples([learnable_pair(rng, 12, 259) for _ in range(4)])
    lines = (out / "samples" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines][-4:] == ack["ids"]
    before = dep.export_adapter(str(tmp_path / "before"), node=0)
    tids = [dep.train(), dep.train()]
    assert all(t is not None for t in tids)
    dep.drain()
    after = dep.export_adapter(str(tmp_path / "after"), node=dep.stats()["last_trained_node"])
    from safetensors.torch import load_file
    a = load_file(Path(before) / "adapter_model.safetensors")
    b = load_file(Path(after) / "adapter_model.safetensors")
    assert set(a) == set(b) and any(not torch.equal(a[k], b[k]) for k in a)
    assert dep.stats()["train_done"] >= 2


def test_preference_pairs_train_with_dpo_across_the_pipeline_stages(deployment):
    """Preference pairs are stored with their rejected answer, become a DPO training task
    whose forward carries the frozen base's rows beside the policy's through both stages,
    and raise the margin of the chosen answers on the node that trained them."""
    dep, _, out = deployment
    rng = seeded_rng(3, "test-live-dpo")
    pairs = [learnable_preference(rng, 10, 259) for _ in range(2)]          # micro_batch = 2
    before = [ray.get(dep.controller.held_out_preference.remote(pairs, n)) for n in range(2)]
    ack = dep.add_samples(pairs)
    stored = [json.loads(line) for line in (out / "samples" / "samples.jsonl").read_text().splitlines()]
    assert [(r["seq"], r["rejected"]) for r in stored[-2:]] == list(zip(ack["ids"], [p[2] for p in pairs]))
    done = dep.stats()["train_done"]
    assert dep.train() is not None
    dep.drain()
    assert dep.stats()["train_done"] == done + 1
    node = dep.stats()["last_trained_node"]
    after = ray.get(dep.controller.held_out_preference.remote(pairs, node))
    assert after["clpd"] > before[node]["clpd"] and 0.0 <= after["win_rate"] <= 1.0
    assert ray.get(dep.controller.sample_ledger.remote())["trained"].get(ack["ids"][0]) == 1
    figures = dep.held_out_preference(node=None)            # the Python API's held-out set
    assert figures["pairs"] == 16 and math.isfinite(figures["clpd"])


# the policies the controller's data plane replays too: one of each family (the node plane runs all)
CONTROLLER_PLANE_POLICIES = ("lemix", "separate", "lemix+harli", "lemix+sirius", "lemix+mace")


@pytest.mark.parametrize("policy", ["lemix", "mix-rr", "separate", "harli", "lemix+harli", "harli-static",
                                    "sirius", "lemix+sirius", "sirius-timeshare", "sirius-static", "mace",
                                    "lemix+mace", "mace-sync", "mace-periodic"])
def test_every_task_of_a_short_trace_completes_exactly_once(deployment, policy):
    dep, config, _ = deployment
    if config.stage.data_plane == "controller" and policy not in CONTROLLER_PLANE_POLICIES:
        pytest.skip("the controller's data plane (kept to compare) runs one policy of each family")
    dep.use_policy(policy)
    tasks = poisson_workload(12.0, 0.4, 12, seed=5)     # about 1 s of arrivals: the trace waits for them
    for t in tasks:
        t.length = min(t.length, 24)
        if not t.is_train:
            t.decode_tokens = t.max_tokens = min(t.decode_tokens, 5)
    result = dep.replay(tasks, seed=1)
    assert sorted(result.completions.values()) == [1] * len(tasks)   # each exactly once
    summary = result.summary()
    assert summary["completed"] == len(tasks) and summary["policy"] == policy
    assert summary["train_done"] == sum(t.is_train for t in tasks)
    stats = dep.stats()
    assert stats["errors"] == []
    assert 0 < stats["scheduling_us_p50"] <= stats["scheduling_us_p99"] and stats["scheduling_us_per_task"] > 0
    # the controller's own CPU since use_policy, per task that arrived since (the replay's)
    assert stats["tasks_arrived"] == len(tasks) and stats["controller_cpu_s"] > 0
    assert stats["controller_cpu_ms_per_task"] == pytest.approx(stats["controller_cpu_s"] * 1e3 / len(tasks), rel=0.2)
    assert stats["controller_sustains_tasks_per_s"] == pytest.approx(1e3 / stats["controller_cpu_ms_per_task"])
    assert 0 < stats["controller_cpu_share"] < 2        # cores: CPU seconds per second of the run


def test_online_run_and_simulate_online_print_the_same_keys(deployment):
    """``online run --json`` (its replay on this deployment: cli.replay_online) and
    ``simulate-online --json`` have the same top-level keys, ``model`` included."""
    from raycolo.cli.online import replay_online

    dep, config, _ = deployment
    dep.use_policy("lemix")
    tasks = poisson_workload(4.0, 0.5, 6, seed=7)
    for t in tasks:
        t.length = min(t.length, 24)
        if not t.is_train:
            t.decode_tokens = t.max_tokens = min(t.decode_tokens, 4)
    _, live = replay_online(dep, config, tasks, 4.0, seed=2)
    proc = _cli("simulate-online", "--tasks", "6", "--rate", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    simulated = json.loads(proc.stdout)
    assert set(live) == set(simulated), set(live) ^ set(simulated)
    assert live["model"] == "tiny-llama-s" and simulated["model"] == "llama-8b"
    assert live["completed"] == 6 and live["errors"] == [] and live["adapter_version"] >= 0
    assert simulated["actor_hops"] == 0 and simulated["adapter_version"] is None and simulated["errors"] == []


def test_stage_workers_let_go_of_the_tensors_they_sent(deployment):
    """After the traces above, the sending stages posted a hundred point-to-point sends or more;
    it holds on only to those whose receivers have not run yet. (gloo's isend reports
    completion only to wait(): the stage worker held every hidden state it ever sent.)"""
    dep, _, _ = deployment
    stages = ray.get(dep.controller.monitor.remote())["stages"]
    assert sum(st["sends_posted"] for st in stages) >= 100
    for st in stages:
        assert st["sends_held"] <= 8, st


def test_adapter_checkpoints_are_reported_through_ray_train(deployment):
    dep, config, out = deployment
    stats = dep.stats()
    assert stats["adapter_version"] >= 1
    files = sorted(p.name for p in (out / "checkpoints").rglob("stage-*.safetensors"))
    assert "stage-0.safetensors" in files and "stage-1.safetensors" in files


def test_a_killed_stage_worker_restarts_its_group_and_loses_nothing(deployment):
    """SIGKILL one stage worker while requests decode and a training task runs on its node:
    Ray Train restarts the node's group from the adapter checkpoint, every request still
    gets all its tokens (re-prefilled from prompt + streamed tokens) or a clear error, and
    every acknowledged sample is trained exactly once in what the adapters keep."""
    import os
    import signal

    dep, config, _ = deployment
    dep.use_policy("mix-rr")
    rng = seeded_rng(1, "test-kill")
    for _ in range(config.lora.checkpoint_every):   # until a node trained since its checkpoint
        dep.add_samples([learnable_pair(rng, 12, 259) for _ in range(2)])
        dep.train()
        dep.drain()
        deadline = time.monotonic() + 60
        while (stats := dep.stats())["checkpoints_uncommitted"]:     # Ray Train commits in ~1 s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if max(stats["samples_since_checkpoint"]) > 0:
            break
    victim = max(range(config.nodes), key=lambda n: stats["samples_since_checkpoint"][n])
    since = stats["samples_since_checkpoint"][victim]
    assert since > 0, stats      # the restart has samples to train again
    checkpoint = stats["checkpoint_versions"][victim]
    before = dep.registry()
    dep.add_samples([learnable_pair(rng, 12, 259) for _ in range(2)])
    rids = [dep.submit([1] + [40 + (i * 7 + j) % 50 for j in range(15)], max_tokens=40, ignore_eos=True)
            for i in range(6)]
    dep.train()
    deadline = time.monotonic() + 60
    while min(dep.progress(r)["tokens"] for r in rids) < 1:   # every request is decoding
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert max(dep.progress(r)["tokens"] for r in rids) < 40
    os.kill(before[f"node-{victim}/stage-1"]["pid"], signal.SIGKILL)
    results = [dep.result(rid) for rid in rids]
    dep.drain()
    for r in results:
        if r["finish_reason"] == "error":
            assert "node-" in r["error"]                    # a clear error naming where
        else:
            assert r["finish_reason"] == "length" and len(r["tokens"]) == 40
    assert sum(r["finish_reason"] == "length" for r in results) >= 3
    stats = dep.stats()
    restarts = [x for x in stats["restarts"] if x["node"] == victim]
    assert len(restarts) == 1 and restarts[0]["replayed_samples"] >= since   # + one trained after the ask
    assert restarts[0]["adapter_version"] == checkpoint
    # The drain can end before the new group registers: past stage.rejoin_s (a slow start:
    # the suite's CPUs busy elsewhere) the lost node's samples are trained on the other node
    # instead. Its new group does come back.
    keys, after = _new_group_of(dep, before, victim, config.stages, "epoch")
    for k in keys:
        old, new = before[k], after[k]
        assert new["pid"] != old["pid"] and new["epoch"] == old["epoch"] + 1
        assert new["restored_version"] == (checkpoint or None)    # rolled back to the checkpoint
    ledger = dep.sample_ledger()
    assert ledger["epoch"] == 0 and ledger["taken"] == ledger["stored"]
    assert {seq: ledger["trained"].get(seq, 0) for seq in range(ledger["taken"])} == \
        {seq: 1 for seq in range(ledger["taken"])}          # every acknowledged sample, exactly once
    rid = dep.submit([1, 50, 51, 52], max_tokens=4, ignore_eos=True)   # the node serves again
    assert len(list(dep.stream(rid))) == 4


def test_a_node_whose_group_restarts_gets_no_work_until_it_is_back(deployment):
    """SIGKILL an idle stage worker (no op in flight, so no peer's receive fails): Ray
    Train's poll finds it and the GroupWatch callback tells the controller before the new
    group starts, so the node is avoided at once; round-robin requests sent meanwhile all
    finish on the other node while it restarts, and it takes work again once back. On the
    node data plane (the controller's, kept to compare, restarts groups the same way: the
    test above kills a worker there)."""
    import os
    import signal

    if deployment[1].stage.data_plane == "controller":
        pytest.skip("the controller's data plane (kept to compare) is restarted by the test above")

    dep, config, _ = deployment
    dep.use_policy("mix-rr")
    dep.drain()
    before = dep.registry()
    stats = dep.stats()
    restarts = len(stats["restarts"])
    # a node with a restart left (stage.max_failures is 1; an earlier test may have used one)
    victim = min(range(config.nodes), key=lambda n: (sum(r["node"] == n for r in stats["restarts"]), -n))
    assert not [r for r in stats["restarts"] if r["node"] == victim]
    os.kill(before[f"node-{victim}/stage-1"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while victim not in dep.stats()["restarting_nodes"]:
        assert time.monotonic() < deadline, "the controller never learnt of the failure"
        time.sleep(0.05)
    assert dep.registry()[f"node-{victim}/stage-0"]["pid"] == before[f"node-{victim}/stage-0"]["pid"]  # not yet back
    rids = [dep.submit([1, 60 + i, 61, 62], max_tokens=4, ignore_eos=True) for i in range(4)]
    results = [dep.result(rid) for rid in rids]
    assert [r["finish_reason"] for r in results] == ["length"] * 4
    assert victim in dep.stats()["restarting_nodes"]        # all served while it restarted
    deadline = time.monotonic() + 120
    while victim in (stats := dep.stats())["restarting_nodes"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    new = [(r["node"], r["epoch"], r["reason"][:90]) for r in stats["restarts"][restarts:]]
    assert len(new) == 1, new                               # told once, not again at registration
    assert dep.registry()[f"node-{victim}/stage-0"]["pid"] != before[f"node-{victim}/stage-0"]["pid"]
    rids = [dep.submit([1, 70 + i, 71], max_tokens=3, ignore_eos=True) for i in range(4)]
    assert [len(dep.result(rid)["tokens"]) for rid in rids] == [3] * 4
    assert dep.health()["nodes_restarting"] == 0


# -- the controllers' deaths: the online controller (Ray restarts it) on the node plane, where
# the worker groups outlive it; a node's Ray Train controller on the controller's data plane

def test_a_killed_controller_is_restarted_and_resumes_without_losing_work(deployment):
    """ray.kill the controller while requests decode and a training task runs: the calls in
    flight fail (the client sees an error), Ray restarts the controller, the stage workers
    outlive it (the same processes) and register with the new one after rolling back to
    the newest checkpoint, and the acknowledged samples are all trained exactly once.
    (Streams kept over HTTP through such a death: tests/serve/deployment/test_deployment_faults.py.)
    On the controller's data plane the groups go with the controller."""
    dep, config, _ = deployment
    if config.stage.data_plane == "controller":
        pytest.skip("on the controller's data plane the worker groups go with the controller")
    rng = seeded_rng(3, "test-faults")
    dep.drain()
    pids = {key: w["pid"] for key, w in dep.registry().items()}
    committed = (dep.train_status()["last_checkpoint"] or {}).get("version", 0)   # the ledger's last commit
    dep.add_samples([learnable_pair(rng, 12, 259) for _ in range(2)])
    rids = [dep.submit([1] + [40 + (i * 7 + j) % 50 for j in range(15)], max_tokens=60, ignore_eos=True)
            for i in range(3)]
    dep.train()
    deadline = time.monotonic() + 60
    while min(dep.progress(r)["tokens"] for r in rids) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    killed = time.monotonic()
    ray.kill(dep.controller, no_restart=False)
    outcomes = []
    for rid in rids:      # each ends with its tokens or an error: here the actor's death
        try:
            outcomes.append(dep.result(rid)["finish_reason"])
        except RayActorError:
            outcomes.append("error")
    assert set(outcomes) <= {"length", "error"} and "error" in outcomes
    rid = dep.submit([1, 50, 51, 52], max_tokens=4, ignore_eos=True)    # starts it again
    assert len(list(dep.stream(rid))) == 4
    assert time.monotonic() - killed < 120
    workers = dep.registry()
    assert {key: w["pid"] for key, w in workers.items()} == pids        # the groups outlived it
    assert all(w["rejoined"] for w in workers.values())
    timeline = dep.stats()["start_timeline"]
    assert "groups_found" in timeline and "groups_released" not in timeline, timeline
    # the restarted controller answers for the requests of the one before: they ended
    # with an error (ids are never reused), and an id it never issued is refused
    lost = dep.result(rids[0])
    assert lost["finish_reason"] == "error" and "restarted" in lost["error"]
    assert dep.progress(rids[1])["finish_reason"] == "error"
    with pytest.raises(ValueError, match="no such request"):
        dep.progress(rid + 10 ** 9)
    assert dep.train_status()["resumed"]["adapter_version"] >= committed     # never behind the checkpoint
    trained_exactly_once(dep.drain, dep.sample_ledger, 120)


def test_a_killed_train_controller_starts_a_new_run_from_the_checkpoint(deployment):
    """A node's Ray Train controller (the process that owns its worker group) dies: its
    workers die with it; a new run of the same name restores the newest checkpoint, the
    requests in flight end with their tokens or an error, the other node keeps its workers,
    and nothing trained is lost."""
    import psutil

    dep, config, _ = deployment
    if config.stage.data_plane != "controller":
        pytest.skip("one plane loses a Ray Train controller: the controller's (the node plane loses its controller)")
    rng = seeded_rng(4, "test-faults")
    dep.drain()     # (a resumed run's commits can lag a minute: docs/online-live.md)
    before = dep.registry()
    dep.add_samples([learnable_pair(rng, 12, 259) for _ in range(2)])
    rids = [dep.submit([1] + [40 + (i * 5 + j) % 50 for j in range(15)], max_tokens=60, ignore_eos=True)
            for i in range(4)]
    dep.train()
    deadline = time.monotonic() + 30     # a controller of an earlier run may still be exiting
    while len(alive := [p.pid for p in psutil.process_iter(["cmdline"])
                        if (p.info["cmdline"] or [""])[0].startswith("ray::TrainController")]) != config.nodes:
        assert time.monotonic() < deadline, f"Ray Train controllers alive: {alive}"
        time.sleep(0.2)
    restarts = len(dep.stats()["restarts"])
    os.kill(alive[0], signal.SIGKILL)
    results = [dep.result(rid) for rid in rids]
    for r in results:
        assert r["finish_reason"] in ("length", "error"), r
        if r["finish_reason"] == "length":
            assert len(r["tokens"]) == 60
        else:
            assert "node" in r["error"], r["error"]
    rid = dep.submit([1, 50, 51, 52], max_tokens=4, ignore_eos=True)
    assert len(list(dep.stream(rid))) == 4
    deadline = time.monotonic() + 60
    while not (new := [r for r in dep.stats()["restarts"][restarts:] if "Ray Train controller died" in r["reason"]]):
        assert time.monotonic() < deadline, dep.stats()["restarts"]
        time.sleep(0.2)
    (victim,) = {r["node"] for r in new}
    keys, after = _new_group_of(dep, before, victim, config.stages, "pid")     # the new run's group
    assert all(after[k]["pid"] == before[k]["pid"] for k in before if k not in keys), (before, after)
    trained_exactly_once(dep.drain, dep.sample_ledger, 120)
    rid = dep.submit([1, 50, 51, 52], max_tokens=4, ignore_eos=True)
    assert len(list(dep.stream(rid))) == 4


def _new_group_of(dep, before: dict, node: int, stages: int, field: str, timeout_s: float = 240.0):
    """Wait until every stage of ``node`` registered anew (its ``field``, epoch or pid, no
    longer the one in ``before``): the node's keys and the registry then."""
    deadline = time.monotonic() + timeout_s
    keys = [f"node-{node}/stage-{s}" for s in range(stages)]
    while any((after := dep.registry())[k][field] == before[k][field] for k in keys):
        assert time.monotonic() < deadline, f"node {node}'s new worker group never registered"
        time.sleep(0.5)
    return keys, after


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "raycolo.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args,field", [
    (["online", "run", "missing.yaml"], "missing.yaml: config file not found"),
    (["online", "run", "examples/online.yaml", "--tasks", "0"], "--tasks: must be at least 1"),
    (["online", "run", "examples/online.yaml", "--max-length", "1e30"], "--max-length: must be"),
    (["online", "run", "examples/online.yaml", "--rate", "inf"], "--rate: must be a finite number"),
    (["online", "run", "examples/online.yaml", "--train-rate", "nan"], "--train-rate"),
    (["online", "run", "examples/online.yaml", "--preference-share", "1.5"], "--preference-share"),
    (["online", "run", "examples/online.yaml", "--preference-share", "nan"], "--preference-share"),
])
def test_online_run_cli_errors(args, field):
    proc = _cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), proc.stderr


@pytest.mark.parametrize("field", ["sample_store", "storage_path"])
def test_an_unwritable_store_or_checkpoint_directory_is_refused_before_ray_starts(tmp_path, field):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = tmp_path / "online.yaml"
    text = (ROOT / "examples" / "online.yaml").read_text()
    config.write_text(re.sub(rf"^{field}:.*$", f"{field}: {blocker / 'sub'}", text, flags=re.M))
    # one command per field (both check both fields with one method, OnlineConfig.check_paths)
    args = ["online", "run", str(config), "--tasks", "2"] if field == "sample_store" else ["serve", str(config)]
    proc = _cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: {field}: cannot write {blocker / 'sub'}: Not a directory"], proc.stderr


def test_online_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, field in (("nodes: 0\n", "nodes"), ("policy: fifo\n", "policy"), ("lora: {rank: -1}\n", "lora.rank"),
                        ("stage: {backend: mpi}\n", "stage.backend"), ("max_tokens: .nan\n", "max_tokens"),
                        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "")):
        bad.write_text(text)
        proc = _cli("online", "run", str(bad))
        assert proc.returncode == 2, text
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {bad}"), proc.stderr
        assert field in lines[0]
