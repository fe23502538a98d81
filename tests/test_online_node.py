"""NodeScheduler (LeMix Algorithms 2 and 3), worked by hand with a toy profile, and the
conformance of the simulator with the asyncio executor (the live runtime's core).

The toy profile: 2 stages, 1 KV byte per token, 9 activation bytes per token (10 bytes a
training token holds), 1000 bytes free per stage (threshold 900), a forward latency of
1 s: T_w = 0.5 s, Δt = 0.05 s, T_max = 1 s.
"""
import asyncio
import heapq
import itertools

import looptime
import pytest

from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.driver import ClusterDriver
from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.node_types import Op, Timer
from raycolo.online.scheduling.node_events import OpResult
from raycolo.online.params import LemixParams
from raycolo.online.profiles import NodeProfile, ProfileLearner, preset
from raycolo.online.simulation.sim import ClusterSimulator, ends_with, op_duration, query_cost_s
from raycolo.online.tasks import OnlineTask, poisson_workload
from raycolo.online.policies import make_online_policy

TOY = NodeProfile(name="toy", stages=2, eta_f=1e-3, eta_b=2e-3, decode_floor_s=0.01,
                  kv_bytes_per_token=1.0, activation_bytes_per_token=9.0, weight_bytes_per_stage=0.0,
                  gpu_memory_bytes=1000.0, forward_latency_s=1.0, backward_latency_s=2.0,
                  reference_length=256)
PARAMS = LemixParams(max_batch=4, max_wait=0.5, check_interval=0.05, max_memory_wait=1.0)
SLOW = TOY.model_copy(update={"forward_latency_s": 2.0})      # T_w = 1 s, Δt = 0.1 s, T_max = 2 s
NO_KV = TOY.model_copy(update={"kv_bytes_per_token": 0.0, "activation_bytes_per_token": 10.0})
SLOW_LINK = PARAMS.model_copy(update={"offload_bandwidth": 100.0})  # 100 bytes take 1 s


def inf(i, length=10, decode=3, max_tokens=None, batch=1, at=0.0):
    return OnlineTask(i, "inference", at, length, batch, decode, max_tokens)


def train(i, length=10, batch=1, at=0.0):
    return OnlineTask(i, "train", at, length, batch, 0)


def node(memory_aware=True, params=PARAMS, profile=TOY):
    return NodeScheduler(0, profile, params, memory_aware)


def run_all(n, steps, now=0.0, finished=lambda op: ends_with(op)):
    """Carry out ``steps`` and everything after them with profiled durations on a fake clock;
    returns every op started, in order."""
    heap, started, seq = [], [], itertools.count()

    def push(step, now):
        for action in step.actions:
            if isinstance(action, Timer):
                heapq.heappush(heap, (action.at_s, next(seq), action))
            else:
                started.append(action)
                heapq.heappush(heap, (now + op_duration(action, n.profile, n.params), next(seq), action))

    for step in steps:
        push(step, now)
    for _ in range(100_000):                     # bounded: a node that never settles fails
        if not heap:
            break
        now, _, action = heapq.heappop(heap)
        if isinstance(action, Timer):
            push(n.timer(action, now), now)
        else:
            last = action.stage == len(n.stages) - 1 and action.kind in ("prefill", "decode")
            push(n.op_done(action, now, finished(action) if last else ()), now)
    assert not heap, "the node never settled"
    return started


def only_op(step):
    ops = step.started
    assert len(ops) == 1, step.actions
    return ops[0]


# -- Algorithm 3: batching ---------------------------------------------------------------------
def test_first_request_arms_the_batch_window_and_max_batch_closes_it():
    n = node()
    step = n.dispatch(inf(0), now=0.0)
    assert step.activated and step.started == []
    (timer,) = step.timers
    assert (timer.kind, timer.at_s) == ("close_batch", 0.5)  # T_w = 0.5 forward latencies
    for i in (1, 2):
        assert n.dispatch(inf(i), now=0.1).actions == []
    step = n.dispatch(inf(3), now=0.2)              # the 4th query: max_batch closes it
    op = only_op(step)
    assert (op.kind, op.stage, [r.task_id for r in op.tasks]) == ("prefill", 0, [0, 1, 2, 3])
    assert n.timer(timer, now=0.5).actions == []    # the stale window closes nothing
    assert n.batch == []


def test_window_timer_closes_a_partial_batch_and_batch_counts_queries():
    n = node()
    (timer,) = n.dispatch(inf(0, batch=3), now=0.0).timers
    assert n.dispatch(inf(1, batch=1), now=0.1).started != []   # 3 + 1 queries = max_batch 4
    (timer2,) = n.dispatch(inf(2), now=0.2).timers             # a new window for the next batch
    assert timer2.at_s == pytest.approx(0.7)
    assert n.timer(timer, now=0.5).actions == []               # the old window is stale
    step = n.timer(timer2, now=0.7)
    assert step.started == []                                   # stage 0 still runs the first
    assert [r.task_id for _, _, op in n.stages[0].ready for r in op.tasks] == [2]


def test_a_training_task_closes_the_open_batch_before_it_queues():
    n = node()
    n.dispatch(inf(0), now=0.0)
    step = n.dispatch(train(1), now=0.1)
    assert [op.kind for op in step.started] == ["prefill"]     # stage 0 takes the prefill first
    assert [op.kind for _, _, op in n.stages[0].ready] == ["train_f"]


def test_a_stale_window_never_closes_a_later_batch():
    n = node()
    step = n.dispatch(inf(0, batch=4), now=0.0)               # opens and fills batch 1 at once
    (t1,), p0 = step.timers, only_op(step)
    n.op_done(p0, now=0.4)                                     # stage 0 is free again
    (t2,) = n.dispatch(inf(1), now=0.45).timers                # batch 2's window: 0.95
    assert n.timer(t1, now=0.5).actions == []                  # batch 1's window is stale
    assert [t.task_id for t in n.batch] == [1]
    p = only_op(n.dispatch(inf(2, batch=3), now=0.6))          # 1 + 3 queries close batch 2
    assert [r.task_id for r in p.tasks] == [1, 2]
    (t3,) = n.dispatch(inf(3), now=0.7).timers                 # batch 3's window: 1.2
    assert n.timer(t2, now=0.95).actions == []                 # batch 2's window is stale too
    assert [t.task_id for t in n.batch] == [3]
    n.timer(t3, now=1.2)                                       # its own window closes batch 3
    assert n.batch == [] and [r.task_id for _, _, op in n.stages[0].ready for r in op.tasks] == [3]


# -- memory ledger -------------------------------------------------------------------------------
def test_prefill_reserves_prompt_plus_max_tokens_on_every_stage_until_the_request_ends():
    n = node()
    n.dispatch(inf(0, length=10, decode=2, max_tokens=50), now=0.0)
    op = only_op(n.timer(Timer(0.5, 0, "close_batch", token=n.batch_token), now=0.5))
    assert op.mem_bytes == 60 and n.stages[0].used_bytes == 60     # 10 + 50, not 10 + 2
    op2 = only_op(n.op_done(op, now=1.0))
    assert n.stages[1].used_bytes == 60 and n.stages[0].used_bytes == 60
    step = n.op_done(op2, now=2.0)                                 # first token, not the last
    assert [r.generated for r in step.tokens] == [1] and step.finished == []
    dec = only_op(step)
    dec = only_op(n.op_done(dec, now=2.1))
    step = n.op_done(dec, now=2.2, finished={0})                   # the executor says: last token
    assert [r.task_id for r in step.finished] == [0]
    assert [st.used_bytes for st in n.stages] == [0, 0] and step.idle
    n.check_released()


def test_max_tokens_ends_a_request_the_executor_did_not_end():
    n = node()
    n.dispatch(inf(0, length=4, decode=2, max_tokens=2), now=0.0)
    op = only_op(n.timer(Timer(0.5, 0, "close_batch", token=n.batch_token), now=0.5))
    op = only_op(n.op_done(op, now=1.0))
    dec = only_op(n.op_done(op, now=1.5))
    dec = only_op(n.op_done(dec, now=1.6))
    step = n.op_done(dec, now=1.7)             # no finished set: the budget of 2 tokens ends it
    assert [r.generated for r in step.finished] == [2] and step.idle


def test_training_holds_activations_from_forward_to_backward_on_each_stage():
    n = node()
    f0 = only_op(n.dispatch(train(0, length=10), now=0.0))
    assert f0.mem_bytes == 100 and n.stages[0].used_bytes == 100   # (9 + 1) bytes x 10 tokens
    f1 = only_op(n.op_done(f0, now=1.0))
    assert f1.kind == "train_f" and n.stages[1].used_bytes == 100
    b1 = only_op(n.op_done(f1, now=2.0))
    assert (b1.kind, b1.stage) == ("train_b", 1)
    step = n.op_done(b1, now=3.0)
    b0 = only_op(step)
    assert (b0.kind, b0.stage) == ("train_b", 0)
    assert [st.used_bytes for st in n.stages] == [100, 0]
    # what each op receives from a neighbour stage: the forward's output, the backward's gradient
    assert (f0.after, f1.after, b1.after, b0.after) == (None, f0.seq, None, b1.seq)
    step = n.op_done(b0, now=4.0)
    assert [t.task_id for t in step.trained] == [0] and step.idle
    assert [st.used_bytes for st in n.stages] == [0, 0]
    assert [o[:3] for o in step.observed] == [(0, 0, "backward")]


def test_a_prefill_walks_the_stages_and_reports_its_forward_times():
    n = node()
    p0 = only_op(n.dispatch(inf(0, batch=4), now=0.0))
    step = n.op_done(p0, now=0.4)
    assert step.observed == [(0, 0, "forward", 0.0, 0.4)]
    p1 = only_op(step)
    assert (p1.kind, p1.stage, p1.after) == ("prefill", 1, p0.seq)   # it consumes p0's output
    assert n.op_done(p1, now=0.8).observed == [(0, 1, "forward", 0.4, 0.8)]


def test_a_memory_blind_prefill_overruns_on_every_stage_it_overfills():
    n = node(memory_aware=False)
    f0 = only_op(n.dispatch(train(0, length=95), now=0.0))          # 950 bytes on stage 0
    for i in range(1, 5):                                            # a 4-query batch: 80 bytes
        n.dispatch(inf(i, length=10, decode=1, max_tokens=10), now=0.0)
    step = n.op_done(f0, now=9.0)                                    # train 0 holds 950 on stage 1 too
    assert [(op.kind, op.stage) for op in step.started] == [("train_f", 1), ("prefill", 0)]
    f1, p0 = step.started
    assert n.op_done(p0, now=9.5).started == []                      # stage 1 still runs f1
    p1 = only_op(n.op_done(f1, now=18.0))                            # the older prefill goes first
    assert (p1.kind, p1.stage, p1.mem_bytes) == ("prefill", 1, 80)
    assert p1.overrun and n.overruns == 2 and n.stages[1].used_bytes == 1030   # 950 + 80 > 1000
    assert op_duration(p1, TOY, PARAMS) == pytest.approx(PARAMS.overrun_slowdown * 0.4)


def test_a_forward_that_exactly_fills_the_stage_is_no_overrun():
    n = node(memory_aware=False)
    f0 = only_op(n.dispatch(train(0, length=90), now=0.0))          # 900 bytes on stage 0
    n.dispatch(inf(1, length=10, decode=1, max_tokens=15, batch=4), now=0.0)  # 4 x 25 = 100 bytes
    (prefill,) = [op for op in n.op_done(f0, now=1.0).started if op.kind == "prefill"]
    assert n.stages[0].used_bytes == 1000 and not prefill.overrun and n.overruns == 0


def test_check_released_reports_a_task_left_holding_even_zero_bytes():
    n = node(profile=NO_KV)                                          # requests reserve no bytes
    only_op(n.dispatch(inf(0, batch=4), now=0.0))                    # the request is running
    assert n.stages[0].used_bytes == 0
    with pytest.raises(RuntimeError, match="stage 0: memory left held after the run: 1 tasks, 0 bytes"):
        n.check_released()


# -- Algorithm 2: wait, then offload; or overrun ---------------------------------------------------
def test_memory_aware_forward_waits_in_steps_then_runs_offloaded():
    n = node(memory_aware=True)
    big = only_op(n.dispatch(train(0, length=85), now=0.0))         # 850 bytes held on stage 0
    assert n.stages[0].used_bytes == 850
    n.dispatch(train(1, length=10), now=0.0)                         # 850 + 100 > 900: waits
    assert n.stages[0].busy is big
    step = n.op_done(big, now=0.2)
    # stage 0 is free, but the second forward must wait: one retry timer Δt = 0.05 s later
    assert step.timers and step.timers[0].kind == "memory_retry"
    assert step.timers[0].at_s == pytest.approx(0.25) and n.memory_waits == 1
    timer = step.timers[0]
    for waited in range(1, 100):                 # bounded: a wait that never ends fails
        step = n.timer(timer, now=timer.at_s)
        if step.started:
            break
        (timer,) = step.timers
    # T_max = 1 s of waiting in 0.05 s steps: the op runs offloaded after the 20th step
    assert waited == 20 and n.offloads == 1
    op = step.started[0]
    assert op.offloaded and not op.overrun and n.stages[0].used_bytes == 850  # holds nothing
    assert op_duration(op, TOY, PARAMS) == pytest.approx(TOY.forward_s(1, 10) + 100 / PARAMS.offload_bandwidth)


def test_memory_blind_forward_overruns_and_pays_the_slowdown():
    n = node(memory_aware=False)
    big = only_op(n.dispatch(train(0, length=95), now=0.0))         # 950 bytes held on stage 0
    for i in range(1, 5):                                            # 4 queries close a batch
        step = n.dispatch(inf(i, length=10, decode=1, max_tokens=10), now=0.0)
    assert step.started == [] and n.stages[0].busy is big
    step = n.op_done(big, now=1.0)
    (prefill,) = [op for op in step.started if op.kind == "prefill"]
    assert prefill.mem_bytes == 80 and prefill.overrun and n.overruns == 1   # 950 + 80 > 1000
    assert n.stages[0].used_bytes == 1030 and n.memory_waits == n.offloads == 0
    plain = Op("prefill", 0, 0, 0.0, 0, prefill.tasks, prefill.mem_bytes)
    assert op_duration(plain, TOY, PARAMS) == pytest.approx(1e-3 * 4 * 10 ** 2)
    assert op_duration(prefill, TOY, PARAMS) == pytest.approx(PARAMS.overrun_slowdown * 0.4)


def test_memory_aware_forward_under_the_threshold_runs_at_once():
    n = node(memory_aware=True)
    big = only_op(n.dispatch(train(0, length=80), now=0.0))         # 800 bytes
    n.dispatch(train(1, length=10), now=0.0)                         # 800 + 100 = 900: at the limit
    step = n.op_done(big, now=1.0)
    assert [(op.kind, op.stage) for op in step.started] == [("train_f", 1), ("train_f", 0)]
    assert step.timers == [] and n.memory_waits == 0


def test_a_backward_of_offloaded_activations_reloads_them():
    n = node(memory_aware=True)
    steps = [n.dispatch(train(0, length=85), now=0.0), n.dispatch(train(1, length=10), now=0.0)]
    started = run_all(n, steps)
    ops = {(op.kind, op.stage, op.tasks[0].task_id): op for op in started}
    assert ops[("train_f", 0, 1)].offloaded                  # waited T_max on stage 0
    assert ops[("train_b", 0, 1)].reload                     # so its backward there reloads
    assert not ops[("train_b", 0, 0)].reload and not ops[("train_b", 1, 1)].reload
    assert op_duration(ops[("train_b", 0, 1)], TOY, PARAMS) == pytest.approx(
        2e-3 * 10 ** 2 + 100 / PARAMS.offload_bandwidth)
    assert n.offloads == 1 and n.memory_waits >= 1
    n.check_released()


def test_memory_steps_and_the_batch_window_scale_with_the_forward_latency():
    n = node(profile=SLOW)                                           # a 2 s forward latency
    (window,) = n.dispatch(inf(9), now=0.0).timers
    assert window.at_s == 1.0                                        # T_w = 0.5 x 2 s
    n = node(profile=SLOW)
    big = only_op(n.dispatch(train(0, length=85), now=0.0))
    n.dispatch(train(1, length=10), now=0.0)
    (timer,) = n.op_done(big, now=0.2).timers
    assert (timer.at_s, timer.step_s) == pytest.approx((0.3, 0.1))   # Δt = 0.05 x 2 s
    for waited in range(1, 100):
        step = n.timer(timer, now=timer.at_s)
        if step.started:
            break
        (timer,) = step.timers
    # T_max = 1 x 2 s: still 20 steps of Δt = 0.1 s
    assert waited == 20 and n.memory_waits == 20 and n.offloads == 1
    assert step.started[0].offloaded


def test_waiting_exactly_t_max_is_enough_to_offload():
    n = node(params=PARAMS.model_copy(update={"check_interval": 0.25}))   # T_max = 4 exact steps
    big = only_op(n.dispatch(train(0, length=85), now=0.0))
    n.dispatch(train(1, length=10), now=0.0)
    (timer,) = n.op_done(big, now=1.0).timers
    for waited in range(1, 100):
        step = n.timer(timer, now=timer.at_s)
        if step.started:
            break
        (timer,) = step.timers
    assert waited == 4 and timer.at_s == 2.0 and n.memory_waits == 4 and step.started[0].offloaded


def test_a_stage_arms_one_retry_timer_at_a_time():
    n = node(memory_aware=True)
    big = only_op(n.dispatch(train(0, length=85), now=0.0))
    n.dispatch(train(1, length=10), now=0.0)
    assert len(n.op_done(big, now=1.0).timers) == 1
    step = n.dispatch(train(2, length=10), now=1.01)                 # stage 0 looks again
    assert step.actions == [] and n.memory_waits == 1                # the pending retry serves


def test_a_later_forward_that_would_fit_keeps_its_place_behind_a_waiting_one():
    n = node(memory_aware=True)
    big = only_op(n.dispatch(train(0, length=85), now=0.0))         # 850 bytes
    n.dispatch(train(1, length=10), now=0.0)                         # 850 + 100 > 900: waits
    n.dispatch(train(2, length=5), now=0.0)                          # 850 + 50 = 900 would fit
    step = n.op_done(big, now=1.0)
    assert [(op.kind, op.stage) for op in step.started] == [("train_f", 1)]
    assert [op.tasks[0].task_id for _, _, op in sorted(n.stages[0].ready)] == [1, 2]


def test_a_backward_passes_every_forward_that_waits_for_memory():
    n = node(memory_aware=True)
    f0 = only_op(n.dispatch(train(0, length=85), now=0.0))          # 850 bytes
    n.dispatch(train(1, length=10), now=0.1)                         # both wait for memory
    n.dispatch(train(2, length=10), now=0.2)
    f1 = only_op(n.op_done(f0, now=1.0))
    b1 = only_op(n.op_done(f1, now=2.0))
    b0 = only_op(n.op_done(b1, now=3.0))                             # train 0's backward on stage 0
    assert (b0.kind, b0.stage, b0.tasks[0].task_id) == ("train_b", 0, 0)
    assert [(op.kind, op.tasks[0].task_id) for op in n.op_done(b0, now=4.0).started] == [("train_f", 1)]


def test_a_forward_that_holds_no_memory_passes_a_waiting_forward():
    n = node(memory_aware=True, profile=NO_KV)                       # a prefill reserves nothing
    f0 = only_op(n.dispatch(train(0, length=85), now=0.0))          # 850 bytes
    n.dispatch(train(1, length=10), now=0.0)                         # 850 + 100 > 900: waits
    assert n.dispatch(inf(2, batch=4), now=0.0).started == []       # closes at once; stage 0 runs f0
    step = n.op_done(f0, now=1.0)
    assert [(op.kind, op.stage) for op in step.started] == [("train_f", 1), ("prefill", 0)]
    assert step.started[1].mem_bytes == 0 and len(step.timers) == 1


def test_a_forward_offloaded_on_the_last_stage_reloads_for_its_backward_there():
    n = node(memory_aware=True, params=SLOW_LINK)
    # request 0 reserves 10 + 840 = 850 bytes on both stages while it decodes 30 tokens
    steps = [n.dispatch(inf(0, length=10, decode=30, max_tokens=840), now=0.0),
             n.dispatch(train(1, length=10), now=0.0)]              # closes the batch; 100 bytes
    started = run_all(n, steps)
    ops = {(op.kind, op.stage): op for op in started if op.kind.startswith("train")}
    assert ops[("train_f", 0)].offloaded and ops[("train_f", 1)].offloaded
    assert ops[("train_b", 1)].reload and ops[("train_b", 0)].reload
    # 100 bytes at 100 B/s: each backward takes 2e-3 x 10² + 1 s
    assert op_duration(ops[("train_b", 1)], TOY, SLOW_LINK) == pytest.approx(1.2)
    assert op_duration(ops[("train_b", 0)], TOY, SLOW_LINK) == pytest.approx(1.2)
    # T_max / Δt = 20 steps waited on each stage
    assert n.offloads == 2 and n.memory_waits == 40
    n.check_released()


# -- decode iterations -------------------------------------------------------------------------
def test_decode_runs_one_iteration_at_a_time_and_contexts_grow_by_one_token():
    n = node()
    steps = [n.dispatch(inf(0, length=10, decode=4, max_tokens=8), now=0.0),
             n.dispatch(inf(1, length=20, decode=2, max_tokens=8), now=0.0)]
    started = run_all(n, steps)           # the window closes the batch at 0.5
    decodes = [op for op in started if op.kind == "decode"]
    # each request's first token comes from the prefill; request 1 needs 1 decode, request
    # 0 needs 3. The context a decode reads grows by one token per iteration.
    assert [(op.stage, [r.task_id for r in op.tasks]) for op in decodes] == \
        [(0, [0, 1]), (1, [0, 1]), (0, [0]), (1, [0]), (0, [0]), (1, [0])]
    assert [op.after for op in decodes[1::2]] == [op.seq for op in decodes[0::2]]
    assert all(op.after is None for op in decodes[0::2])
    assert [r.context for r in decodes[0].tasks] == [13, 21]   # after the run: 10+3, 20+1
    # durations as each decode ran: batch 2 at mean context 15, then batch 1 at 11 and 12
    log = [(round(op_start, 6)) for op_start in (op.start_s for op in decodes)]
    gaps = [round(b - a, 6) for a, b in zip(log, log[1:])]
    assert gaps == [0.062, 0.062, 0.023, 0.023, 0.025]        # η_F·C·(2·ctx+1) per stage
    n.check_released()


def test_requests_that_end_at_their_first_token_never_decode():
    n = node()
    steps = [n.dispatch(inf(i, length=10, decode=1, max_tokens=8), now=0.0) for i in range(2)]
    started = run_all(n, steps)
    assert [op.kind for op in started] == ["prefill", "prefill"]


def test_stage_runs_the_oldest_ready_op_first():
    n = node()
    f0 = only_op(n.dispatch(train(0), now=0.0))
    n.dispatch(train(1), now=0.1)
    n.dispatch(train(2), now=0.2)
    step = n.op_done(f0, now=1.0)
    assert [(op.stage, op.tasks[0].task_id) for op in step.started] == [(1, 0), (0, 1)]


def test_a_decode_passes_a_forward_that_waits_for_memory():
    n = node(memory_aware=True)
    steps = [n.dispatch(inf(0, length=10, decode=3, max_tokens=8), now=0.0),
             n.dispatch(train(1, length=89), now=0.1)]    # closes the batch: prefill, then train_f
    started = run_all(n, steps, now=0.1)
    kinds = [(op.kind, op.stage) for op in started]
    # train 1's forward (890 + 18 > 900 on stage 0 while the request holds its KV) waits,
    # yet the request's decodes keep running on stage 0
    first_train = kinds.index(("train_f", 0))
    assert ("decode", 0) in kinds[:first_train]
    n.check_released()


def test_weight_sync_updates_the_served_version_after_every_stage():
    n = node()
    step = n.sync(7, now=0.0)
    s0, s1 = step.started
    assert {s0.stage, s1.stage} == {0, 1} and n.update_count == 0
    assert n.op_done(s0, now=1.0).synced is None and n.update_count == 0
    step = n.op_done(s1, now=1.0)
    assert step.synced == 7 and n.update_count == 7 and step.idle
    assert op_duration(s0, TOY, PARAMS) == TOY.weight_bytes_per_stage / PARAMS.sync_bandwidth


def test_busy_seconds_count_ops_in_flight():
    n = node()
    f0 = only_op(n.dispatch(train(0), now=1.0))
    assert n.busy_seconds(1.5) == pytest.approx(0.5)
    n.op_done(f0, now=2.0)
    assert n.busy_seconds(2.5) == pytest.approx(1.0 + 0.5)   # stage 0 done, stage 1 running
    with pytest.raises(ValueError):
        n.op_done(f0, now=3.0)                                  # it is not running any more


def test_a_node_records_its_first_op_start_and_its_last_op_end():
    n = node()
    assert n.first_start is None and n.last_end == 0.0               # nothing ran yet
    f0 = only_op(n.dispatch(train(0), now=1.0))
    n.dispatch(train(1), now=1.5)
    assert n.first_start == 1.0 and n.last_end == 0.0
    assert len(n.op_done(f0, now=2.0).started) == 2                   # train 0 on stage 1, train 1 on 0
    assert n.first_start == 1.0 and n.last_end == 2.0


def test_a_node_that_went_idle_reports_its_next_activation():
    n = node()
    s0, s1 = n.sync(3, now=0.0).started
    assert n.op_done(s0, now=1.0).idle is False
    assert n.op_done(s1, now=1.0).idle
    step = n.dispatch(inf(0), now=2.0)
    assert step.activated and not n.dispatch(inf(1), now=2.1).activated


def test_bad_calls_say_what_went_wrong():
    n = node()
    with pytest.raises(ValueError, match="unknown timer kind 'alarm'"):
        n.timer(Timer(0.0, 0, "alarm"), now=0.0)
    f0 = only_op(n.dispatch(train(0), now=0.0))
    n.op_done(f0, now=1.0)
    with pytest.raises(ValueError, match="node 0 stage 0: train_f op was not running"):
        n.op_done(f0, now=2.0)


def test_profile_learner_fits_after_warmup_and_refits_when_samples_double():
    learner = ProfileLearner(TOY, warmup=2)
    refits = []
    for i, length in enumerate((10, 20, 30, 40)):
        for stage in (0, 1):
            learner.observe(i, 1, length, "forward", 5e-3 * length ** 2)
            learner.observe(i, 1, length, "backward", 7e-3 * length ** 2)
        refits.append(learner.task_done(i))
    assert refits == [False, True, False, True]
    assert learner.current.eta_f == pytest.approx(5e-3) and learner.current.eta_b == pytest.approx(7e-3)
    assert learner.current.forward_latency_s == TOY.forward_latency_s   # the SLO base stays


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


def _started(step, kind):
    (op,) = [o for o in step.started if o.kind == kind]
    return op


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


# -- SIRIUS: elastic micro-batches --------------------------------------------------------------
def test_sirius_splits_a_training_task_that_does_not_fit_into_micro_batches():
    """TOY holds 10 bytes per training token and 900 under the threshold: a task of 4 x 25
    tokens (1,000 bytes) starts as a micro-batch of 3 (750) and leaves 1 waiting; each stage
    steps once, on the task's last micro-batch, and the task is trained once."""
    from raycolo.online.scheduling.stage_rules import SiriusRule

    n = NodeScheduler(0, TOY, PARAMS, True, rule=SiriusRule())
    trained, done = [], n.op_done

    def op_done(op, now, finished=()):
        step = done(op, now, finished)
        trained.extend(step.trained)
        return step
    n.op_done = op_done
    root = train(7, length=25, batch=4)
    started = run_all(n, [n.dispatch(root, 0.0)])
    forwards = [op for op in started if op.kind == "train_f" and op.stage == 0]
    assert [op.tasks[0].batch for op in forwards] == [3, 1] and n.micro.count == 1
    assert all(op.tasks[0].task_id < 0 for op in forwards)           # pieces have ids of their own
    assert forwards[0].mem_bytes == 750
    backwards = [op for op in started if op.kind == "train_b"]
    assert sorted((op.stage, op.step) for op in backwards) == [(0, False), (0, True), (1, False), (1, True)]
    last = [op for op in backwards if op.step]
    assert all(op.tasks[0] is forwards[1].tasks[0] for op in last)   # the remainder steps
    assert trained == [root] and not n.micro.pieces and not n.micro.splits
    n.check_released()


def test_a_task_that_fits_is_not_split_and_other_rules_never_split():
    from raycolo.online.scheduling.stage_rules import SiriusRule

    n = NodeScheduler(0, TOY, PARAMS, True, rule=SiriusRule())
    run_all(n, [n.dispatch(train(1, length=20, batch=4), 0.0)])      # 800 bytes fit
    assert n.micro.count == 0
    n = node()                                                        # LeMix's memory rule: wait, offload
    started = run_all(n, [n.dispatch(train(1, length=25, batch=4), 0.0)])
    assert n.micro.count == 0 and [op.offloaded for op in started if op.kind == "train_f"][0]


# -- node loops and their mirrors (node_events.py) ----------------------------------------------
@pytest.mark.parametrize("policy", ["lemix", "mix-luf", "separate", "sirius", "mace", "harli"])
def test_node_loops_fed_to_mirrors_give_the_direct_simulators_op_log(policy):
    """Each node run as its own loop, the cluster holding mirrors that apply the loops'
    events (SEPARATE's syncs going to the loops as commands): every step of a loop
    starts the ops and arms the timers of its mirror's (checked inside), and the run is
    the one the cluster gives driving its nodes itself, op for op."""
    profile, params = preset("llama-70b", 2), LemixParams(sync_every=5)
    tasks = poisson_workload(100, 0.6, 80, seed=1, train_batch=8 if policy == "sirius" else None)
    runs = []
    for loops in (False, True):
        sim = ClusterSimulator(tasks, profile, 3, make_online_policy(policy, params, nodes=3, train_rate=0.6),
                               params, node_loops=loops)
        runs.append((sim.run(), sim))
    (direct, a), (mirrored, b) = runs
    assert len(a.cluster.op_log) > 500 and a.cluster.op_log == b.cluster.op_log
    assert direct.completions == mirrored.completions == {t.task_id: 1 for t in tasks}
    assert list(direct.ttft_s) == list(mirrored.ttft_s) and direct.train_done == mirrored.train_done
    for loop, mirror in zip(b.loops, b.cluster.nodes):
        assert loop is not mirror and loop.generation == mirror.generation
        assert [s.busy_s for s in loop.stages] == [s.busy_s for s in mirror.stages]
        assert not loop.armed and not mirror.armed       # every timer fired on both sides
    if policy == "separate":
        assert any(entry[4] == "sync" for entry in b.cluster.op_log)


def test_a_loss_reaches_the_stage_rule_on_both_sides_and_a_mirror_out_of_step_says_so():
    """A last-stage training forward's loss goes to the node's stage rule through the
    event (MACE ranks a task's backward by it), on the loop and on its mirror alike; an
    event naming an op the node is not running is refused, and a timer from before a
    reset is void."""
    from raycolo.online.scheduling.node_events import Dispatched, MirrorDiverged, OpDone, TimerFired, apply

    profile, params = preset("llama-8b", 2), LemixParams()
    cluster = Cluster(make_online_policy("mace", params, nodes=1), profile, 1, params)
    loop, mirror = cluster.new_node(0), cluster.nodes[0]
    task = OnlineTask(7, "train", 0.0, 64, batch=2)
    events = [Dispatched(task, 0.0)]
    for side in (loop, mirror):
        (op,) = apply(side, events[0]).started
        assert (op.kind, op.stage) == ("train_f", 0)
    nxt = apply(loop, OpDone(0, op.seq, 0.5)).started
    apply(mirror, OpDone(0, op.seq, 0.5))
    (last,) = nxt
    assert (last.kind, last.stage) == ("train_f", 1)
    for side in (loop, mirror):
        apply(side, OpDone(1, last.seq, 1.0, loss=2.5))
        assert side.rule.losses == {7: 2.5}
    with pytest.raises(MirrorDiverged, match="op 999 is not running"):
        apply(mirror, OpDone(1, 999, 1.5))
    inference = OnlineTask(8, "inference", 1.0, 32, decode_tokens=4)
    (timer,) = apply(loop, Dispatched(inference, 1.0)).timers        # close_batch
    loop.reset(1.1)
    assert not loop.armed
    step = apply(loop, TimerFired(timer.number, 1.2))
    assert step.actions == [] and not step.tokens


def _run_stages(loop, now: float, tokens: dict, steps: int = 200) -> float:
    """Answer what ``loop`` sends its stages, in order, as stages that take 0.01 s per op
    would (the last stage samples ``tokens[task_id]`` for each of its requests), firing its
    timers as they fall due, until it is idle; returns the time then."""
    from raycolo.online.stages.stage_ops import QUIET, StageResult

    pending = []
    for _ in range(steps):
        pending += [o for o in loop.take_outbox() if not isinstance(o.message, QUIET)]
        if not pending:
            due = loop.next_timer()
            if due is None:
                return now
            now = max(now, due)
            loop.fire_due(now)
            continue
        out = pending.pop(0)
        now += 0.01
        m = out.message
        last = out.stage == loop.stages - 1
        answer = StageResult(m.seq, tokens=[tokens[r] for r in m.requests] if last else None)
        loop.done(out.stage, answer, now)
    raise AssertionError("the loop did not go idle")


def test_commands_reach_a_node_loop_started_from_its_mirror_and_its_reports_keep_the_mirror_in_step():
    """A loop starts from a copy of the cluster's mirror (as a stage 0 gets it over Ray),
    serves a request it is told of, ends it without its token when told to cancel, and
    its report replayed on the mirror leaves both idle; a scheduler adopted later reports
    under a new era, and adopting one with work in flight is refused."""
    import pickle

    from raycolo.generation import SamplingParams
    from raycolo.online.scheduling.node_commands import Adopt, Cancel, NodeSetup, Serve
    from raycolo.online.scheduling.node_loop import NodeLoop, replay
    from raycolo.online.stage_messages import ServedRequest

    profile, params = preset("llama-8b", 2), LemixParams()
    cluster = Cluster(make_online_policy("lemix", params, nodes=1), profile, 1, params)
    cluster.mirrored = True
    loop = NodeLoop(pickle.loads(pickle.dumps(cluster.nodes[0])), 0.1, 64)
    a, b = OnlineTask(1, "inference", 0.0, 3, 1, 6, 6), OnlineTask(2, "inference", 0.0, 3, 1, 6, 6)
    for task in (a, b):
        loop.command(Serve(ServedRequest(task, [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))), 0.0)
    loop.command(Cancel(2, "abort"), 0.0)       # before its first token: it ends with none
    loop.command(Cancel(99, "abort"), 0.0)      # not here: nothing happens
    now = _run_stages(loop, 0.0, {1: 7, 2: 8})
    report = loop.take_report()
    replay(cluster.nodes[0], report)
    got = {}
    for out in report.tokens:
        got.setdefault(out.task_id, []).append(out)
    assert [t.token for t in got[1]] == [7] * 6 and got[1][-1].finish_reason == "length"
    assert [t.position for t in got[1]] == list(range(6))     # each token's index in the completion
    assert got[2][-1].kept is False and got[2][-1].finish_reason == "abort"
    assert len(got[2]) == 1 and got[2][0].position == 0
    assert loop.idle and not cluster.nodes[0].active and cluster.nodes[0].queued_ops == 0
    cluster.nodes[0].check_released()
    fresh = Cluster(make_online_policy("mace", params, nodes=1), profile, 1, params)
    loop.command(Adopt(NodeSetup(fresh.nodes[0], 0.0, 0.1, 64, "", era=1)), now)
    assert loop.take_report().era == 1 and loop.node is fresh.nodes[0]
    loop.command(Serve(ServedRequest(OnlineTask(3, "inference", 0.0, 3, 1, 2, 2), [1, 2, 3],
                                     SamplingParams(max_tokens=2))), now)
    with pytest.raises(RuntimeError, match="work in flight"):
        loop.command(Adopt(NodeSetup(fresh.nodes[0], 0.0, 0.1, 64, "", era=2)), now)
