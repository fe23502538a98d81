"""The event-driven simulator must make exactly the reference simulator's decisions."""
import math

import numpy as np
import pytest

from raycolo.catalog import get_model
from raycolo.offline.costmodel.latency import IterationLatency, default_profile
from raycolo.hardware import ClusterSpec
from raycolo.offline.sim import fast, reference
from raycolo.offline.sim.reference import SchedulerDeadlock
from raycolo.offline.sim.types import ReplicaWorkload
from raycolo.batching.limits import SchedulerLimits


@pytest.fixture(scope="module")
def latency():
    model = get_model("vicuna-13b-v1.5")
    return IterationLatency(model, default_profile(model, ClusterSpec(), 1))


def random_case(rng):
    n = int(rng.integers(1, 250))
    prompt = rng.integers(1, 300, n)
    remaining = rng.integers(1, 300, n)
    ready = np.where(rng.random(n) < 0.3, rng.random(n) * 8, 0.0)
    successor = np.full(n, -1)
    for i in range(n - 1):
        if rng.random() < 0.2:
            successor[i] = i + 1
            ready[i + 1] = np.inf
    ready[rng.random(n) < 0.05] = np.inf  # never ready in this run (upstream elsewhere)
    limits = SchedulerLimits(num_blocks=int(rng.integers(40, 2500)),
                             max_num_seqs=int(rng.integers(1, 96)),
                             max_num_batched_tokens=int(rng.integers(300, 4096)),
                             block_size=int(rng.choice([4, 8, 16])))
    stop = math.inf if rng.random() < 0.5 else float(rng.random() * 40)
    return ReplicaWorkload(prompt, remaining, ready, successor), limits, stop


def assert_same(ref, got):
    np.testing.assert_allclose(got.finish, ref.finish, rtol=1e-9)
    assert math.isclose(got.end_time, ref.end_time, rel_tol=1e-9, abs_tol=1e-12)
    assert got.iterations == ref.iterations
    assert got.prefills == ref.prefills
    assert got.preemptions == ref.preemptions
    assert got.stopped == ref.stopped
    assert got.running == ref.running
    assert got.waiting == ref.waiting
    np.testing.assert_array_equal(got.generated, ref.generated)
    assert math.isclose(got.total_flops, ref.total_flops, rel_tol=1e-9)
    assert math.isclose(got.total_useful, ref.total_useful, rel_tol=1e-9)


def test_fast_matches_reference_on_random_workloads(latency):
    rng = np.random.default_rng(7)
    compared = preempted = stopped = chained = 0
    for _ in range(400):
        work, limits, stop = random_case(rng)
        try:
            ref = reference.simulate(work, limits, latency, stop)
        except SchedulerDeadlock:
            with pytest.raises(SchedulerDeadlock):
                fast.simulate(work, limits, latency, stop)
            continue
        assert_same(ref, fast.simulate(work, limits, latency, stop))
        compared += 1
        preempted += ref.preemptions > 0
        stopped += ref.stopped
        chained += bool((work.successor >= 0).any())
    # the random cases must actually exercise every mechanism
    assert compared > 300 and preempted > 30 and stopped > 50 and chained > 100


def test_continuing_from_a_snapshot_equals_an_uninterrupted_run(latency):
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(150):
        work, limits, _ = random_case(rng)
        work.ready[np.isfinite(work.ready)] = 0.0  # arrivals would shift with the cut
        try:
            whole = fast.simulate(work, limits, latency)
        except SchedulerDeadlock:
            continue
        cut = whole.end_time * rng.uniform(0.1, 0.9)
        first = fast.simulate(work, limits, latency, stop_at=cut)
        if not first.stopped:
            continue
        done = np.isfinite(first.finish)
        succ_ready = np.zeros(len(work), dtype=bool)
        for i in np.flatnonzero(done):  # a finished chunk releases its successor at once
            if work.successor[i] >= 0:
                succ_ready[work.successor[i]] = True
        queued = {i for i, _ in first.running} | set(first.waiting)
        ready = np.where(done, np.inf, work.ready)
        ready[succ_ready & ~done] = 0.0
        rest = ReplicaWorkload(
            prompt_len=work.prompt_len.copy(), remaining=np.maximum(work.remaining - first.generated, 1),
            ready=ready, successor=work.successor, running=first.running, waiting_first=first.waiting)
        for i in first.waiting:  # preempted requests re-prefill what they generated
            rest.prompt_len[i] = work.prompt_len[i] + first.generated[i]
        for i in queued:
            rest.ready[i] = 0.0
        second = fast.simulate(rest, limits, latency)
        reached = np.isfinite(whole.finish) & ~done
        np.testing.assert_allclose(second.finish[reached] + first.end_time, whole.finish[reached], rtol=1e-9)
        assert math.isclose(second.end_time + first.end_time, whole.end_time, rel_tol=1e-9)
        checked += 1
    assert checked > 50


def test_every_request_finishes_and_kv_limits_hold(latency):
    rng = np.random.default_rng(3)
    work = ReplicaWorkload(rng.integers(5, 128, 2000), rng.integers(1, 257, 2000), np.zeros(2000))
    limits = SchedulerLimits(num_blocks=900, max_num_seqs=128)
    result = fast.simulate(work, limits, latency)
    assert np.isfinite(result.finish).all()
    np.testing.assert_array_equal(result.generated, work.remaining)
    assert result.preemptions > 0  # 900 blocks cannot hold 128 growing sequences
    assert result.end_time == pytest.approx(result.finish.max())


def test_request_larger_than_the_kv_cache_is_reported(latency):
    work = ReplicaWorkload([400], [10], [0.0])
    limits = SchedulerLimits(num_blocks=10, block_size=16)
    for sim in (fast.simulate, reference.simulate):
        with pytest.raises(SchedulerDeadlock, match="needs 25 KV blocks"):
            sim(work, limits, latency)


def test_decode_run_closed_form_matches_summation():
    alpha, beta, c0, n = 0.01, 2e-6, 5000, 40
    for k in (1, 2, 17, 500):
        summed = sum(alpha + beta * (c0 + n * j) for j in range(k))
        assert fast._run_seconds(k, alpha, beta, c0, n) == pytest.approx(summed, rel=1e-12)
    for delta in (1e-4, 0.05, 3.3, 100.0):
        k = fast._iterations_until(delta, alpha, beta, c0, n)
        assert fast._run_seconds(k, alpha, beta, c0, n) >= delta
        assert k == 1 or fast._run_seconds(k - 1, alpha, beta, c0, n) < delta


def assert_identical(got, plain):
    for name in ("finish", "generated", "curve_t", "curve_flops", "curve_useful"):
        a, b = getattr(got, name), getattr(plain, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for name in ("end_time", "running", "waiting", "iterations", "prefills", "preemptions", "stopped"):
        assert getattr(got, name) == getattr(plain, name), name


def continued(work, first):
    """The workload left after ``first`` stopped (requests without successors, all ready)."""
    done = np.isfinite(first.finish)
    return ReplicaWorkload(
        prompt_len=work.prompt_len + first.generated,
        remaining=np.maximum(work.remaining - first.generated, 1), ready=np.where(done, np.inf, 0.0),
        running=first.running, waiting_first=first.waiting, fresh=first.generated == 0)


def test_shortcuts_change_nothing_to_the_last_bit(latency):
    """The lean paths (no block books where blocks cannot bind; the batch run out once
    nothing can join it) give the plain event loop's results bit for bit: plans compare
    simulated times, so a last-digit difference could change a plan."""
    rng = np.random.default_rng(5)
    kinds = {"as drawn": 0, "no chains": 0, "no chains, blocks to spare": 0, "continued": 0}
    for i in range(240):
        work, limits, stop = random_case(rng)
        kind = list(kinds)[i % 3]
        if kind != "as drawn":  # nothing arrives later: the batch can be run out
            work = ReplicaWorkload(work.prompt_len, work.remaining, np.zeros(len(work)))
            stop = math.inf
        if kind == "no chains, blocks to spare":
            limits = SchedulerLimits(num_blocks=100_000, max_num_seqs=limits.max_num_seqs,
                                     max_num_batched_tokens=limits.max_num_batched_tokens,
                                     block_size=limits.block_size)
        cases = [(kind, work, stop)]
        if kind != "as drawn":
            try:
                first = fast.simulate(work, limits, latency, stop_at=rng.uniform(0.5, 20.0))
            except SchedulerDeadlock:
                first = None
            if first is not None and first.stopped:
                cases.append(("continued", continued(work, first), math.inf))
        for name, w, s in cases:
            try:
                plain = fast.simulate(w, limits, latency, s, shortcuts=False)
            except SchedulerDeadlock:
                with pytest.raises(SchedulerDeadlock):
                    fast.simulate(w, limits, latency, s)
                continue
            assert_identical(fast.simulate(w, limits, latency, s), plain)
            kinds[name] += 1
    assert min(kinds.values()) >= 40, kinds
