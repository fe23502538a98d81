"""SIRIUS's memory reclaim and elastic micro-batches, a held rule's wake-ups and the
training-busy ledger, by hand through a real NodeScheduler (raycolo/online/scheduling/node.py).

These pin the edges the mutation run of 2026-11-27 left untested (docs/online.md,
"Mutation testing of the node scheduler"): who is aborted at exactly the bytes needed,
bookkeeping of the queued ops, more than two stages, the micro-batch size that fits."""
from __future__ import annotations

import pytest

from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import preset
from raycolo.online.scheduling.node import NodeScheduler, rule_wake_timer
from raycolo.online.scheduling.node_types import Op, Request
from raycolo.online.scheduling.stage_rules import PeriodicRule, SiriusRule, expected_op_s, harli_rule
from raycolo.online.tasks import OnlineTask

# task id -> bytes it holds on stages 0, 1, 2 while it waits for its first backward
# (None: nothing there, e.g. its forward on that stage ran offloaded)


HOLDINGS = {1: (300.0, 300.0, 300.0), 2: (500.0, 500.0, 500.0), 3: (1.0, 1.0, 1.0),
            4: (None, 200.0, 200.0), 5: (400.0, None, 400.0)}


def _waiting_for_backward() -> NodeScheduler:
    """Three stages, the last busy; five training tasks wait there for their backward."""
    node = NodeScheduler(0, preset("llama-8b", 3), LemixParams(), True, rule=SiriusRule())
    node._begin(0.0)
    node.stages[2].busy = Op("decode", 0, 2, 0.0, 99, [])
    for task_id, sizes in HOLDINGS.items():
        task = OnlineTask(task_id, "train", 0.0, 100, 1, 0)
        for stage, size in zip(node.stages, sizes):
            if size is not None:
                stage.held[("train", task_id)] = size
                stage.used_bytes += size
        node._ready(node._op("train_b", 2, [task], 0.0))
    return node


@pytest.mark.parametrize("need, aborted", [
    (0.5, [2]),             # the largest frees enough
    (500.0, [2]),           # exactly enough: no second victim
    (1201.0, [2, 5, 1, 3]),  # 500 + 400 + 300 + 1 on stage 0; task 4 holds nothing there
    (1202.0, []),           # more than waiting training holds: nothing is aborted
])
def test_reclaim_aborts_the_largest_waiting_training_first_and_only_what_it_must(need, aborted):
    node = _waiting_for_backward()
    assert node.queued_ops == 5
    assert node._reclaim(0, need) == bool(aborted)
    assert node._end().aborted == aborted and node.aborts == len(aborted)
    assert node.aborted_bytes == sum(s or 0.0 for t in aborted for s in HOLDINGS[t])
    for s, stage in enumerate(node.stages):      # every stage gives back what the victims held
        assert stage.used_bytes == sum(sizes[s] or 0.0 for t, sizes in HOLDINGS.items() if t not in aborted)
    # the victims leave the backward queue and wait to run again from their first forward
    assert sorted(op.tasks[0].task_id for _, _, op in node.stages[2].ready) == sorted(set(HOLDINGS) - set(aborted))
    assert [op.tasks[0].task_id for _, _, op in sorted(node.stages[0].ready)] == aborted
    assert node.queued_ops == 5


def test_a_prefill_short_of_memory_takes_it_back_and_starts():
    """Two stages; training waiting for its backward holds .3 and .5 of the memory
    threshold L on every stage. A prefill of .5 L needs .3 L more than the stage has under
    L: the .5 L task is aborted (largest first), the prefill starts, no stage overruns."""
    profile = preset("llama-8b", 2)
    node = NodeScheduler(0, profile, LemixParams(), True, rule=SiriusRule())
    limit = LemixParams().memory_threshold * profile.free_bytes
    node._begin(0.0)
    node.stages[1].busy = Op("decode", 0, 1, 0.0, 99, [])
    for task_id, share in ((1, 0.3), (2, 0.5)):
        for stage in node.stages:
            stage.held[("train", task_id)] = share * limit
            stage.used_bytes += share * limit
        node._ready(node._op("train_b", 1, [OnlineTask(task_id, "train", 0.0, 100, 1, 0)], 0.0))
    request = Request(OnlineTask(7, "inference", 0.0, 10, 1, 5, 5), context=10, kv_bytes=0.5 * limit)
    node._ready(node._op("prefill", 0, [request], 0.5 * limit))
    step = node._end()
    assert [op.kind for op in step.started] == ["prefill"] and not step.started[0].overrun
    assert step.aborted == [2] and node.overruns == 0
    assert node.stages[0].used_bytes == pytest.approx(0.8 * limit)


@pytest.mark.parametrize("fitting", [6, 1])
def test_sirius_starts_the_largest_micro_batch_that_fits_and_queues_the_rest(fitting):
    """A training task of 8 samples; stage 0 has room under the threshold for ``fitting``
    samples' activations (and a little more): that micro-batch starts, the rest waits
    as another with its own memory, and the split counts one piece not yet started."""
    profile = preset("llama-8b", 2)
    node = NodeScheduler(0, profile, LemixParams(), True, rule=SiriusRule())
    limit = LemixParams().memory_threshold * profile.free_bytes
    per_sample = profile.train_bytes(1, 64)
    node.stages[0].used_bytes = limit - (fitting + 0.5) * per_sample
    node.stages[0].held[("req", 99)] = node.stages[0].used_bytes
    step = node.dispatch(OnlineTask(9, "train", 0.0, 64, 8, 0), now=0.0)
    [started] = step.started
    assert (started.kind, started.tasks[0].batch) == ("train_f", fitting)
    assert started.mem_bytes == pytest.approx(fitting * per_sample)
    [(_, _, rest)] = node.stages[0].ready
    assert (rest.kind, rest.tasks[0].batch) == ("train_f", 8 - fitting)
    assert rest.mem_bytes == pytest.approx((8 - fitting) * per_sample)
    assert node.queued_ops == 2 and node.micro.splits[9].unstarted == 1


def test_training_busy_seconds_count_training_ops_only():
    """One stage: a training task's forward [1, 1.5] and backward [1.5, 1.75]."""
    node = NodeScheduler(0, preset("llama-8b", 1), LemixParams(), False)
    [forward] = node.dispatch(OnlineTask(9, "train", 1.0, 64, 1, 0), now=1.0).started
    [backward] = node.op_done(forward, now=1.5).started
    step = node.op_done(backward, now=1.75)
    assert [t.task_id for t in step.trained] == [9]
    assert node.stages[0].train_busy_s == pytest.approx(0.75) == node.stages[0].busy_s


def test_harli_counts_a_fine_tune_op_against_the_stage_it_started_on():
    profile = preset("llama-8b", 2)
    rule = harli_rule(profile, LemixParams())
    node = NodeScheduler(0, profile, LemixParams(), False, rule=rule)
    [forward] = node.dispatch(OnlineTask(9, "train", 0.0, 64, 1, 0), now=0.0).started
    assert rule.spent == {0: pytest.approx(expected_op_s(forward, profile))}


def test_a_held_stage_arms_one_wake_and_a_stale_wake_is_harmless():
    """The periodic baseline holds fine-tuning until its epoch at 10: one wake for the
    stage however many events look at it meanwhile; after it fired, a second delivery of it
    starts nothing. A wake for stage 1 names stage 1, and after a reset the new generation."""
    profile = preset("llama-8b", 2)
    node = NodeScheduler(0, profile, LemixParams(), False, rule=PeriodicRule(period_s=10.0))
    step = node.dispatch(OnlineTask(9, "train", 0.0, 64, 1, 0), now=0.0)
    [wake] = step.timers
    assert (wake.kind, wake.at_s, wake.stage) == ("rule_wake", 10.0, 0)
    assert node.dispatch(OnlineTask(10, "train", 1.0, 64, 1, 0), now=1.0).timers == []
    assert node.dispatch(OnlineTask(11, "train", 2.0, 64, 1, 0), now=2.0).timers == []
    other = rule_wake_timer(node, 1, now=3.0)
    assert (other.kind, other.stage, other.at_s) == ("rule_wake", 1, 10.0)
    assert [op.tasks[0].task_id for op in node.timer(wake, now=10.0).started] == [9]
    again = node.timer(wake, now=10.0)
    assert again.started == [] and again.timers == []
    fresh = NodeScheduler(0, profile, LemixParams(), False, rule=PeriodicRule(period_s=10.0))
    fresh.reset(now=1.0)
    [wake] = fresh.dispatch(OnlineTask(9, "train", 2.0, 64, 1, 0), now=2.0).timers
    assert (wake.at_s, wake.generation) == (12.0, fresh.generation) and fresh.generation == 1
    assert [op.kind for op in fresh.timer(wake, now=12.0).started] == ["train_f"]
