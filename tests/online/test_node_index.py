"""LeMix's node index (raycolo/online/scheduling/node_index.py): bounded candidates instead of a scan of
every node, checked against the exhaustive scan and a brute force."""
import numpy as np
import pytest

from raycolo.online.scheduling.allocation import length_consistency
from raycolo.online.scheduling.node_index import LazyMin, NodeIndex
from raycolo.online.lemix_params import LemixParams
from raycolo.online.scheduling.planning import NodeTrace, StagePath, TaskPath
from raycolo.online.profiles import preset
from raycolo.online.scheduling.scheduler import OnlineScheduler
from raycolo.online.simulation.sim import ClusterSimulator
from raycolo.online.tasks import poisson_workload
from raycolo.online.policies import make_online_policy


EXHAUSTIVE = LemixParams(scan_nodes=1 << 20)


def _decisions(params, nodes, tasks, faults=()):
    """Submit ``tasks`` in arrival order to a LeMix scheduler; every planned forward and
    backward is reported executed once the clock passes its planned end, having taken
    0.6 to 1.4 times its planned time (calibration moves the plans). ``faults``: (task index, node, "down" | "restarting" | "back"). Returns the
    node of each decision (None: deferred)."""
    profile = preset("llama-8b", stages=2)
    policy = make_online_policy("lemix", params, nodes=nodes, train_rate=0.5)
    sched = OnlineScheduler(policy, [profile] * nodes, [policy.estimator(profile)] * nodes, params)
    pending, out = [], []
    rng = np.random.default_rng(7)
    faults = {i: (n, kind) for i, n, kind in faults}
    for i, task in enumerate(tasks):
        now = task.arrival_s
        if i in faults:
            n, kind = faults[i]
            {"down": sched.down.add, "restarting": sched.restarting.add,
             "back": sched.restarting.discard}[kind](n)
        due = [p for p in pending if p[0] <= now]
        pending = [p for p in pending if p[0] > now]
        for end, task_id, stage, kind, start in sorted(due):
            sched.observe(task_id, stage, kind, start, start + (end - start) * rng.uniform(0.6, 1.4))
        for n in range(nodes):      # the executor finds nodes with nothing left idle
            sched.node_idle(n, now)
        decision = sched.submit(task, now)
        for d in [decision] + sched.retry(now):
            if d is None:
                out.append(None)
                continue
            out.append(d.node)
            for s, st in enumerate(d.path.stages):
                pending.append((st.end_f, d.task.task_id, s, "forward", st.start_f))
                if st.end_b is not None:
                    pending.append((st.end_b, d.task.task_id, s, "backward", st.start_b))
    return out


@pytest.mark.parametrize("faults", [(), ((150, 3, "down"), (200, 7, "restarting"), (320, 7, "back"))])
def test_with_every_node_a_candidate_the_index_decides_exactly_as_the_scan(faults):
    """With a window as wide as the cluster every placeable node is a candidate: then the
    index path must pick exactly what the scan picks, deferrals (eq. 4 from the index's
    earliest finish) included: the index's keys are fresh after every commit,
    calibration, idle time and reset, and nodes down or restarting are left out."""
    nodes = 24
    tasks = poisson_workload(50 * nodes, 0.5, 500, seed=3)     # loaded, with a tight SLO: eq. 4 defers
    scan = _decisions(LemixParams(scan_nodes=1 << 20, slo_multiplier=0.5), nodes, tasks, faults)
    indexed = _decisions(LemixParams(scan_nodes=1, candidate_window=nodes, slo_multiplier=0.5), nodes, tasks, faults)
    assert None in scan and len(set(scan) - {None}) > nodes // 2     # deferrals and spread happened
    assert indexed == scan


def test_the_default_window_plans_a_few_nodes_and_keeps_the_scans_quality():
    """At 64 nodes the default candidates (a handful) run LeMix to the same SLO
    attainment and throughput as the scan of every node, within noise."""
    nodes = 64
    tasks = poisson_workload(12.5 * nodes, 0.5, 1500, seed=0)
    results = {}
    for name, params in (("scan", EXHAUSTIVE), ("index", LemixParams())):
        policy = make_online_policy("lemix", params, nodes=nodes, train_rate=0.5)
        sim = ClusterSimulator(tasks, preset("llama-8b", 2), nodes, policy, params)
        planned = []
        score = policy.score
        policy.score = lambda sched, task, now, chosen: planned.append(len(chosen)) or score(sched, task, now, chosen)
        results[name] = (sim.run(), planned)
    (scan, scan_planned), (index, index_planned) = results["scan"], results["index"]
    p = LemixParams()
    assert min(scan_planned) == nodes and max(index_planned) <= 2 * p.candidate_window + 2 + p.candidate_lengths
    assert abs(index.slo_attainment - scan.slo_attainment) <= 0.01
    assert abs(index.throughput / scan.throughput - 1) <= 0.05


def _trace(rng, stages=2):
    """A node's trace as the scheduler leaves it: its lengths so far, the last forward's
    spans and maybe a pending backward."""
    trace = NodeTrace(stages, idle_since=float(rng.uniform(0, 1)))
    for _ in range(int(rng.integers(0, 6))):
        trace.add_length(int(rng.integers(10, 400)))
    if rng.random() < 0.7:
        start = float(rng.uniform(0, 2))
        spans = [(start + s * 0.1, start + (s + 1) * 0.1) for s in range(stages)]
        path = TaskPath(0, rng.random() < 0.4, 0.0, 50, 1, [StagePath(a, b) for a, b in spans])
        if path.is_train:
            for s, st in enumerate(reversed(path.stages)):
                st.start_b, st.end_b = spans[-1][1] + 0.2 * s, spans[-1][1] + 0.2 * (s + 1)
            trace.train.append(path)
        trace.order.append(path)
    return trace


def test_candidates_hold_the_free_nodes_with_the_best_length_consistency():
    """Brute force over random clusters: the ``near`` free nodes (all planned work done
    by the start) with the highest LC are always candidates, and so are the nodes just
    free before the start and just after it."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        nodes = int(rng.integers(1, 40))
        traces = [_trace(rng) for _ in range(nodes)]
        down = set(rng.choice(nodes, size=int(rng.integers(0, 3)), replace=True).tolist())
        at, length = float(rng.uniform(0, 2.5)), int(rng.integers(10, 400))
        index = NodeIndex(nodes)
        for n in range(nodes):
            index.touch(n)
        index.refresh(traces, at)
        found = index.candidates(at, length, lambda n: n not in down, window=2, near=2)
        ok = [n for n in range(nodes) if n not in down]
        free = [n for n in ok if traces[n].count >= 2 and traces[n].busy_until() <= at]
        lcs = {n: length_consistency(length, traces[n].count, traces[n].length_mean, traces[n].length_std)
               for n in free}
        best = sorted(lcs.values(), reverse=True)[:2]
        assert all(any(lcs[n] >= b for n in found if n in lcs) for b in best)
        assert sum(lcs[n] >= best[-1] for n in found if n in lcs) >= len(best) if best else True
        start = {n: traces[n].last.end_f(0) if traces[n].last else traces[n].idle_since for n in ok}
        before = sorted((k, n) for n, k in start.items() if k <= at)[-2:]
        after = sorted((k, n) for n, k in start.items() if k > at)[:2]
        assert {n for _, n in before + after} <= set(found)
        assert not set(found) & down


def test_lazy_min_gives_the_smallest_key_passing_the_filter_as_a_sort_would():
    """Brute force: after random re-keying (stale heap entries, equal keys, nodes leaving
    and coming back), ``first`` is the sorted list's first (key, node) passing ``ok``
    with ``exclude`` left out, and it forgets nothing it turned away."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        nodes = int(rng.integers(1, 30))
        heap, keys = LazyMin(), {}
        for _ in range(int(rng.integers(1, 300))):
            n = int(rng.integers(0, nodes))
            key = None if rng.random() < 0.15 else float(rng.integers(0, 8))    # ties on purpose
            heap.set(n, key)
            keys.pop(n, None) if key is None else keys.__setitem__(n, key)
            banned = set(rng.choice(nodes, size=int(rng.integers(0, 4))).tolist())
            exclude = int(rng.integers(0, nodes)) if rng.random() < 0.5 else None
            want = next(((k, m) for k, m in sorted((k, m) for m, k in keys.items())
                         if m not in banned and m != exclude), None)
            assert heap.first(lambda m: m not in banned, exclude) == want
