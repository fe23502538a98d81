"""LeMix scheduler and cluster simulator: hand-worked algorithms, policies, conservation."""
import json
import subprocess
import sys

import pytest

from raycolo.online.scheduling.allocation import (best_node, idleness_profit, length_consistency, priority,
                                       violates_slo)
from raycolo.online.lemix_params import LemixParams
from raycolo.online.scheduling.planning import NodeTrace, commit, compute_idleness
from raycolo.online.profiles import preset
from raycolo.online.scheduling.scheduler import OnlineScheduler
from raycolo.online.simulation.sim import ClusterSimulator, simulate
from raycolo.online.tasks import OnlineTask, poisson_workload
from raycolo.online.policies import get_online_policy, make_online_policy, online_policy_names
from raycolo.online.policies.lemix import LengthBlind
from raycolo.online.policies.baselines import train_node_count

UNIT = LengthBlind(forward=1.0, backward=2.0)  # every forward 1 s, every backward 2 s, per stage


def test_algorithm1_hand_worked_far_dependency():
    """S = 2. T (training) arrives at 0 on an idle node, P (inference) at 0.5, then X.

    T: s1 forward [0,1], s2 [1,2]; backward s2 [2,4], s1 [4,6]; Π = 0 + (1-0) = 1, R = 2.
    P: s1 [max(.5, 1)=1, 2] ends before T's s1 backward (4): Π += 0.
       s2 [2,3] would overlap T's s2 backward [2,4] -> pushed to [4,5]; T's backward ran
       after P's predecessor's forward (2 <= 2), so offset 2: Π += 4-2-2 = 0. R = 5-.5.
    X at 3.5: s1 [3.5,4.5] overlaps T's s1 backward [4,6] -> [6,7], offset 2 (2 <= 4):
       Π += 6-2-2 = 2; s2 [max(7, 5)=7, 8]: Π += 7-5 = 2. Π = 4, R = 8-3.5 = 4.5.
    """
    trace = NodeTrace(stages=2)
    t = compute_idleness(trace, 0, 0.0, 10, 1, True, UNIT, now=0.0)
    assert (t.idle, t.response) == (1.0, 2.0)
    assert [(s.start_f, s.end_f, s.start_b, s.end_b) for s in t.path.stages] == [(0, 1, 4, 6), (1, 2, 2, 4)]
    commit(trace, t.path)
    p = compute_idleness(trace, 1, 0.5, 10, 1, False, UNIT, now=0.5)
    assert [(s.start_f, s.end_f) for s in p.path.stages] == [(1, 2), (4, 5)]
    assert (p.idle, p.response) == (0.0, 4.5)
    commit(trace, p.path)
    x = compute_idleness(trace, 2, 3.5, 10, 1, False, UNIT, now=3.5)
    assert [(s.start_f, s.end_f) for s in x.path.stages] == [(6, 7), (7, 8)]
    assert (x.idle, x.response) == (4.0, 4.5)
    # the same task arriving at 1.5 fits before T's backward on s1 and after it on s2
    y = compute_idleness(trace, 3, 1.5, 10, 1, False, UNIT, now=1.5)
    assert [(s.start_f, s.end_f) for s in y.path.stages] == [(2, 3), (5, 6)]
    assert (y.idle, y.response) == (0.0, 4.5)


def _two_node_scheduler(params=None):
    params = params or LemixParams()
    profile = preset("gpt-400m", stages=1)  # forward_latency 0.03 s: τ = 0.03 s, τ_R = 0.15 s
    sched = OnlineScheduler(get_online_policy("lemix")(params), [profile] * 2, [UNIT] * 2, params)
    busy = compute_idleness(sched.traces[0], 100, 0.0, 10, 1, False, UNIT, now=0.0)  # [0, 1]
    commit(sched.traces[0], busy.path)
    sched.last_arrival_s = 0.0
    return sched


@pytest.mark.parametrize("previous_arrival, expected_node, f0, f1", [
    # A task at 0.5; node 0 is busy until 1, node 1 idle since 0. τ = 0.03, τ_R = 0.15.
    # Node 0: forward [1, 2], Π0 = 0, R0 = 1.5, IP0 = -max(0 - Δa, .03) = -.03, f0 = -.03·1.5.
    # Node 1: forward [.5, 1.5], Π1 = min(.5, τ_R) = .15, R1 = 1.
    # Δa = 0.5: IP1 = -max(.15 - .5, .03) = -.03, f1 = -.03·1: node 1 answers sooner, wins.
    (0.0, 1, -0.03 * 1.5, -0.03 * 1.0),
    # Δa = 0.01: IP1 = -max(.15 - .01, .03) = -.14, f1 = -.14·1 < f0: consolidate on node 0.
    (0.49, 0, -0.03 * 1.5, -0.14 * 1.0),
])
def test_allocation_picks_the_node_eq3_scores_highest(previous_arrival, expected_node, f0, f1):
    sched = _two_node_scheduler(LemixParams(arrival_gap="global"))
    sched.last_arrival_s = previous_arrival
    arrival = 0.5
    scores = []
    for trace in sched.traces:
        plan = compute_idleness(trace, 1, arrival, 10, 1, False, UNIT, now=arrival, idle_cap=0.15)
        ip = idleness_profit(plan.idle, 1, arrival - previous_arrival, tau=0.03)
        lc = length_consistency(10, trace.count, trace.length_mean, trace.length_std)
        scores.append(priority(ip, lc, plan.response, 1.0, 10.0))
    assert scores == pytest.approx([f0, f1])
    assert best_node(scores) == expected_node
    task = OnlineTask(1, "inference", arrival, 10, 1, 4)
    assert sched.submit(task, now=arrival).node == expected_node


def test_node_arrival_gap_measures_from_the_task_last_placed_on_each_node():
    # As above, with LeMix's code's Δa: node 0's last task arrived at 0 (Δa = .5), node 1
    # has none (Δa = 0): IP1 = -max(.15 - 0, .03) = -.15, f1 = -.15·1 < f0 = -.03·1.5, so
    # the task joins busy node 0 whatever arrived elsewhere in between.
    for previous_arrival in (0.0, 0.49):
        sched = _two_node_scheduler(LemixParams(arrival_gap="node"))
        sched.last_arrival_s = previous_arrival
        assert sched.submit(OnlineTask(1, "inference", 0.5, 10, 1, 4), now=0.5).node == 0


def test_priority_is_eq3_for_positive_numerators_and_decreasing_in_r_otherwise():
    assert priority(0.2, 0.01, 2.0, lambda1=1.0, lambda2=10.0) == pytest.approx((0.2 + 0.1) / 2.0)
    assert priority(-0.2, 0.0, 2.0, 1.0, 10.0) == pytest.approx(-0.4)
    assert priority(-0.2, 0.0, 1.0, 1.0, 10.0) > priority(-0.2, 0.0, 2.0, 1.0, 10.0)
    # LeMix's code: the plain quotient, which prefers the larger R below zero
    assert priority(-0.2, 0.0, 2.0, 1.0, 10.0, rule="quotient") == pytest.approx(-0.1)
    assert priority(-0.2, 0.0, 2.0, 1.0, 10.0, "quotient") > priority(-0.2, 0.0, 1.0, 1.0, 10.0, "quotient")
    assert priority(0.2, 0.01, 2.0, 1.0, 10.0, "quotient") == priority(0.2, 0.01, 2.0, 1.0, 10.0)
    assert idleness_profit(idle=4.0, stages=2, interarrival=0.5, tau=0.1) == -1.5
    assert idleness_profit(idle=0.0, stages=2, interarrival=0.5, tau=0.1) == -0.1
    assert length_consistency(100, 1, 100.0, 0.0) == 0.0  # no spread yet
    assert length_consistency(100, 5, 100.0, 10.0) == pytest.approx(1 / (10 * (2 * 3.141592653589793) ** 0.5))
    # the shape form (the default): exp(-z²/2) times τ, whatever σ; at most τ
    assert length_consistency(100, 5, 100.0, 10.0, shape_scale=0.03) == pytest.approx(0.03)
    assert length_consistency(110, 5, 100.0, 10.0, shape_scale=0.03) == pytest.approx(0.03 * 0.6065306597)
    assert length_consistency(100, 5, 100.0, 0.2, shape_scale=0.03) == pytest.approx(0.03)   # σ >= 1 token
    assert best_node([1.0, 3.0, 3.0]) == 1


def test_deprioritization_triggers_exactly_when_eq4_says():
    # min(1.0 + 0.5, 2.0 + 0.1) - 0.2 = 1.3
    assert not violates_slo([1.0, 2.0], [0.5, 0.1], 0.2, slo_s=1.3)
    assert violates_slo([1.0, 2.0], [0.5, 0.1], 0.2, slo_s=1.2999)
    # Through the policy: one node (S = 1) busy until 1; a training task at 0.5 plans its
    # forward [1, 2]. The predicted next inference arrives at max(0.5, 0 + gap .5) = 0.5
    # with length 10: it could start at 2 and end at 3, R' = 2.5 s. Held iff 2.5 > τ_R.
    # Batch-aware (the default), it waits for its batch (.015 s), starts at 2 but would
    # overlap T's backward [2, 4], so it runs after it: [4, 5], R' = 4.5 s.
    for slo_ms, held, aware in ((2500.0, False, False), (2499.0, True, False),
                                (4500.0, False, True), (4499.0, True, True)):
        params = LemixParams(slo_ms=slo_ms, batch_aware=aware, hold_share=1.0)
        profile = preset("gpt-400m", stages=1)
        sched = OnlineScheduler(get_online_policy("lemix")(params), [profile], [UNIT], params)
        busy = compute_idleness(sched.traces[0], 100, 0.0, 10, 1, False, UNIT, now=0.0)
        commit(sched.traces[0], busy.path)
        sched.inference_length, sched.last_inference_s, sched.inference_gap_s = 10.0, 0.0, 0.5
        decision = sched.submit(OnlineTask(1, "train", 0.5, 10, 1, 0), now=0.5)
        assert (decision is None) == held, slo_ms
        assert (sched.deferred != []) == held


def _simulate(policy, model="llama-8b", rate=50, alpha=0.5, tasks=400, seed=0, params=None):
    workload = poisson_workload(rate, alpha, tasks, seed=seed)
    params = params or LemixParams()
    return workload, simulate(workload, preset(model, 2), 4,
                              make_online_policy(policy, params, nodes=4, train_rate=alpha), params)


@pytest.mark.parametrize("policy", online_policy_names())
def test_every_task_completes_exactly_once(policy):
    workload, result = _simulate(policy, model="llama-70b", rate=100, alpha=0.5, tasks=300)
    assert result.completions == {t.task_id: 1 for t in workload}
    assert result.train_done == sum(t.is_train for t in workload)
    assert len(result.ttft_s) == sum(not t.is_train for t in workload)
    assert 0 <= result.slo_attainment <= 1 and 0 <= result.idle_fraction <= 1
    assert 0 < result.active_nodes_mean <= 4


def test_a_cluster_that_forgets_finished_tasks_keeps_its_counts_and_frees_their_records():
    """What a long-running service does (raycolo/actors/online/controller.py): forget the finished
    tasks' records. The counts, the active-node area and the results of the tasks kept are
    those of a run that forgot nothing."""
    workload = poisson_workload(50, 0.5, 400, seed=0)
    params = LemixParams()
    sim = ClusterSimulator(workload, preset("llama-8b", 2), 4, make_online_policy("lemix", params, nodes=4), params)
    full = sim.run()
    old = [t.task_id for t in sorted(workload, key=lambda t: t.arrival_s)[:300]]
    kept = [t for t in workload if t.task_id not in set(old)]
    metrics = sim.cluster.metrics
    ops = len(sim.cluster.op_log)
    sim.cluster.forget(old, keep_ops=10)
    metrics.forget([], keep_steps=5)          # fold the active-node steps too
    assert not set(old) & (set(metrics.completions) | set(metrics.ttft) | set(metrics.e2e) | set(metrics.staleness))
    assert not set(old) & set(sim.cluster._tasks) and len(metrics.active_steps) == 5
    assert len(sim.cluster.op_log) == 10 and sim.cluster.op_log_dropped == ops - 10
    after = sim.cluster.result(kept)
    assert after.completed == full.completed == len(workload) and metrics.completed == len(workload)
    assert after.active_nodes_mean * after.makespan_s == pytest.approx(full.active_nodes_mean * full.makespan_s)
    assert sorted(after.ttft_s) == sorted(full.ttft_s[[t.task_id not in set(old) for t in workload
                                                       if not t.is_train]])


def test_simulation_is_deterministic():
    _, a = _simulate("lemix", seed=3)
    _, b = _simulate("lemix", seed=3)
    _, c = _simulate("lemix", seed=4)
    strip = lambda s: {k: v for k, v in s.items() if k != "decision_us_mean"}  # noqa: E731
    assert strip(a.summary()) == strip(b.summary())
    assert strip(a.summary()) != strip(c.summary())


def test_memory_aware_policies_wait_and_offload_others_overrun():
    _, aware = _simulate("lemix", model="llama-70b", rate=100, alpha=0.9, tasks=300)
    assert aware.memory_waits > 0 and aware.offloads > 0 and aware.overruns == 0
    _, blind = _simulate("lemix-nomemory", model="llama-70b", rate=100, alpha=0.9, tasks=300)
    assert blind.memory_waits == 0 and blind.offloads == 0 and blind.overruns > 0


def test_continuous_batching_respects_max_batch_and_training_closes_a_batch():
    profile = preset("llama-8b", 2)
    params = LemixParams(max_batch=4, max_wait=100.0)
    tasks = [OnlineTask(i, "inference", 0.0, 64, 1, 3) for i in range(8)]
    policy = get_online_policy("mix-rr")(params)
    result = ClusterSimulator(tasks, profile, 1, policy, params).run()
    ttft = sorted(round(x, 9) for x in result.ttft_s)
    assert len(set(ttft)) == 2 and ttft[:4] == [ttft[0]] * 4  # two prefill batches of 4
    # a training task arriving while a batch is open closes it: the 2 inference tasks are
    # answered without waiting out T_w (100 forwards)
    tasks = [OnlineTask(0, "inference", 0.0, 64, 1, 2), OnlineTask(1, "inference", 0.0, 64, 1, 2),
             OnlineTask(2, "train", 0.001, 64, 1, 0)]
    result = ClusterSimulator(tasks, profile, 1, get_online_policy("mix-rr")(params), params).run()
    assert max(result.ttft_s) < 1.0


def test_separate_partitions_nodes_and_syncs_weights():
    assert [train_node_count(4, a) for a in (0.0, 0.1, 0.5, 0.9, 1.0)] == [0, 1, 2, 3, 4]
    _, sep = _simulate("separate", alpha=0.5, tasks=400, params=LemixParams(sync_every=20))
    _, mix = _simulate("lemix", alpha=0.5, tasks=400)
    assert sep.staleness.mean() > mix.staleness.mean()


def test_online_policies_are_registered():
    assert {"lemix", "mix-rr", "mix-luf", "separate", "harli", "lemix+harli", "harli-static", "sirius",
            "lemix+sirius", "sirius-timeshare", "sirius-static", "mace", "lemix+mace", "mace-sync",
            "mace-periodic"} <= set(online_policy_names())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "raycolo.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_simulate_online_cli_json_and_errors(tmp_path):
    proc = _cli("simulate-online", "--policy", "lemix", "--rate", "20", "--train-rate", "0.5",
                "--nodes", "4", "--stages", "2", "--model", "llama-8b", "--tasks", "200", "--seed", "0",
                "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("throughput", "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "idle_fraction",
                "active_nodes_mean", "train_done"):
        assert key in out
    assert out["completed"] == 200
    for args, field in ((["--rate", "-1"], "--rate"), (["--train-rate", "1.5"], "--train-rate"),
                        (["--model", "gpt-9"], "--model"), (["--policy", "fifo"], "--policy"),
                        (["--nodes", "0"], "--nodes"), (["--lengths", "xyz"], "--lengths")):
        proc = _cli("simulate-online", "--tasks", "50", *args)
        assert proc.returncode == 2, args
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), proc.stderr


def test_sweep_online_prints_tables_and_writes_plots(tmp_path):
    proc = _cli("sweep-online", "--policies", "lemix,mix-rr", "--rates", "10,40", "--train-rates", "0.5",
                "--tasks", "120", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "throughput (tasks/s)" in proc.stdout and "SLO attainment" in proc.stdout
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "slo_attainment.png").stat().st_size > 0
    proc = _cli("sweep-online", "--train-rates", "0.5,2", "--tasks", "10")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --train-rates")


def test_clocks_and_the_timeline_plot(tmp_path):
    from raycolo.online.simulation.clock import SimClock, WallClock

    clock = SimClock()
    clock.advance_to(2.5)
    assert clock.now() == 2.5
    with pytest.raises(ValueError):
        clock.advance_to(1.0)
    wall = WallClock()
    assert 0 <= wall.now() <= wall.now()
    proc = _cli("simulate-online", "--tasks", "100", "--rate", "20", "--plot", str(tmp_path / "t.png"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"plot: {tmp_path / 't.png'}"
    assert (tmp_path / "t.png").stat().st_size > 0


def test_simulate_online_replays_a_trace(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,length,kind\n" + "".join(
        f"{0.05 * i:.2f},{64 + 8 * (i % 5)},{'train' if i % 3 == 0 else 'inference'}\n" for i in range(60)))
    proc = _cli("simulate-online", "--trace", str(trace), "--policy", "separate", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["completed"] == 60 and out["train_done"] == 20
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,length\n0.0,12\n0.1,-3\n")
    proc = _cli("simulate-online", "--trace", str(bad))
    assert proc.returncode == 2 and "row 2" in proc.stderr and proc.stderr.count("\n") == 1
