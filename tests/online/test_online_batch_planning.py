"""Batch-aware LeMix planning: hand-worked plans of tasks in the batches Algorithm 3 runs
them in, eq. 4 behind planned backwards, and the grid's fast slice (the default policy
against mix-rr at the cell where the paper-literal planning lost)."""
from dataclasses import dataclass

import pytest

from raycolo.online.lemix_params import PAPER_LITERAL, LemixParams
from raycolo.online.policies import make_online_policy
from raycolo.online.policies.lemix import Lemix
from raycolo.online.scheduling.allocation import best_node
from raycolo.online.profiles import preset
from raycolo.online.scheduling.batch_rule import BatchRule
from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.planning import NodeTrace, commit_plan, compute_idleness, response_upper_bound
from raycolo.online.scheduling.scheduler import OnlineScheduler
from raycolo.online.simulation.sim import simulate
from raycolo.online.tasks import OnlineTask, poisson_workload


@dataclass
class Linear:
    """forward = 0.1·C·ℓ s per stage, backward a constant: easy to work by hand."""

    backward: float = 0.2

    def forward_s(self, batch, length):
        return 0.1 * batch * length

    def backward_s(self, batch, length):
        return self.backward


RULE = BatchRule(max_batch=3, max_wait_s=0.5)


def spans(plan):
    return [tuple(round(x, 9) for x in span) for span in plan.spans]


def test_inference_tasks_are_planned_in_the_batch_they_join():
    """S = 2, idle since 0, T_w = 0.5, max ΣC = 3.

    A (ℓ 2) at 0 opens a batch closing at 0.5: forward 0.2, s1 [.5, .7], s2 [.7, .9];
      Π = .5 + .7 = 1.2 (the stages wait for the batch), R = .9.
    B (ℓ 3) at .2 joins: ΣC 2, ℓ 3, forward .6: s1 [.5, 1.1], s2 [1.1, 1.7]; the batch's Π
      becomes .5 + 1.1 = 1.6, so B adds .4; R = 1.5. A's path is the batch's: it moves too.
    C (ℓ 1) at .3 fills it (ΣC 3): it closes at once, forward .9: s1 [.3, 1.2], s2 [1.2, 2.1];
      Π 1.5, C adds -.1; R = 1.8.
    D (ℓ 1) at .4: the batch is closed, D opens one closing at .9: s1 [1.2, 1.3] (after the
      full batch), s2 [2.1, 2.2]; Π 0, R 1.8.
    """
    trace = NodeTrace(stages=2)
    a = compute_idleness(trace, 0, 0.0, 2, 1, False, Linear(), now=0.0, batching=RULE)
    assert spans(a) == [(0.5, 0.7), (0.7, 0.9)]
    assert (a.idle, a.response) == pytest.approx((1.2, 0.9))
    path_a = commit_plan(trace, a, now=0.0)
    b = compute_idleness(trace, 1, 0.2, 3, 1, False, Linear(), now=0.2, batching=RULE)
    assert b.joined is trace.batch
    assert spans(b) == [(0.5, 1.1), (1.1, 1.7)]
    assert (b.idle, b.response) == pytest.approx((0.4, 1.5))
    assert commit_plan(trace, b, now=0.2) is path_a
    assert [(round(s.start_f, 9), round(s.end_f, 9)) for s in path_a.stages] == [(0.5, 1.1), (1.1, 1.7)]
    c = compute_idleness(trace, 2, 0.3, 1, 1, False, Linear(), now=0.3, batching=RULE)
    assert spans(c) == [(0.3, 1.2), (1.2, 2.1)]
    assert (c.idle, c.response) == pytest.approx((-0.1, 1.8))
    commit_plan(trace, c, now=0.3)
    assert trace.batch.closed and trace.batch.queries == 3
    d = compute_idleness(trace, 3, 0.4, 1, 1, False, Linear(), now=0.4, batching=RULE)
    assert d.joined is None
    assert spans(d) == [(1.2, 1.3), (2.1, 2.2)]
    assert (d.idle, d.response) == pytest.approx((0.0, 1.8))
    # Algorithm 1 as written: each task its own forward, from its arrival
    plain = compute_idleness(NodeTrace(stages=2), 0, 0.0, 2, 1, False, Linear(), now=0.0)
    assert spans(plain) == [(0.0, 0.2), (0.2, 0.4)]


def test_a_training_task_closes_the_planned_batch_and_late_tasks_open_a_new_one():
    trace = NodeTrace(stages=1)
    commit_plan(trace, compute_idleness(trace, 0, 0.0, 1, 1, False, Linear(), now=0.0, batching=RULE), now=0.0)
    assert trace.batch.joinable(0.4) and not trace.batch.joinable(0.5)     # T_w closes it at 0.5
    train = compute_idleness(trace, 1, 0.1, 1, 1, True, Linear(), now=0.1, batching=RULE)
    commit_plan(trace, train, now=0.1)
    assert trace.batch.closed
    late = compute_idleness(trace, 2, 0.2, 1, 1, False, Linear(), now=0.2, batching=RULE)
    assert late.joined is None and late.close_s == pytest.approx(0.7)


def test_the_node_closes_batches_by_the_rule_planning_predicts():
    params = LemixParams(max_batch=2, max_wait=0.5)
    profile = preset("gpt-400m", stages=1)
    node = NodeScheduler(0, profile, params, memory_aware=True)
    rule = BatchRule.of(params, profile)
    step = node.dispatch(OnlineTask(0, "inference", 0.0, 8, 1), now=0.0)
    assert [a.at_s for a in step.actions] == [rule.closes_at(0.0)]
    step = node.dispatch(OnlineTask(1, "inference", 0.001, 8, 1), now=0.001)
    assert [a.kind for a in step.actions] == ["prefill"] and rule.full(2)


@pytest.mark.parametrize("batch_aware, held", [(True, True), (False, False)])
def test_eq4_plans_the_next_inference_in_its_batch_behind_planned_backwards(batch_aware, held):
    """S = 1, SLO 5 × 0.03 = 0.15 s, T_w = 0.5 × 0.03 = 0.015 s. A training task at 0:
    forward [0, .05], backward [.05, .11]. The next inference (ℓ 10, predicted at 0) waits
    for its batch (.015), then for the forward, and ends after the backward: R = .11 + .05 =
    .16 > .15, so the task is held. Eq. 4 as written sees only the forward: .05 + .05."""
    params = LemixParams(batch_aware=batch_aware, hold_share=1.0)
    profile = preset("gpt-400m", stages=1)
    est = Fixed(0.05, 0.06)
    sched = OnlineScheduler(Lemix(params), [profile], [est], params)
    sched.inference_length, sched.last_inference_s, sched.inference_gap_s = 10.0, 0.0, 0.0
    node = sched.policy.allocate(OnlineTask(7, "train", 0.0, 10, 1), sched, now=0.0)
    assert (node is None) == held


@pytest.mark.parametrize("hold_share, errors, held", [
    (1.0, [], False),                # R' = .14: not above τ_R = .15
    (0.9, [], True),                 # held above .9 · .15 = .135
    (1.0, [0.02] * 15, False),       # 15 errors: fewer than MIN_PLAN_ERRORS, no margin yet
    (1.0, [0.0] * 8 + [0.02] * 8, True),   # the 0.9 quantile of 16 errors (.02) comes off τ_R
    (1.0, [0.0] * 15 + [0.02], False),     # ... but not the largest of them alone
    (1.0, [-0.5] * 16, False),       # early first tokens give no negative margin
])
def test_eq4_holds_at_a_share_of_the_slo_less_the_plan_error_quantile(hold_share, errors, held):
    """S = 1, batch-aware, backward .04: the next inference (at 0) waits for its batch, then
    runs after the training forward and backward [0, .09]: R' = .09 + .05 = .14 (τ_R .15).
    The margin is eq. 4's calibration without node backlogs (backlog_aware false)."""
    params = LemixParams(hold_share=hold_share, backlog_aware=False)
    profile = preset("gpt-400m", stages=1)
    sched = OnlineScheduler(Lemix(params), [profile], [Fixed(0.05, 0.04)], params)
    sched.inference_length, sched.last_inference_s, sched.inference_gap_s = 10.0, 0.0, 0.0
    for e in errors:
        sched.record_plan_error(e)
    node = sched.policy.allocate(OnlineTask(7, "train", 0.0, 10, 1), sched, now=0.0)
    assert (node is None) == held


def test_plan_errors_are_first_tokens_against_their_plan():
    """An inference task's last-stage prefill ends .2 s after planned: one error of .2."""
    params = LemixParams()
    profile = preset("gpt-400m", stages=2)
    sched = OnlineScheduler(Lemix(params), [profile], [Fixed(0.1, 0.1)], params)
    d = sched.submit(OnlineTask(1, "inference", 0.0, 10, 1), now=0.0)
    planned = d.path.end_f(1)
    sched.observe(1, 0, "forward", d.path.stages[0].start_f, d.path.stages[0].end_f)
    assert list(sched.plan_errors) == []
    sched.observe(1, 1, "forward", planned, planned + 0.2)
    assert list(sched.plan_errors) == pytest.approx([0.2])
    for k in range(300):                  # the latest 256 are kept, and their quantile is exact
        sched.record_plan_error(k / 1000)
    assert len(sched.plan_errors) == 256 and sched.plan_margin(1.0) == pytest.approx(0.299)
    assert sched.plan_margin(0.0) == pytest.approx(0.044) and sched.plan_margin(None) == 0.0


def test_a_node_backlog_is_its_latest_lateness_drained_at_wall_rate():
    """A task's stage-0 forward ends .2 s after its plan: the node is .2 s behind then,
    .1 s behind .1 s later, and caught up from .2 s later; a node reset forgets it."""
    params = LemixParams()
    profile = preset("gpt-400m", stages=2)
    sched = OnlineScheduler(Lemix(params), [profile] * 2, [Fixed(0.1, 0.1)] * 2, params)
    d = sched.submit(OnlineTask(1, "inference", 0.0, 10, 1), now=0.0)
    st = d.path.stages[0]
    end = st.end_f + 0.2
    sched.observe(1, 0, "forward", st.start_f, end)
    node = d.node
    assert sched.backlog(node, end) == pytest.approx(0.2)
    assert sched.backlog(node, end + 0.1) == pytest.approx(0.1)
    assert sched.backlog(node, end + 0.3) == 0.0 and sched.backlog(1 - node, end) == 0.0
    sched.observe(1, 1, "forward", end, end + 0.1 - 0.05)   # the last stage ends .05 s early
    assert sched.backlog(node, end + 0.05) == 0.0
    sched.lateness[node] = (1.0, end)
    sched.node_reset(node, [], now=end)
    assert sched.backlog(node, end) == 0.0


@pytest.mark.parametrize("backlog_aware, expected_node", [(False, 0), (True, 1)])
def test_a_backlog_the_plans_miss_moves_the_task_to_the_node_that_answers_sooner(backlog_aware, expected_node):
    """tests/online/test_online.py's consolidation case: at .5, node 0 planned busy until 1 (R0 =
    1.5, IP0 = -.03), node 1 idle (R1 = 1, IP1 = -.14): f0 = -.045 > f1 = -.14, node 0.
    Node 0 ran 3.5 s late at .4, so 3.4 s behind at .5: R0 = 4.9, f0 = -.147 < f1: node 1."""
    from tests.online.test_online import _two_node_scheduler

    sched = _two_node_scheduler(LemixParams(arrival_gap="global", backlog_aware=backlog_aware))
    sched.last_arrival_s = 0.49
    sched.lateness[0] = (3.5, 0.4)
    assert sched.submit(OnlineTask(1, "inference", 0.5, 10, 1, 4), now=0.5).node == expected_node


def test_eq4_adds_each_node_backlog_to_the_next_inference_response():
    """As the eq. 4 case above (R' = .14 against τ_R = .15, not held): a node .02 s behind
    makes R' = .16 and holds the training task."""
    for behind, held in ((0.0, False), (0.02, True)):
        params = LemixParams(hold_share=1.0)
        sched = OnlineScheduler(Lemix(params), [preset("gpt-400m", stages=1)], [Fixed(0.05, 0.04)], params)
        sched.inference_length, sched.last_inference_s, sched.inference_gap_s = 10.0, 0.0, 0.0
        sched.lateness[0] = (behind, 0.0)
        node = sched.policy.allocate(OnlineTask(7, "train", 0.0, 10, 1), sched, now=0.0)
        assert (node is None) == held


@dataclass
class Fixed:
    forward: float
    backward: float

    def forward_s(self, batch, length):
        return self.forward

    def backward_s(self, batch, length):
        return self.backward


@pytest.mark.parametrize("busy_until, surely, held", [
    (0.11, True, True),     # R′ without the task .11 + .05 = .16 > .15: held before any planning
    (0.09, False, True),    # R′ without it .14; with it (forward [.09, .14], backward to .18) .23
    (0.00, False, False),   # as in the eq. 4 cases above: R′ = .14 with the task, not held
])
def test_a_training_task_is_surely_held_only_where_eq4_holds_it(busy_until, surely, held):
    """S = 1, τ_R .15 (hold_share 1), T_w .015, forward .05, backward .04, one node busy
    until ``busy_until``. The precheck's bound with the task: its forward after the node's
    last one, then the next inference task's (.11: .16 + .05 = .21). It answers only where
    the full eq. 4 check would hold the task, and may leave a held one to it (.09)."""
    params = LemixParams(hold_share=1.0)
    sched = OnlineScheduler(Lemix(params), [preset("gpt-400m", stages=1)], [Fixed(0.05, 0.04)], params)
    sched.inference_length, sched.last_inference_s, sched.inference_gap_s = 10.0, 0.0, 0.0
    sched.traces[0].idle_since = busy_until
    task = OnlineTask(7, "train", 0.0, 10, 1)
    assert sched.policy._surely_held(sched, task, now=0.0) == surely
    assert (sched.policy.allocate(task, sched, now=0.0) is None) == held


class _Checked(Lemix):
    """LeMix that also runs the full eq. 4 check wherever the held precheck answers, and
    plans R′ exactly wherever the upper bound of eq. 4's below-saturation shortcut is taken."""

    def __post_init__(self):
        super().__post_init__()
        self.seen, self.bounds, self.answered = [], [], 0

    def _surely_held(self, sched, task, now, hold=None):
        surely = super()._surely_held(sched, task, now, hold)
        nodes, scanned = self._nodes(sched, task, now)
        plans, scores = self.score(sched, task, now, nodes)
        n = best_node(scores)
        self.seen.append((surely, self._at_risk(sched, n, plans[n], now, scanned, nodes)))
        return surely

    def _answers_in_time(self, sched, order, arrival, length, slo, backlog, now):
        answered = super()._answers_in_time(sched, order, arrival, length, slo, backlog, now)
        self.answered += answered
        if not order:
            return answered
        n, rule = order[0], self.batching(sched, order[0])
        bound = response_upper_bound(sched.traces[n], arrival, length, sched.estimators[n], rule)
        exact = compute_idleness(sched.traces[n], -1, arrival, length, 1, False, sched.estimators[n], now,
                                 batching=rule).response
        self.bounds.append((bound, exact))
        return answered


class _Unchecked(Lemix):
    def _surely_held(self, sched, task, now, hold=None):
        return False

    def _answers_in_time(self, sched, order, arrival, length, slo, backlog, now):
        return False


@pytest.mark.parametrize("model, rate, alpha, overrides, saturated", [
    ("gpt-2.5b", 150, 0.5, {}, True),
    ("gpt-2.5b", 150, 0.5, {"scan_nodes": 2}, True),          # the node index's candidates
    ("gpt-2.5b", 150, 0.5, {"backlog_aware": False}, True),   # the plan-error margin instead
    ("llama-70b", 25, 0.15, {}, True),
    ("llama-8b", 50, 0.5, {}, False),
])
def test_eq4_shortcuts_never_change_a_decision(model, rate, alpha, overrides, saturated):
    """Past saturation most training decisions are held: the held precheck must answer only
    where Algorithm 1 + eq. 4 would hold (checked on every decision). Below it, eq. 4's
    upper bound of R′ must never be below R′ as planned. Both leave the run identical to
    one without them, and each answers often where it is meant to."""
    work = poisson_workload(rate, alpha, 500, seed=3)
    profile, params = preset(model, 2), LemixParams(**overrides)
    checked = _Checked(params)
    runs = [simulate(work, profile, 4, policy, params) for policy in (checked, _Unchecked(params))]
    assert all(full for surely, full in checked.seen if surely)
    assert all(bound >= exact for bound, exact in checked.bounds if bound is not None)
    if saturated:
        assert sum(surely for surely, _ in checked.seen) > 0.2 * len(checked.seen)
    else:
        assert checked.answered > 0.5 * len(checked.bounds) > 0
    a, b = (r.summary() for r in runs)
    for key in ("decision_us_mean", "decision_us_p50", "decision_us_p99"):
        a.pop(key, None), b.pop(key, None)
    assert a == b and runs[0].deferred_max == runs[1].deferred_max


def test_the_response_upper_bound_by_hand():
    """S = 1, forward .05 per query, T_w .015, a training task planned at 0: forward [0, .05],
    backward [.05, .11]. The next inference task at 0 waits for it and for the backward:
    R′ = .16, and the bound is exact. With the backward planned at [1, 1.06] the forward
    fits between (R′ = .05 + .05 = .10), but the bound, which does not walk the queue, is
    1.06 + .05 = 1.11.
    Joining the open batch: no bound."""
    params = LemixParams(hold_share=1.0)
    profile = preset("gpt-400m", stages=1)
    rule = BatchRule.of(params, profile)
    for backward_at, exact, bound in ((None, 0.16, 0.16), (1.0, 0.10, 1.11)):
        trace = NodeTrace(stages=1)
        train = compute_idleness(trace, 7, 0.0, 10, 1, True, Fixed(0.05, 0.06), now=0.0)
        path = commit_plan(trace, train, now=0.0)
        if backward_at is not None:
            path.stages[0].start_b, path.stages[0].end_b = backward_at, backward_at + 0.06
        plan = compute_idleness(trace, -1, 0.0, 10, 1, False, Fixed(0.05, 0.06), now=0.0, batching=rule)
        assert plan.response == pytest.approx(exact)
        assert response_upper_bound(trace, 0.0, 10, Fixed(0.05, 0.06), rule) == pytest.approx(bound)
    commit_plan(trace, plan, now=0.0)                # an open batch the next task would join
    assert response_upper_bound(trace, 0.001, 10, Fixed(0.05, 0.06), rule) is None


def test_grid_slice_default_policy_at_least_mix_rr_on_slo():
    """The cell issue 30 names: gpt-2.5b, 4 × 2, 150 rps, α 0.5, seed 0, 1,000 tasks. The
    paper-literal planning (batch_aware false) lost it: 0.485 against mix-rr's 0.530."""
    work = poisson_workload(150, 0.5, 1000, seed=0)
    profile, params = preset("gpt-2.5b", 2), LemixParams()
    default = simulate(work, profile, 4, make_online_policy("lemix", params, nodes=4, train_rate=0.5), params)
    rr = simulate(work, profile, 4, make_online_policy("mix-rr", params, nodes=4, train_rate=0.5), params)
    assert default.slo_attainment >= rr.slo_attainment, (default.slo_attainment, rr.slo_attainment)
    assert default.throughput >= rr.throughput * 0.95
    literal = LemixParams(**PAPER_LITERAL)        # the paper's equations as written lose this cell
    paper = simulate(work, profile, 4, make_online_policy("lemix", literal, nodes=4, train_rate=0.5), literal)
    assert paper.slo_attainment < rr.slo_attainment <= default.slo_attainment
