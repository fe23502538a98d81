"""The simulator against the asyncio executor (the live runtime's core) on fake time, and
node resets, restarts and losses: no task and no token lost.
"""
import asyncio

import looptime
import pytest

from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.driver import ClusterDriver
from raycolo.online.scheduling.node_types import Timer
from raycolo.online.scheduling.node_events import OpResult
from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import preset
from raycolo.online.simulation.sim import ClusterSimulator, ends_with, op_duration, query_cost_s
from raycolo.online.tasks import poisson_workload
from raycolo.online.policies import make_online_policy
from tests.support.toy_node import PARAMS, _started, inf, node, only_op, run_all, train


# -- conformance: simulator and the asyncio executor on fake time --------------------------------
class ProfiledRunner:
    """Runs an op by sleeping its profiled duration on the (fake-time) loop."""

    def __init__(self, profile, params):
        self.profile, self.params = profile, params

    async def run(self, op):
        await asyncio.sleep(op_duration(op, self.profile, self.params))
        last = op.stage == self.profile.stages - 1
        return OpResult(frozenset(ends_with(op)) if last and op.kind in ("prefill", "decode") else frozenset())


@pytest.mark.parametrize("policy", ["lemix", "mix-rr", "mix-luf", "separate", "sirius", "mace",
                                    "mace-periodic", "harli-static"])
def test_simulator_and_asyncio_executor_give_the_same_op_log(policy):
    profile, params = preset("llama-70b", 2), LemixParams(sync_every=5)
    # SIRIUS: training tasks of 8 samples, so that it splits them into micro-batches
    tasks = poisson_workload(100, 0.6, 80, seed=1, train_batch=8 if policy == "sirius" else None)
    sim = ClusterSimulator(tasks, profile, 3, make_online_policy(policy, params, nodes=3, train_rate=0.6),
                           params)
    simulated = sim.run()
    live_policy = make_online_policy(policy, params, nodes=3, train_rate=0.6)
    cluster = Cluster(live_policy, profile, 3, params)
    loop = looptime.new_event_loop(start=0.0, resolution=1e-9)

    async def main():
        driver = ClusterDriver(cluster, ProfiledRunner(profile, params), query_cost_s(live_policy, params))
        await driver.replay(tasks)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    a, b = sim.cluster.op_log, cluster.op_log
    assert len(a) == len(b) > 500
    for x, y in zip(a, b):
        assert x[2:] == y[2:] and x[0] == pytest.approx(y[0], abs=1e-6) and x[1] == pytest.approx(y[1], abs=1e-6)
    live = cluster.result(tasks)
    assert live.completions == simulated.completions == {t.task_id: 1 for t in tasks}
    if policy == "lemix":
        assert simulated.memory_waits > 0          # the trace exercises Algorithm 2
    if policy == "separate":
        assert any(entry[4] == "sync" for entry in a)
    if policy == "sirius":
        assert sum(n.micro.count for n in cluster.nodes) > 0   # the trace exercises the splits


def test_a_failed_op_stops_the_run_once_and_says_so():
    """An op that raises stops the driver: ``on_error`` hears of it once (the live
    controller then ends every open stream with the error) and ``drain`` re-raises it."""
    profile, params = preset("llama-8b", 2), LemixParams()
    cluster = Cluster(make_online_policy("mix-rr", params, nodes=2), profile, 2, params)
    errors = []

    class Failing(ProfiledRunner):
        async def run(self, op):
            if op.kind == "decode":
                raise RuntimeError("stage died")
            return await super().run(op)

    loop = looptime.new_event_loop(start=0.0, resolution=1e-9)

    async def main():
        driver = ClusterDriver(cluster, Failing(profile, params), on_error=errors.append)
        await driver.replay(poisson_workload(50, 0.0, 20, seed=3))

    try:
        with pytest.raises(RuntimeError, match="stage died"):
            loop.run_until_complete(main())
    finally:
        loop.close()
    assert len(errors) == 1 and str(errors[0]) == "stage died"


# -- a node that loses its state (a worker-group restart) ---------------------------------------
def test_reset_drops_every_op_and_returns_the_unfinished_work():
    n = node(memory_aware=False)
    n.dispatch(inf(0, decode=5), 0.0)
    n.dispatch(inf(1, decode=5), 0.0)
    stale = n.dispatch(inf(2, decode=5), 0.0).timers     # its window timer, armed before the reset
    first = n.dispatch(train(3), 0.1)                    # closes the batch, queues train_f
    prefill = only_op(first)
    step = n.op_done(prefill, 1.0)                       # prefill moves to stage 1, train_f starts
    assert {op.kind for op in step.started} == {"prefill", "train_f"}
    assert n.stages[0].used_bytes > 0 and n.stages[1].used_bytes > 0
    out = n.reset(1.5)
    assert [x.task_id for x in out.lost] == [0, 1, 2, 3]
    assert [x.generated for x in out.lost[:3]] == [0, 0, 0]
    assert out.lost[3].is_train and out.idle and out.actions == []
    assert all(not st.ready and st.busy is None and not st.held and st.used_bytes == 0 for st in n.stages)
    assert n.queued_ops == 0 and not n.joining and not n.batch and n.generation == 1
    assert n.busy_seconds(1.5) == pytest.approx(0.9 + 0.5 + 0.5)   # ops in flight count until the reset
    for timer in stale:                                  # void after the reset
        assert n.timer(timer, 2.0).actions == []
    with pytest.raises(ValueError):                      # a dropped op is not running any more
        n.op_done(step.started[0], 2.0)
    again = only_op(n.dispatch(train(4), 3.0))
    assert again.generation == 1 and again.kind == "train_f"


def test_reset_of_a_decoding_node_returns_requests_with_the_tokens_they_streamed():
    n = node(memory_aware=False, params=PARAMS.model_copy(update={"max_batch": 1}))
    ops = run_all(n, [n.dispatch(inf(0, decode=3), 0.0)])   # completes: 3 tokens
    assert [op.kind for op in ops].count("decode") == 4
    n2 = node(memory_aware=False, params=PARAMS.model_copy(update={"max_batch": 1}))
    prefill = only_op(n2.dispatch(inf(0, decode=10), 0.0))
    step = n2.op_done(only_op(n2.op_done(prefill, 1.0)), 2.0)   # first token out, decode starts
    step = n2.op_done(only_op(step), 2.1)
    step = n2.op_done(only_op(step), 2.2)                    # second token out
    assert len(step.tokens) == 1
    out = n2.reset(2.25)
    assert len(out.lost) == 1 and out.lost[0].generated == 2 and out.lost[0].context == 11


@pytest.mark.parametrize("policy", ["lemix", "mix-rr", "separate"])
def test_a_node_reset_mid_trace_loses_no_task_and_no_token(policy):
    """A node loses its state twice mid-trace on the asyncio executor: every task still
    completes exactly once, every request gets exactly its tokens (those streamed before
    the reset and the rest after it), and memory is conserved."""
    profile, params = preset("llama-70b", 2), LemixParams(sync_every=5)
    tasks = poisson_workload(60, 0.6, 80, seed=2)
    cluster = Cluster(make_online_policy(policy, params, nodes=3, train_rate=0.6), profile, 3, params)
    tokens = {}
    count = cluster.metrics.token

    def counting(task, now, staleness):
        tokens[task.task_id] = tokens.get(task.task_id, 0) + 1
        count(task, now, staleness)

    cluster.metrics.token = counting
    loop = looptime.new_event_loop(start=0.0, resolution=1e-9)
    lost = []

    async def main():
        driver = ClusterDriver(cluster, ProfiledRunner(profile, params))
        driver.start()
        for at, n in ((tasks[len(tasks) // 3].arrival_s, 0), (tasks[2 * len(tasks) // 3].arrival_s, 2)):
            loop.call_at(at, lambda n=n: lost.append(sum(len(st.ready) + (st.busy is not None)
                                                        for st in cluster.nodes[n].stages)
                                                    + len(cluster.nodes[n].joining)) or driver.node_lost(n, back_after_s=0))
        await driver.replay(tasks)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    result = cluster.result(tasks)
    assert result.completions == {t.task_id: 1 for t in tasks}
    assert tokens == {t.task_id: t.decode_tokens for t in tasks if not t.is_train}
    assert sum(lost) > 0 and cluster.resumed > 0
    assert all(node.generation == (1 if i in (0, 2) else 0) for i, node in enumerate(cluster.nodes))


def _drive_with_faults(policy, faults, nodes=3, count=60, back_after_s=0):
    """Replay a trace on fake time with ``faults``: (arrival index, node, "lost"|"down");
    a lost node is back ``back_after_s`` later."""
    profile, params = preset("llama-70b", 2), LemixParams(sync_every=5)
    tasks = poisson_workload(count, 0.6, 80, seed=2)
    cluster = Cluster(make_online_policy(policy, params, nodes=nodes, train_rate=0.6), profile, nodes, params)
    failed, hit = [], []
    loop = looptime.new_event_loop(start=0.0, resolution=1e-9)

    def fault(n, kind, driver):
        if n is None:   # the node with the most work on it now
            n = max(range(nodes), key=lambda m: (cluster.nodes[m].queued_ops + len(cluster.nodes[m].joining), -m))
        hit.append(n)
        if kind == "down":
            driver.node_down(n)
        else:
            driver.node_lost(n, back_after_s=back_after_s)

    async def main():
        driver = ClusterDriver(cluster, ProfiledRunner(profile, params), on_failed=failed.append)
        driver.start()
        for index, n, kind in faults:
            loop.call_at(tasks[index].arrival_s, fault, n, kind, driver)
        await driver.replay(tasks)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return tasks, cluster, failed, hit


@pytest.mark.parametrize("policy", ["lemix", "mix-rr", "mix-luf", "separate", "harli"])
def test_a_restarting_node_gets_no_work_until_it_is_back(policy):
    """While a node's worker group restarts, its work and every new task go to the other
    nodes (the policy never sees it as idle); once it is back it takes work again."""
    tasks = poisson_workload(60, 0.6, 80, seed=2)            # as _drive_with_faults makes them
    lost_at = tasks[20].arrival_s
    restart_s = tasks[40].arrival_s - lost_at                # back while tasks still arrive
    tasks, cluster, failed, [n] = _drive_with_faults(policy, [(20, None, "lost")], back_after_s=restart_s)
    assert failed == [] and cluster.resumed > 0
    assert cluster.result(tasks).completions == {t.task_id: 1 for t in tasks}
    during = [e for e in cluster.op_log if e[2] == n and lost_at <= e[0] < lost_at + restart_s - 1e-6 and e[4] != "sync"]
    assert during == []
    others = [e for e in cluster.op_log if e[2] != n and lost_at <= e[0] < lost_at + restart_s]
    assert others                                   # the rest of the cluster kept serving
    assert [e for e in cluster.op_log if e[2] == n and e[0] >= lost_at + restart_s]   # and it is used again
    assert not cluster.scheduler.restarting


def test_with_every_node_restarting_work_waits_for_them():
    """A single node restarting: its work has nowhere else to go, so it stays placed
    there (and runs once the node is back) rather than failing."""
    tasks, cluster, failed, _ = _drive_with_faults("lemix", [(10, 0, "lost")], nodes=1, count=30,
                                                   back_after_s=5.0)
    assert failed == []
    assert cluster.result(tasks).completions == {t.task_id: 1 for t in tasks}


@pytest.mark.parametrize("policy", ["lemix", "mix-rr", "separate"])
def test_a_node_that_goes_down_gets_no_more_work_and_loses_none(policy):
    tasks, cluster, failed, [down] = _drive_with_faults(policy, [(20, None, "down")])
    down_at = tasks[20].arrival_s
    assert failed == [] and cluster.resumed > 0
    assert cluster.result(tasks).completions == {t.task_id: 1 for t in tasks}
    assert not [e for e in cluster.op_log if e[2] == down and e[0] > down_at]   # nothing ran there after


def test_with_every_node_down_the_rest_fails_and_the_run_ends():
    tasks, cluster, failed, _ = _drive_with_faults("mix-rr", [(10, 0, "down"), (20, 1, "down")], nodes=2)
    done = set(cluster.metrics.completions)
    assert failed and {t.task_id for t in failed} | done == {t.task_id for t in tasks}
    assert not {t.task_id for t in failed} & done
    later = {t.task_id for t in tasks if t.arrival_s > tasks[20].arrival_s}
    assert later and later <= {t.task_id for t in failed}      # arrivals after the last node died


class SlowLinkLoops:
    """Node loops (a pickled copy of each mirror, as a stage 0 gets it over Ray) that a
    :class:`ClusterDriver` reaches through a link: a command reaches its loop ``delay_s``
    later; the loop runs its ops for their profiled durations and fires its timers, and
    reports each event back at once. :meth:`lose` kills a node's loop with whatever it has
    not taken yet, and starts a new one from the reset mirror ``back_s`` later."""

    def __init__(self, cluster, profile, params, delay_s):
        import pickle

        self.cluster, self.profile, self.params, self.delay_s = cluster, profile, params, delay_s
        self.copy = lambda n: pickle.loads(pickle.dumps(cluster.nodes[n]))
        self.loops = [self.copy(n) for n in range(len(cluster.nodes))]
        self.epochs = [0] * len(cluster.nodes)
        self.driver = None
        self.sent = []          # (node, task id) of every Dispatched command

    def command(self, n, event):
        from raycolo.online.scheduling.node_events import Dispatched

        if type(event) is Dispatched:
            self.sent.append((n, event.task.task_id))
        asyncio.get_running_loop().call_later(self.delay_s, self._take, n, self.epochs[n], event)

    def _take(self, n, epoch, event):
        if epoch == self.epochs[n]:          # a command to a loop that died is gone with it
            self._event(n, epoch, type(event)(event.task, self.driver.now()))

    def _event(self, n, epoch, event):
        from raycolo.online.scheduling.node_events import TimerFired, action_key, apply, op_done_event

        if epoch != self.epochs[n]:
            return
        loop = asyncio.get_running_loop()
        step = apply(self.loops[n], event)
        for action in step.actions:
            if isinstance(action, Timer):
                loop.call_at(action.at_s, lambda a=action: self._event(n, epoch, TimerFired(a.number, a.at_s)))
            else:
                last = action.stage == self.profile.stages - 1
                ends = ends_with(action) if last and action.kind in ("prefill", "decode") else ()
                loop.call_later(op_duration(action, self.profile, self.params), lambda a=action, e=ends:
                                self._event(n, epoch, op_done_event(a.stage, a.seq, self.driver.now(), e)))
        self.driver.absorb(n, event, [action_key(a) for a in step.actions])

    def lose(self, n, back_s):
        self.epochs[n] += 1
        self.driver.node_lost(n)            # the mirror resets; its work is placed again
        asyncio.get_running_loop().call_later(back_s, self._back, n)

    def _back(self, n):
        self.loops[n] = self.copy(n)
        self.driver.node_back(n)


@pytest.mark.parametrize("policy", ["lemix", "mix-rr"])
def test_a_task_on_its_way_to_a_node_loop_that_dies_is_placed_again(policy):
    """Mirrored (the live runtime's node loops), a task the cluster sent to a node is
    the node's once its loop's report says so. A node lost while a training task and a
    request are on their way to it (its loop never saw them) loses them with its other
    work: they are placed again and complete once, as every other task does."""
    profile, params = preset("llama-70b", 2), LemixParams(sync_every=5)
    tasks = poisson_workload(60, 0.6, 80, seed=2)
    cluster = Cluster(make_online_policy(policy, params, nodes=2, train_rate=0.6), profile, 2, params)
    loops = SlowLinkLoops(cluster, profile, params, delay_s=0.05)
    lost = []
    loop = looptime.new_event_loop(start=0.0, resolution=1e-9)

    async def main():
        driver = loops.driver = ClusterDriver(cluster, None, link=loops)
        driver.start()
        command = loops.command

        def command_then_lose(n, event):   # the node dies with the command on its way
            command(n, event)
            wanted = "train" if not lost else "inference"        # a training task, then a request
            if len(lost) < 2 and event.task.kind == wanted:
                lost.append((n, event.task.kind, event.task.task_id))
                loop.call_later(loops.delay_s / 2, loops.lose, n, 5.0)
        loops.command = command_then_lose
        await asyncio.wait_for(driver.replay(tasks), 10_000)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert sorted(kind for _, kind, _ in lost) == ["inference", "train"]
    assert cluster.result(tasks).completions == {t.task_id: 1 for t in tasks}
    assert cluster.resumed >= 2 and not any(cluster.in_transit.values())
    for n, _, task_id in lost:       # sent to the lost node, then again elsewhere or there
        assert [m for m, t in loops.sent if t == task_id][0] == n and [t for _, t in loops.sent].count(task_id) == 2



def test_reset_returns_open_batch_joining_and_decoding_requests_with_their_progress():
    n = node(memory_aware=False)
    for i in range(4):                                       # 4 queries close a batch
        step = n.dispatch(inf(i, length=10, decode=9), 0.0)
    prefill = _started(step, "prefill")
    step = n.op_done(_started(n.op_done(prefill, 1.0), "prefill"), 2.0)
    decode = _started(step, "decode")                        # 0-3 decode, 1 token out each
    (window,) = n.dispatch(inf(4, length=20, decode=9), 2.0).timers
    assert n.timer(window, window.at_s).started == []        # stage 0 is busy with the decode
    step = n.op_done(decode, 2.6)                            # decode to stage 1, prefill of 4 starts
    decode1, prefill4 = _started(step, "decode"), _started(step, "prefill")
    n.op_done(prefill4, 3.0)                                 # waits for stage 1
    step = n.op_done(decode1, 3.1)                           # 0-3: second token; next decode; 4's prefill on stage 1
    n.op_done(_started(step, "prefill"), 3.5)                # 4's first token: it joins (a decode is in flight)
    assert [r.task_id for r in n.joining] == [4]
    n.dispatch(inf(5, length=30, decode=9), 3.6)             # an open batch
    out = n.reset(3.7)
    assert [(x.task_id, x.generated, x.context) for x in out.lost] == \
        [(0, 2, 11), (1, 2, 11), (2, 2, 11), (3, 2, 11), (4, 1, 20), (5, 0, 30)]
    assert n.batch_c == 0 and not n.decode_inflight
    for i in range(6, 9):                                    # 3 queries: the new batch stays open
        assert n.dispatch(inf(i), 4.0).started == []


def test_reset_drops_sync_ops_and_counts_every_reset():
    n = node()
    n.sync(7, 0.0)
    assert n.reset(0.5).lost == [] and n.syncing == 0 and n.update_count == 0
    n.reset(0.6)
    assert n.generation == 2


def test_a_memory_wait_after_a_reset_arms_a_live_retry_timer():
    n = node(memory_aware=True)
    big = only_op(n.dispatch(train(0, length=85), 0.0))
    n.dispatch(train(1, length=10), 0.0)
    assert n.op_done(big, 0.2).timers                        # the second forward waits
    n.reset(0.3)
    big = only_op(n.dispatch(train(2, length=85), 1.0))
    n.dispatch(train(3, length=10), 1.0)
    (timer,) = n.op_done(big, 1.2).timers                    # a wait after the reset arms its own timer
    assert timer.generation == 1
    assert n.timer(timer, timer.at_s).actions                # and it is not void
