"""SIRIUS's elastic micro-batches, and node loops against their mirrors: the same op log,
losses reaching the stage rule on both sides, commands and reports in step.
"""
import pytest

from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import preset
from raycolo.online.simulation.sim import ClusterSimulator
from raycolo.online.tasks import OnlineTask, poisson_workload
from raycolo.online.policies import make_online_policy
from tests.support.toy_node import PARAMS, TOY, node, run_all, train


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
