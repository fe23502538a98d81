"""Faults of the live online runtime beyond a stage worker's death (test_online_live.py):
the whole deployment restarted on its storage, its controller killed (Ray restarts it),
and a node's Ray Train controller killed. After each, every acknowledged training sample
is trained exactly once in what the adapters keep, every accepted request ended with its
tokens or an error, and the adapter version never went back past the last checkpoint.

One node of two stages keeps the module to a few worker-group starts (~15 s each).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from ray.exceptions import RayActorError

from raycolo.actors.online.launch import OnlineDeployment, learnable_pair
from raycolo.rng import seeded_rng

from tests.support.online_checks import trained_exactly_once, small_online_config

VOCAB = 259


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    config = small_online_config(
        out, nodes=1, stages=2, train_rate=0.5, lora={"checkpoint_every": 1},
        # the two stages share one (logical) GPU: Ray Train places them with half a GPU each
        stage={"max_failures": 2, "gpus_per_worker": 0.5})
    ray.init(address="local", num_gpus=config.gpus_needed(), num_cpus=4, include_dashboard=False,
             log_to_driver=False, namespace="raycolo")
    assert config.gpus_needed() == 1
    state = {"config": config, "rng": seeded_rng(3, "test-faults")}
    yield state
    try:
        if state.get("dep") is not None:
            state["dep"].stop()
    finally:
        ray.shutdown()


def _wait_committed(dep, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (stats := dep.stats())["checkpoints_uncommitted"]:    # Ray Train commits in ~1 s
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return stats


def _trained_exactly_once(dep, timeout_s: float = 120.0) -> dict:
    """Every stored sample is trained exactly once in what the adapters keep (waits for the
    resumed training to finish)."""
    return trained_exactly_once(dep.drain, dep.sample_ledger, timeout_s)


def test_a_restarted_deployment_takes_up_its_checkpoint_and_the_samples_stored_since(setup):
    config, rng = setup["config"], setup["rng"]
    dep = OnlineDeployment.start(config, timeout_s=240)
    assert dep.train_status()["resumed"]["samples_resumed"] == 0      # nothing earlier
    for _ in range(2):
        dep.add_samples([learnable_pair(rng, 12, VOCAB) for _ in range(2)])
        dep.train()
        dep.drain()
    _wait_committed(dep)
    version = dep.train_status()["adapter_version"]
    assert version >= 2
    dep.add_samples([learnable_pair(rng, 12, VOCAB) for _ in range(2)])   # acknowledged, not trained
    dep.stop()

    dep = setup["dep"] = OnlineDeployment.start(config, timeout_s=240)
    status = dep.train_status()
    assert status["resumed"]["adapter_version"] == version
    assert status["resumed"]["samples_held"] == 4 and status["resumed"]["samples_resumed"] == 2
    assert {w["restored_version"] for w in dep.registry().values()} == {version}
    ledger = _trained_exactly_once(dep)
    assert ledger["stored"] == 6
    assert dep.train_status()["adapter_version"] > version      # counts on from the restored one


def test_a_killed_controller_is_restarted_and_resumes_without_losing_work(setup):
    """ray.kill the controller while requests decode and a training task runs: the calls in
    flight fail (the client sees an error), Ray restarts the controller, the stage workers
    outlive it (the same processes) and register with the new one after rolling back to
    the newest checkpoint, and the acknowledged samples are all trained exactly once."""
    dep, rng = setup["dep"], setup["rng"]
    dep.drain()
    pids = {key: w["pid"] for key, w in dep.registry().items()}
    committed = (dep.train_status()["last_checkpoint"] or {}).get("version", 0)   # the ledger's last commit
    dep.add_samples([learnable_pair(rng, 12, VOCAB) for _ in range(2)])
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
    recovery_s = time.monotonic() - killed
    assert recovery_s < 120
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
    status = dep.train_status()
    assert status["resumed"]["adapter_version"] >= committed          # never behind the checkpoint
    _trained_exactly_once(dep)


def test_a_killed_train_controller_starts_a_new_run_from_the_checkpoint(setup):
    """The node's Ray Train controller (the process that owns its worker group) dies: its
    workers die with it; a new run of the same name restores the newest checkpoint, the
    requests in flight end with their tokens or an error, and nothing trained is lost."""
    import psutil

    dep, rng = setup["dep"], setup["rng"]
    dep.drain()     # (a resumed run's commits can lag a minute: docs/online-live.md)
    before = dep.registry()
    dep.add_samples([learnable_pair(rng, 12, VOCAB) for _ in range(2)])
    rids = [dep.submit([1] + [40 + (i * 5 + j) % 50 for j in range(15)], max_tokens=60, ignore_eos=True)
            for i in range(3)]
    dep.train()
    deadline = time.monotonic() + 30     # a controller of an earlier run may still be exiting
    while len(alive := [p.pid for p in psutil.process_iter(["cmdline"])
                        if (p.info["cmdline"] or [""])[0].startswith("ray::TrainController")]) != 1:
        assert time.monotonic() < deadline, f"Ray Train controllers alive: {alive}"
        time.sleep(0.2)
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
    stats = dep.stats()
    assert any("Ray Train controller died" in r["reason"] for r in stats["restarts"]), stats
    after = dep.registry()
    assert all(after[k]["pid"] != before[k]["pid"] for k in before), (before, after)
    _trained_exactly_once(dep)
