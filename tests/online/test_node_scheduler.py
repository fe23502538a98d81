"""NodeScheduler (LeMix Algorithms 2 and 3), worked by hand with the toy profile
(tests/support/toy_node.py): the batch window, memory (Algorithm 2), decode, weight sync.
"""
import pytest

from raycolo.online.scheduling.node_types import Op, Timer
from raycolo.online.profiles import ProfileLearner
from raycolo.online.simulation.sim import op_duration
from tests.support.toy_node import NO_KV, PARAMS, SLOW, SLOW_LINK, TOY, inf, node, only_op, run_all, train


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
