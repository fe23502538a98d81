"""Harli's and MACE's stage rules (raycolo/online/scheduling/stage_rules.py) on hand-worked cases,
through a real NodeScheduler, and in the simulator (the same code the live runtime runs)."""
from __future__ import annotations

import pytest

from raycolo.latency_predictor import DecodeLatencyPredictor
from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.node_types import Op, Request
from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import preset
from raycolo.online.scheduling.stage_rules import (HarliRule, MaceRule, PeriodicRule, StageRule, StaticPartitionRule,
                                        expected_op_s, harli_rule, mace_rule, pack_bins)
from raycolo.online.tasks import OnlineTask


def _op(kind, tasks, seq, ready_s=0.0, stage=0):
    return Op(kind, 0, stage, ready_s, seq, tasks)


def test_harli_runs_inference_first_and_fine_tunes_only_within_the_tpot_target():
    profile = preset("llama-8b", 2)
    predictor = DecodeLatencyPredictor(b0=1e-4, c0=5e-3, k0=2e-7, b1=1.0, k1=1.0)   # no interference
    train = OnlineTask(9, "train", 0.0, 128, 2, 0)
    decoding = [Request(OnlineTask(i, "inference", 0.0, 100, 1, 10, 10), context=300) for i in range(4)]
    f = _op("train_f", [train], 1)
    d_train = profile.forward_s(2, 128)
    assert expected_op_s(f, profile) == d_train
    # by hand: a decode iteration of 4 sequences at context 300 on 2 stages
    iteration = 2 * (4 * 1e-4 + 5e-3 + 4 * 2e-7 * 300)
    fits = HarliRule(predictor, iteration + d_train + 1e-9, profile)
    tight = HarliRule(predictor, iteration + d_train - 1e-9, profile)
    for rule, expected in ((fits, [f]), (tight, [])):
        node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
        node.joining = list(decoding)
        assert rule.decode_iteration_s(node) == pytest.approx(iteration)
        assert rule.order(node, 0, [f], 0.0) == expected
    assert tight.paused == 1 and fits.paused == 0
    node = NodeScheduler(0, profile, LemixParams(), False, rule=tight)
    prefill = _op("prefill", decoding[:1], 2, ready_s=5.0)
    assert tight.order(node, 0, [f, prefill], 6.0) == [prefill]     # inference first, even if younger
    assert tight.order(node, 0, [f], 6.0) == [f]                     # no inference on the node: train
    # stage 2 with interference, b1 = 1.5: the op's stage takes (1.5 s + (1 - s)) solo / s
    # = 1.5 solo + d_train, half a solo iteration more than the target that fitted before
    from dataclasses import replace
    slowed = HarliRule(replace(predictor, b1=1.5), iteration + d_train + 1e-9, profile)
    node = NodeScheduler(0, profile, LemixParams(), False, rule=slowed)
    node.joining = list(decoding)
    assert slowed.with_finetune_s(node, f) == pytest.approx(iteration + iteration / 4 + d_train)
    assert slowed.order(node, 0, [f], 0.0) == []


def test_harli_fits_a_fine_tune_op_into_a_decode_iterations_slack():
    """Only a decode iteration is ready: the fine-tune op goes first iff the iteration
    (the larger of the predictor's and the profiled step x stages) plus what ran on the
    stage since the last iteration plus the op stays within the TPOT target."""
    profile = preset("llama-8b", 2)
    predictor = DecodeLatencyPredictor(b0=1e-4, c0=5e-3, k0=2e-7)
    decoding = [Request(OnlineTask(i, "inference", 0.0, 100, 1, 10, 10), context=300) for i in range(4)]
    f = _op("train_f", [OnlineTask(9, "train", 0.0, 128, 2, 0)], 1)
    d = _op("decode", decoding, 2)
    iteration = max(2 * (4 * 1e-4 + 5e-3 + 4 * 2e-7 * 300), 2 * expected_op_s(d, profile))
    op_s = expected_op_s(f, profile)
    fits = HarliRule(predictor, iteration + op_s + 1e-9, profile)
    tight = HarliRule(predictor, iteration + op_s - 1e-9, profile)
    for rule, expected in ((fits, [f, d]), (tight, [d])):
        node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
        node.joining = list(decoding)
        assert rule.order(node, 0, [d, f], 0.0) == expected
    assert (fits.paused, tight.paused) == (0, 1)
    node = NodeScheduler(0, profile, LemixParams(), False, rule=fits)
    node.joining = list(decoding)
    fits.started(0, f)                                 # the op ran since the last iteration:
    assert fits.order(node, 0, [d, f], 0.0) == [d]     # no slack left on stage 0 ...
    assert fits.order(node, 1, [d, f], 0.0) == [f, d]  # ... but stage 1's is untouched
    fits.started(0, d)                                 # a new iteration: the slack is back
    assert fits.order(node, 0, [d, f], 0.0) == [f, d]
    prefill = _op("prefill", decoding[:1], 3)
    assert fits.order(node, 0, [d, f, prefill], 0.0) == [d, prefill]   # a prefill: inference only


def test_harli_predictor_is_fitted_to_the_node_profile():
    profile = preset("llama-8b", 2)
    rule = harli_rule(profile, LemixParams(tpot_multiplier=4.0))
    for bs, ctx in ((8, 512), (64, 1024), (200, 3000)):
        assert rule.predictor.solo(bs, ctx) == pytest.approx(float(profile.decode_step_s(bs, ctx)), rel=0.25)
    assert rule.tpot_target_s == pytest.approx(4.0 * 2 * rule.predictor.solo(1, profile.reference_length))


def test_mace_priorities_by_hand():
    rule = MaceRule(unit_s=1.0)
    req = lambda i, arr: Request(OnlineTask(i, "inference", arr, 10, 1, 5, 5), context=10)  # noqa: E731
    decode = _op("decode", [req(1, -1.0)], 1)
    prefill = _op("prefill", [req(2, -2.0)], 2)
    ft = _op("train_f", [OnlineTask(3, "train", -4.0, 50, 1, 0)], 3)
    # P = pi + delta * waited: decode 3 + 0.1*1 = 3.1; prefill 2 + 0.2*2 = 2.4; ft 1 + 0.5*4 = 3.0
    assert [rule.priority(op, 0.0) for op in (decode, prefill, ft)] == pytest.approx([3.1, 2.4, 3.0])
    assert rule.order(None, 0, [ft, prefill, decode], 0.0) == [decode, ft, prefill]
    rule.losses[3] = 2.0                                     # + gamma * loss = 0.2: ft first
    assert rule.order(None, 0, [prefill, decode, ft], 0.0) == [ft, decode, prefill]
    # later, fine-tuning's faster growth overtakes decode even without a loss
    rule.losses.clear()
    assert rule.order(None, 0, [decode, ft], 10.0)[0] is ft
    with pytest.raises(ValueError, match="pi_decode > pi_prefill > pi_ft"):
        MaceRule(unit_s=1.0, pi={"decode": 1.0, "prefill": 2.0, "ft": 0.5})


def test_the_default_rule_is_oldest_first():
    a, b = _op("decode", [], 5, ready_s=1.0), _op("train_f", [], 3, ready_s=1.0)
    c = _op("prefill", [], 9, ready_s=0.5)
    assert StageRule().order(None, 0, [a, b, c], 2.0) == [c, b, a]


def test_harli_keeps_decode_latency_down_in_the_simulator():
    """Same trace and round-robin allocation: Harli's rule lowers the TBT tail against
    plain mix-rr, and every task still completes exactly once."""
    from raycolo.online.simulation.sim import simulate
    from raycolo.online.tasks import poisson_workload
    from raycolo.online.policies import make_online_policy

    params = LemixParams()
    tasks = poisson_workload(50, 0.5, 400, seed=2)
    runs = {name: simulate(tasks, preset("llama-8b", 2), 4, make_online_policy(name, params, nodes=4,
                                                                                train_rate=0.5), params)
            for name in ("mix-rr", "harli")}
    for r in runs.values():
        assert r.completions == {t.task_id: 1 for t in tasks}
    assert runs["harli"].summary()["tbt_p99_s"] < runs["mix-rr"].summary()["tbt_p99_s"]


def test_sirius_takes_memory_back_from_training_that_waits_for_its_backward():
    """By hand: two training tasks hold 300 and 500 bytes on both stages and wait for their
    backward; a prefill short of 400 bytes on stage 0 aborts the larger one only (its
    memory is freed on every stage and it runs again from its first forward); a need
    beyond what waiting training holds aborts nothing."""
    from raycolo.online.scheduling.stage_rules import SiriusRule

    profile = preset("llama-8b", 2)
    node = NodeScheduler(0, profile, LemixParams(), True, rule=SiriusRule())
    node._begin(0.0)
    node.stages[1].busy = _op("decode", [], 0, stage=1)          # the last stage is busy
    tasks = {1: (OnlineTask(1, "train", 0.0, 100, 1, 0), 300.0), 2: (OnlineTask(2, "train", 0.0, 200, 1, 0), 500.0)}
    for t, size in tasks.values():
        for st in node.stages:
            st.held[("train", t.task_id)] = size
            st.used_bytes += size
        node._ready(node._op("train_b", 1, [t], size))
    assert not node._reclaim(0, 10_000) and node.aborts == 0 and node.stages[0].used_bytes == 800
    assert node._reclaim(0, 400)
    assert node.aborts == 1 and node.aborted_bytes == 1000
    assert [st.used_bytes for st in node.stages] == [300.0, 300.0]
    assert [op.tasks[0].task_id for _, _, op in node.stages[1].ready] == [1]
    [(_, _, retried)] = node.stages[0].ready       # queued behind the prefill that asked
    assert retried.kind == "train_f" and retried.tasks[0].task_id == 2 and retried.mem_bytes == 500.0


def _each_once_on_llama_70b(tasks, policies):
    """Simulate ``tasks`` on 4 x 2 llama-70b under each policy; every task completes once."""
    from raycolo.online.simulation.sim import simulate
    from raycolo.online.policies import make_online_policy

    params = LemixParams()
    runs = {name: simulate(tasks, preset("llama-70b", 2), 4,
                           make_online_policy(name, params, nodes=4, train_rate=0.5), params)
            for name in policies}
    for r in runs.values():
        assert r.completions == {t.task_id: 1 for t in tasks}
        assert r.train_done == sum(t.is_train for t in tasks)
    return runs


def test_sirius_serves_first_under_memory_pressure_and_completes_everything_once():
    """llama-70b, 100 rps, half training: memory is tight. SIRIUS's inference-first rule
    on memory-aware nodes keeps far more requests within the SLO than round robin with
    the same allocation, and every task completes exactly once."""
    from raycolo.online.tasks import poisson_workload

    runs = _each_once_on_llama_70b(poisson_workload(100, 0.5, 400, seed=0), ("mix-rr", "sirius"))
    assert runs["sirius"].overruns == 0 < runs["mix-rr"].overruns
    assert runs["sirius"].slo_attainment > 2 * runs["mix-rr"].slo_attainment


def test_sirius_trains_in_micro_batches_that_fit_and_finishes_sooner_than_waiting():
    """Training tasks of 8 samples (21.6 GiB of activations on llama-70b, 14 GiB free):
    SIRIUS runs them as micro-batches that fit, LeMix's memory rule waits and offloads
    them whole; each task is trained exactly once either way, and SIRIUS's training ends
    sooner with fewer offloads."""
    from raycolo.online.tasks import poisson_workload

    tasks = poisson_workload(100, 0.5, 300, seed=0, train_batch=8)
    assert {t.batch for t in tasks if t.is_train} == {8} and {t.batch for t in tasks if not t.is_train} == {1}
    runs = _each_once_on_llama_70b(tasks, ("lemix", "sirius"))
    assert runs["sirius"].summary()["training_splits"] > 0 == runs["lemix"].summary()["training_splits"]
    assert runs["sirius"].offloads < runs["lemix"].offloads
    assert runs["sirius"].summary()["makespan_s"] < runs["lemix"].summary()["makespan_s"]


def test_training_first_baseline_orders_fine_tuning_before_inference():
    from raycolo.online.scheduling.stage_rules import TrainingFirstRule

    decode = _op("decode", [], 1, ready_s=0.0)
    ft = _op("train_f", [OnlineTask(3, "train", 0.0, 50, 1, 0)], 2, ready_s=1.0)
    assert TrainingFirstRule().order(None, 0, [decode, ft], 2.0) == [ft, decode]


def test_bursty_workload_keeps_the_mean_rate_and_is_burstier_than_poisson():
    import numpy as np

    from raycolo.errors import ConfigError
    from raycolo.online.tasks import bursty_workload, poisson_workload

    tasks = bursty_workload(20.0, 0.3, 20_000, seed=4)
    gaps = np.diff([0.0] + [t.arrival_s for t in tasks])
    assert abs(1 / gaps.mean() - 20.0) / 20.0 < 0.05
    poisson_gaps = np.diff([0.0] + [t.arrival_s for t in poisson_workload(20.0, 0.3, 20_000, seed=4)])
    assert gaps.std() / gaps.mean() > 1.5 > poisson_gaps.std() / poisson_gaps.mean() > 0.9
    again = bursty_workload(20.0, 0.3, 20_000, seed=4)
    assert [t.arrival_s for t in again] == [t.arrival_s for t in tasks]
    assert abs(np.mean([t.is_train for t in tasks]) - 0.3) < 0.02
    for bad in (dict(rate=0.0), dict(rate=float("nan")), dict(burst_share=1.0)):
        kw = dict(rate=5.0, train_rate=0.5, tasks=10) | bad
        with pytest.raises(ConfigError):
            bursty_workload(**kw)


def test_mace_keeps_reported_losses_until_the_task_is_done():
    rule = MaceRule(unit_s=1.0)
    ft = _op("train_b", [OnlineTask(3, "train", 0.0, 50, 1, 0)], 1)
    base = rule.priority(ft, 0.0)
    rule.observe_loss(3, 4.0)
    assert rule.priority(ft, 0.0) == pytest.approx(base + 0.4)
    rule.forget(3)
    assert rule.priority(ft, 0.0) == pytest.approx(base) and not rule.losses
    StageRule().observe_loss(3, 1.0)          # the default keeps nothing


def test_harli_static_mode_gives_fine_tuning_a_fixed_time_share():
    from raycolo.online.scheduling.stage_rules import StaticShareRule

    profile = preset("llama-8b", 2)
    rule = StaticShareRule(share=0.5)
    node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
    node.first_start = 0.0
    node.joining = [Request(OnlineTask(1, "inference", 0.0, 10, 1, 5, 5), context=10)]   # inference runs
    f = _op("train_f", [OnlineTask(9, "train", 0.0, 64, 1, 0)], 2)
    node.stages[0].train_busy_s = 4.0
    assert rule.order(node, 0, [f], 10.0) == [f]          # 4 s of 10: within half
    assert rule.order(node, 0, [f], 7.0) == []            # 4 s of 7: over half, held
    node.joining = []
    assert rule.order(node, 0, [f], 7.0) == [f]           # no inference: free
    decode = _op("decode", [], 3)
    assert rule.order(node, 0, [f, decode], 10.0) == [decode]


def test_mace_bin_packing_is_algorithm_1_by_hand():
    # priority order a, b, c, d; capacity 100, tau_mem 0.9
    items = [("a", 60, 1.0), ("b", 50, 1.0), ("c", 30, 2.0), ("d", 10, 1.0)]
    bins = pack_bins(items, 100, 0.9, 10)
    # a opens bin 1; b (50) does not fit its 40 free: bin 2; c fits both, and scores
    # |40-30|/100 + |1-2| = 1.1 in bin 1 against 1.2 in bin 2; bin 1 then holds 90 >= 0.9 x 100,
    # so d is not dequeued (it waits for the next iteration)
    assert [b.items for b in bins] == [["a", "c"], ["b"]]
    assert (bins[0].memory, bins[0].max_latency) == (90, 2.0)
    assert [b.items for b in pack_bins(items, 100, 0.9, 2)] == [["a"], ["b"]]           # tau_task
    # z fits both bins: memory alone prefers bin 1 (|30-25| against |60-25|), the latency term
    # bin 2 (its ops take 5, like z, against 1): 0.05 + 4 = 4.05 against 0.35 + 0 = 0.35
    three = [("x", 70, 1.0), ("y", 40, 5.0), ("z", 25, 5.0)]
    assert [b.items for b in pack_bins(three, 100, 2.0, 10)] == [["x"], ["y", "z"]]
    assert [b.items for b in pack_bins(three, 100, 2.0, 10, (1.0, 0.0))] == [["x", "z"], ["y"]]
    with pytest.raises(ValueError, match="tau_task"):
        pack_bins(items, 100, 0.9, 0)


def test_mace_runs_its_first_bin_before_anything_that_came_later():
    profile = preset("llama-8b", 2)
    rule = mace_rule(profile, LemixParams())
    rule.tau_task = 2
    node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
    req = lambda i: Request(OnlineTask(i, "inference", 0.0, 64, 1, 5, 5), context=64)  # noqa: E731
    d1, d2, d3 = (_op("decode", [req(i)], i) for i in (1, 2, 3))
    assert rule.order(node, 0, [d1, d2, d3], 0.0) == [d1, d2]          # tau_task = 2: bin 1 is d1, d2
    rule.started(0, d1)
    late = _op("decode", [Request(OnlineTask(9, "inference", -50.0, 64, 1, 5, 5), context=64)], 9)
    assert rule.priority(late, 0.1) > rule.priority(d2, 0.1)
    assert rule.order(node, 0, [d2, d3, late], 0.1) == [d2]            # bin 1 first, though late ranks higher
    rule.started(0, d2)
    assert rule.order(node, 0, [d3, late], 0.2) == [late, d3] and rule.iterations == 2


def test_sirius_static_partition_splits_each_stages_memory():
    from raycolo.online.scheduling.node_types import Stage

    rule = StaticPartitionRule(train_memory=0.25)
    stage = Stage(used_bytes=60.0, held={("train", 1): 20.0, ("req", 2): 40.0})
    train, prefill = _op("train_f", [OnlineTask(3, "train", 0, 8, 1, 0)], 1), _op("prefill", [], 2)
    train.mem_bytes, prefill.mem_bytes = 5.0, 35.0
    assert rule.fits(stage, train, 100.0)            # 20 + 5 <= 25
    train.mem_bytes = 6.0
    assert not rule.fits(stage, train, 100.0)        # 26 > 25, though the stage has 40 free
    assert rule.fits(stage, prefill, 100.0)          # 40 + 35 <= 75
    prefill.mem_bytes = 36.0
    assert not rule.fits(stage, prefill, 100.0)
    assert StageRule().fits(stage, prefill, 100.0)   # the default: the whole stage


def test_periodic_retraining_waits_for_its_epoch_then_preempts_inference():
    profile = preset("llama-8b", 2)
    rule = PeriodicRule(period_s=10.0)
    node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
    f = _op("train_f", [OnlineTask(9, "train", 0.0, 64, 1, 0)], 1)
    node.stages[0].ready = [(0.0, 1, f)]
    d = _op("decode", [Request(OnlineTask(1, "inference", 0.0, 10, 1, 5, 5), context=10)], 2)
    assert rule.order(node, 0, [f, d], 1.0) == [d]                 # the first epoch is due at 11
    assert rule.order(node, 0, [f], 2.0) == [] and rule.wake_at(node, 0, 2.0) == 11.0
    assert rule.order(node, 0, [f, d], 11.0) == [f]                # the epoch: inference waits
    assert rule.order(node, 1, [d], 11.5) == []                    # on every stage of the node
    node.stages[0].ready = []                                      # the fine-tuning is done
    assert rule.order(node, 0, [d], 12.0) == [d] and rule.next_s == 22.0


def test_a_held_rule_wakes_its_stage_without_another_event():
    """The periodic baseline's only task is a fine-tune op and nothing else happens: the
    node arms a rule_wake timer for the epoch and the op starts when it fires."""
    profile = preset("llama-8b", 2)
    rule = PeriodicRule(period_s=10.0)
    node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
    step = node.dispatch(OnlineTask(9, "train", 0.0, 64, 1, 0), now=0.0)
    assert step.started == [] and [(t.kind, t.at_s) for t in step.timers] == [("rule_wake", 10.0)]
    step = node.timer(step.timers[0], now=10.0)
    assert [op.kind for op in step.started] == ["train_f"]
