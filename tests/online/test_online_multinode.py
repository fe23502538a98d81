"""The live online runtime on a real 2-raylet cluster, and the loss of the raylet that holds
its controller.

``ray.cluster_utils.Cluster`` starts a head and a worker raylet on 127.0.0.1, one logical
GPU each; the deployment is 2 nodes x 1 stage, so each raylet holds one node's stage
worker, and the controller is placed on the worker raylet. Then that raylet dies (its
processes killed, not drained): Ray restarts the controller on the head, which starts with
the one GPU left, serves within bounded time, keeps every acknowledged sample, and takes
the lost node back once a raylet with a GPU joins again.
"""
from __future__ import annotations

import os
import time

import pytest
import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycolo.actors.local_cluster import join_cluster
from raycolo.actors.online.controller import OnlineController
from raycolo.actors.local_cluster import NAMESPACE
from raycolo.actors.online.launch import OnlineDeployment, learnable_pair
from raycolo.rng import seeded_rng

from tests.support.online_checks import free_port, small_online_config, trained_exactly_once
from tests.support.ray_clusters import two_raylets

VOCAB = 259
RECOVERY_S = 240.0     # controller restart + one node's group start on 2 cores, with margin
SLOT = "controller_slot"
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}   # one per raylet: where the test lets the controller go


@ray.remote(num_cpus=0, resources={SLOT: 1})
class Placeholder:
    """Holds the head's controller slot, so that the controller starts on the worker raylet."""

    def ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",)}
    # Ray Train retries placing a group that does not fit every this many seconds (60 by
    # default): the lost node's group is placed again soon after a GPU comes back
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"
    # The GCS declares a raylet dead after this many failed health checks this far apart
    # (Ray's defaults, 5 x 3 s, would add about 12 s of waiting to each raylet killed here)
    try:
        with two_raylets("raycolo-omn-", dict(num_gpus=1, num_cpus=3, resources={SLOT: 1}, _system_config=HEALTH_CHECKS),
                         dict(num_gpus=1, num_cpus=2, resources={SLOT: 1})) as c:
            join_cluster(c.address, namespace=NAMESPACE, log_to_driver=False)
            out = tmp_path_factory.mktemp("online-multinode")
            config = small_online_config(out, nodes=2, stages=1, train_rate=0.5, lora={"checkpoint_every": 1},
                                         stage={"max_failures": 2, "start_grace_s": 5, "rejoin_s": 10})
            state = {"cluster": c, "config": config}
            yield state
            if state.get("dep") is not None:
                try:
                    state["dep"].stop()
                except Exception:       # the deployment may be what failed
                    pass
            ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _healthy_away_from(dep, gone: str, timeout_s: float) -> dict:
    """Poll until the controller runs on a node other than ``gone`` and serves (its calls
    are refused while Ray restarts it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            moved = ray.get(dep.controller.placement.remote(), timeout=30)["controller"] != gone
            health = ray.get(dep.controller.health.remote(), timeout=30)
            if moved and health["status"] in ("ok", "degraded"):
                return health
        except (RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, f"not serving {timeout_s:.0f} s after the node loss"
        time.sleep(1.0)


def _call(dep, method: str, *args, timeout_s: float = 120.0):
    """A controller call with a bound on the wait."""
    return ray.get(getattr(dep.controller, method).remote(*args), timeout=timeout_s)


def _step(what: str, since: float) -> None:
    print(f"[{time.monotonic() - since:6.1f} s] {what}", flush=True)


def _all_trained_once(dep, timeout_s: float) -> dict:
    def explain() -> str:
        stats = _call(dep, "stats")
        return (f"restarts: {stats['restarts']}\nerrors: {stats['errors']}\n"
                f"train: {_call(dep, 'train_status')}\nhealth: {_call(dep, 'health')}")

    return trained_exactly_once(lambda: _call(dep, "drain"), lambda: _call(dep, "sample_ledger"), timeout_s, explain)


def test_the_deployment_spans_both_raylets_and_survives_losing_the_controllers(cluster):
    c, config = cluster["cluster"], cluster["config"]
    head_id, worker_id = c.head_node.node_id, c.worker.node_id
    name = "raycolo-online-multinode"
    t0 = time.monotonic()
    holder = Placeholder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head_id, soft=False)).remote()
    ray.get(holder.ready.remote(), timeout=60)
    controller = OnlineController.options(name=name, namespace=NAMESPACE, max_restarts=-1,
                                          resources={SLOT: 1}).remote(config.model_dump(), name, NAMESPACE)
    ray.get(controller.start.remote(240), timeout=300)
    dep = cluster["dep"] = OnlineDeployment(controller, config, name, False)
    _step("started on 2 raylets", t0)
    where = _call(dep, "placement")
    assert where["controller"] == worker_id
    assert sorted(where["stage_workers"].values()) == sorted([head_id, worker_id])   # one node per raylet

    rng = seeded_rng(5, "test-online-multinode")
    _call(dep, "add_samples", [learnable_pair(rng, 12, VOCAB) for _ in range(4)], True)
    rids = [_call(dep, "submit", [1] + [40 + (i * 7 + j) % 50 for j in range(15)], 8, 0.0, 1.0, 0, True)
            for i in range(4)]
    assert [len(_call(dep, "result", r)["tokens"]) for r in rids] == [8] * 4    # served by both nodes
    _call(dep, "drain")
    before = _call(dep, "sample_ledger")["stored"]
    assert before == 4
    _step("served and trained", t0)

    ray.kill(holder)                                     # the head may take the controller now
    lost_at = time.monotonic()
    c.remove_node(c.worker, allow_graceful=False)        # the controller's raylet dies
    _step("removed the worker raylet", t0)
    health = _healthy_away_from(dep, worker_id, RECOVERY_S)
    _step(f"serving again: {health}", t0)
    recovered_s = time.monotonic() - lost_at
    assert health["nodes_restarting"] == 1                 # the node whose GPU went away
    placed = _call(dep, "placement")
    assert placed["controller"] == head_id and list(placed["stage_workers"].values()) == [head_id]
    rid = _call(dep, "submit", [1, 50, 51, 52], 4, 0.0, 1.0, 0, True)
    assert len(_call(dep, "result", rid)["tokens"]) == 4
    _call(dep, "add_samples", [learnable_pair(rng, 12, VOCAB) for _ in range(2)], True)   # accepted after the loss
    ledger = _all_trained_once(dep, 120)
    assert ledger["stored"] == before + 2                 # nothing acknowledged was lost
    _step(f"all samples trained once; serving again {recovered_s:.1f} s after the controller's raylet died", t0)

    c.worker = c.add_node(node_ip_address="127.0.0.1", num_gpus=1, num_cpus=2)   # a GPU comes back
    deadline = time.monotonic() + 120
    while _call(dep, "health")["nodes_restarting"]:
        assert time.monotonic() < deadline, "the node was not taken back after a raylet with a GPU joined"
        time.sleep(1.0)
    _step("the lost node is back", t0)
    assert sorted(_call(dep, "placement")["stage_workers"].values()) == sorted([head_id, c.worker.node_id])
    rids = [_call(dep, "submit", [1] + [60 + j for j in range(10)], 4, 0.0, 1.0, 0, True) for _ in range(4)]
    assert [len(_call(dep, "result", r)["tokens"]) for r in rids] == [4] * 4

    # the other raylet dies now (the controller stays): the head keeps serving and training,
    # and what the lost node trained since its checkpoint is trained on the head within
    # stage.rejoin_s of Ray noticing, not when (if ever) the node comes back
    _call(dep, "add_samples", [learnable_pair(rng, 12, VOCAB) for _ in range(6)], True)
    lost_at = time.monotonic()
    c.remove_node(c.worker, allow_graceful=False)
    ledger = _all_trained_once(dep, 120)
    assert ledger["stored"] == before + 2 + 6
    rid = _call(dep, "submit", [1, 70, 71], 4, 0.0, 1.0, 0, True)
    assert len(_call(dep, "result", rid)["tokens"]) == 4
    stats = _call(dep, "stats")
    _step(f"the other raylet died: all {ledger['stored']} samples trained once "
          f"{time.monotonic() - lost_at:.1f} s later; restarts {[r['reason'][:60] for r in stats['restarts']]}", t0)


def test_raycolo_serve_joins_the_cluster_answers_and_leaves_nothing_listening(cluster, tmp_path):
    """``raycolo serve CONFIG --address`` as a user runs it against the 2-raylet cluster:
    it serves the OpenAI API, and after Ctrl-C nothing answers on its port (Serve's proxy
    goes with the last application)."""
    import selectors
    import signal
    import subprocess
    import sys

    import httpx
    import yaml

    if cluster.get("dep") is not None:       # the first test's deployment: its GPUs back
        try:
            _call(cluster["dep"], "stop", timeout_s=120)
            ray.kill(cluster["dep"].controller, no_restart=True)
        except Exception:
            pass
        cluster["dep"] = None
    # That deployment stopped with one node restarting for good (its raylet is gone): the
    # node's new worker group can take the GPU the other group freed just before the
    # controller is killed, and Ray removes a placement group with its job, not its actor
    # (a `raycolo serve` process that exits takes them with it). This cluster is the
    # test's own: free every placement group left.
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
    for group, info in placement_group_table().items():
        if info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group))))
    deadline = time.monotonic() + 60        # its stage workers' GPU is free again
    while ray.available_resources().get("GPU", 0) < 1:
        assert time.monotonic() < deadline, f"no GPU free: {ray.available_resources()}"
        time.sleep(0.5)
    port = free_port()
    config = cluster["config"].model_dump(mode="json")
    config.update(nodes=1, stages=1, sample_store=str(tmp_path / "samples"), storage_path=str(tmp_path / "ckpt"))
    config["serve"].update(port=port, app_name="raycolo-mn")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    proc = subprocess.Popen([sys.executable, "-m", "raycolo.cli", "serve", str(path), "--address",
                             cluster["cluster"].address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=tmp_path)
    try:
        deadline, text = time.monotonic() + 180, ""
        readable = selectors.DefaultSelector()        # every wait bounded: no readline on a silent pipe
        readable.register(proc.stdout, selectors.EVENT_READ)
        while "raycolo: serving" not in text:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, text[-3000:]
            # Raw reads of the pipe: a buffered readline would keep the lines after the first
            # of a chunk in Python's buffer, where select() never sees them
            if readable.select(timeout=min(left, 1.0)):
                text += os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
        url = f"http://127.0.0.1:{port}/v1"
        models = httpx.get(f"{url}/models", timeout=30).json()
        assert [m["id"] for m in models["data"]][0] == "tiny-llama-s"
        answer = httpx.post(f"{url}/completions", json={"model": "tiny-llama-s", "prompt": "hi", "max_tokens": 3,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120).json()
        assert answer["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=180)[0].decode(errors="replace")
    assert proc.returncode == 0, rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
