"""The node scheduler against its stages' paged KV pools (NodeProfile.kv_blocks): a
prefill starts only with the requests whose blocks for prompt + max_tokens are free on
every stage, whatever the policy.

The reference is the stage workers' own block accounting: each stage's
:class:`~raycolo.batching.blocks.BlockAllocator`, filled by StageModel's rule (a prefill
appends the prompt, a decode step one token; a request holds ceil(context / block_size)
blocks) and emptied when the node says a request ended. Without the ledger the same
workloads overflow those allocators (what crashed the live stage workers of 2026-12-02).
"""
import heapq
import itertools

import pytest

from raycolo.batching.blocks import BlockAllocator, blocks_for
from raycolo.online.lemix_params import LemixParams
from raycolo.online.policies import make_online_policy
from raycolo.online.profiles import NodeProfile, preset
from raycolo.online.scheduling.cluster import node_scheduler
from raycolo.online.scheduling.node_types import Timer
from raycolo.online.simulation.sim import ClusterSimulator, ends_with, op_duration
from raycolo.online.tasks import poisson_workload
from tests.support.toy_node import TOY, inf, node, only_op


def _pooled(profile: NodeProfile, blocks, block_size: int = 16) -> NodeProfile:
    return NodeProfile.model_validate({**profile.model_dump(), "kv_blocks": blocks, "block_size": block_size})


def _drive(n, tasks, block_size: int, pool: int):
    """Run ``tasks`` (arriving at their times) through node ``n`` on a fake clock with
    profiled op times; each stage's blocks are kept by a real BlockAllocator of ``pool``
    blocks as a stage worker keeps them. Returns (ops started, most blocks ever in use on
    a stage, requests finished)."""
    stages = [BlockAllocator(pool) for _ in n.stages]
    contexts = [dict() for _ in n.stages]
    heap, started, finished, peak, reserved, seq = [], [], [], 0, 0, itertools.count()

    def run_op(op):                     # what StageModel._chunks allocates for the op
        if op.kind not in ("prefill", "decode"):
            return
        for r in op.tasks:
            ctx = contexts[op.stage].get(r.task_id, 0) + (r.task.length if op.kind == "prefill" else 1)
            contexts[op.stage][r.task_id] = ctx
            alloc = stages[op.stage]     # each of the task's sequences holds its context
            alloc.allocate(r.task_id, r.task.batch * blocks_for(ctx, block_size) - alloc.blocks_of(r.task_id))
            if n.kv.blocks is not None:      # a request never holds more than it reserved
                assert alloc.blocks_of(r.task_id) <= r.kv_blocks, (r.task_id, alloc.blocks_of(r.task_id), r.kv_blocks)

    def push(step, now):
        nonlocal peak, reserved
        for r in step.finished:         # the node loop's ReleaseKV to every stage
            finished.append(r.task_id)
            for alloc, ctx in zip(stages, contexts):
                alloc.release(r.task_id)
                ctx.pop(r.task_id, None)
        for action in step.actions:
            if isinstance(action, Timer):
                heapq.heappush(heap, (action.at_s, next(seq), action))
            else:
                run_op(action)
                started.append(action)
                heapq.heappush(heap, (now + op_duration(action, n.profile, n.params), next(seq), action))
        peak = max(peak, *(a.used for a in stages))
        reserved = max(reserved, n.kv.reserved)

    for task in sorted(tasks, key=lambda t: t.arrival_s):
        heapq.heappush(heap, (task.arrival_s, next(seq), task))
    for _ in range(200_000):
        if not heap:
            break
        now, _, item = heapq.heappop(heap)
        if isinstance(item, Timer):
            push(n.timer(item, now), now)
        elif hasattr(item, "kind") and hasattr(item, "stage"):
            last = item.stage == len(n.stages) - 1 and item.kind in ("prefill", "decode")
            push(n.op_done(item, now, ends_with(item) if last else ()), now)
        else:
            push(n.dispatch(item, now), now)
    assert not heap, "the node never settled"
    for alloc in stages:
        alloc.check()
    return started, peak, reserved, finished


def test_a_batch_larger_than_the_free_blocks_starts_with_the_requests_that_fit():
    """Hand-worked: 5 blocks of 16 tokens; each request is 10 prompt + 20 max tokens =
    30 tokens = 2 blocks. The batch of 4 starts as a prefill of 0 and 1 (4 blocks); 2 and
    3 wait as a prefill of their own until request 0 ends (3 free: request 2 fits, 3 not);
    3 starts when 1 ends too."""
    n = node(profile=_pooled(TOY, 5))
    for i in range(3):
        n.dispatch(inf(i, length=10, decode=5, max_tokens=20), now=0.0)
    p0 = only_op(n.dispatch(inf(3, length=10, decode=5, max_tokens=20), now=0.0))   # max_batch 4 closes it
    assert [r.task_id for r in p0.tasks] == [0, 1] and p0.mem_bytes == 60 and n.kv.reserved == 4
    (waiting,) = [op for _, _, op in n.stages[0].ready]
    assert waiting.kind == "prefill" and [r.task_id for r in waiting.tasks] == [2, 3] and waiting.mem_bytes == 60
    p1 = only_op(n.op_done(p0, now=1.0))                       # stage 1 takes it; stage 0 has 1 block free
    assert p1.stage == 1 and n.kv.reserved == 4
    step = n.op_done(p1, now=2.0, finished={0})                # request 0 ends at its first token
    assert [r.task_id for r in step.finished] == [0] and n.kv.reserved == 4   # 2 back, 2 to request 2
    prefill = [op for op in step.started if op.kind == "prefill"]
    assert [[r.task_id for r in op.tasks] for op in prefill] == [[2]]
    assert [[r.task_id for r in op.tasks] for _, _, op in n.stages[0].ready if op.kind == "prefill"] == [[3]]
    assert [r.kv_blocks for r in prefill[0].tasks] == [2]


def test_a_request_longer_than_the_whole_pool_is_refused_at_dispatch():
    n = node(profile=_pooled(TOY, 4))
    n.dispatch(inf(0, length=40, max_tokens=24), now=0.0)      # 64 tokens: exactly 4 blocks
    with pytest.raises(ValueError, match=r"1 × \(40 prompt tokens \+ 25 to generate\) need 5 KV blocks; each stage has 4"):
        n.dispatch(inf(1, length=40, max_tokens=25), now=0.0)
    n.dispatch(inf(2, length=24, max_tokens=8, batch=2), now=0.0)     # 2 sequences of 2 blocks
    with pytest.raises(ValueError, match="2 × .* need 6 KV blocks; each stage has 4"):
        n.dispatch(inf(3, length=24, max_tokens=9, batch=2), now=0.0)


@pytest.mark.parametrize("policy", ["lemix", "mix-luf", "sirius", "harli"])
@pytest.mark.parametrize("seed,batch", [(0, 1), (1, 1), (2, 2)])
def test_no_stage_ever_runs_out_of_blocks_and_every_request_ends(policy, seed, batch):
    """Random workloads on a pool of 160 blocks of 16 tokens per stage (the hh-rlhf
    prompts and decode lengths of the paper's workload need far more at once): the stage
    allocators never refuse, the pool fills up, every request ends and every block comes
    back. The same runs without the ledger overflow the allocators. With ``batch`` 2 each
    task is two sequences, each holding its own blocks."""
    profile, params = preset("llama-8b", 2), LemixParams()
    tasks = poisson_workload(40, 0.3, 120, seed=seed, batch=batch)
    pooled = _pooled(profile, 160)
    make = lambda p: node_scheduler(make_online_policy(policy, params, nodes=1, train_rate=0.3), p, params, 0)  # noqa: E731
    n = make(pooled)
    _, used, reserved, finished = _drive(n, tasks, 16, 160)
    assert sorted(finished) == sorted(t.task_id for t in tasks if not t.is_train)
    assert used <= reserved <= 160 and reserved > 120     # the pool bound the run
    assert n.kv.reserved == 0                             # and all came back
    n.check_released()
    with pytest.raises(RuntimeError, match="KV blocks"):
        _drive(make(profile), tasks, 16, 160)


def test_a_pool_that_never_binds_changes_nothing():
    """Differential: with more blocks than the workload ever holds, the node schedules
    exactly as with no pool (the simulator's stages), op for op."""
    profile, params = preset("llama-8b", 2), LemixParams()
    tasks = poisson_workload(20, 0.4, 80, seed=3)
    logs = []
    for p in (profile, _pooled(profile, 1 << 20)):
        sim = ClusterSimulator(tasks, p, 2, make_online_policy("lemix", params, nodes=2, train_rate=0.4), params)
        sim.run()
        logs.append(sim.cluster.op_log)
    assert len(logs[0]) > 200 and logs[0] == logs[1]


def test_node_loops_and_their_mirrors_split_prefills_for_blocks_alike():
    """The split a full pool makes is a scheduling decision: a node loop and its mirror
    make it alike (the mirror check fails otherwise), and it changes the run."""
    profile, params = preset("llama-8b", 2), LemixParams()
    tasks = poisson_workload(40, 0.3, 100, seed=5)
    logs = []
    for p, loops in ((_pooled(profile, 160), False), (_pooled(profile, 160), True), (profile, False)):
        sim = ClusterSimulator(tasks, p, 2, make_online_policy("lemix", params, nodes=2, train_rate=0.3),
                               params, node_loops=loops)
        result = sim.run()
        assert result.completions == {t.task_id: 1 for t in tasks}
        logs.append(sim.cluster.op_log)
        for n in sim.cluster.nodes:
            n.check_released()
    assert logs[0] == logs[1] and logs[0] != logs[2]


def test_a_node_loop_frees_a_finished_requests_blocks_before_the_prefill_they_make_room_for():
    """Hand-worked, with the node loop's own messages: 3 blocks of 16 tokens; each request
    is 20 prompt + 12 tokens = 2 blocks, so request 1 waits for request 0. Its last token
    frees 2 blocks and starts request 1's prefill (2 blocks) in the same step: each stage
    must get the ReleaseKV before that prefill (sent after it, stage 0 crashed with
    "needs 2 KV blocks, 1 free" on 2026-12-02)."""
    from raycolo.generation import SamplingParams
    from raycolo.online.scheduling.node_loop import NodeLoop
    from raycolo.online.stage_messages import ServedRequest
    from raycolo.online.stages.stage_ops import ForwardStep, ReleaseKV, StageResult
    from raycolo.online.tasks import OnlineTask

    loop = NodeLoop(node(profile=_pooled(TOY, 3)), 0.1, 64)
    stages = [BlockAllocator(3) for _ in range(2)]
    contexts = [dict() for _ in range(2)]
    for i in range(2):
        loop.serve(ServedRequest(OnlineTask(i, "inference", 0.0, 20, 1, 12, 12), list(range(3, 23)),
                                 SamplingParams(max_tokens=12, ignore_eos=True)), 0.0)
    now, prefills, tokens = 0.0, [], {0: 0, 1: 0}
    for _ in range(500):
        outbox = loop.take_outbox()
        if not outbox:
            due = loop.next_timer()
            if due is None:
                break
            now = max(now, due)
            loop.fire_due(now)
            continue
        for out in outbox:                     # each stage runs its messages in order
            m, alloc, ctx = out.message, stages[out.stage], contexts[out.stage]
            if isinstance(m, ReleaseKV):
                for rid in m.requests:
                    alloc.release(rid)
                    ctx.pop(rid, None)
                continue
            assert isinstance(m, ForwardStep)
            if m.prefill and out.stage == 0:
                prefills.append((list(m.requests), alloc.free))
            for rid, count in zip(m.requests, m.counts):
                ctx[rid] = ctx.get(rid, 0) + count
                alloc.allocate(rid, blocks_for(ctx[rid], 16) - alloc.blocks_of(rid))
            now += 0.01
            last = out.stage == 1
            for rid in m.requests if last else ():
                tokens[rid] += 1
            loop.done(out.stage, StageResult(m.seq, tokens=[7] * len(m.requests) if last else None), now)
    assert prefills == [([0], 3), ([1], 3)]        # request 1 started on a pool emptied first
    assert tokens == {0: 12, 1: 12} and loop.idle
    assert all(a.free == 3 for a in stages) and loop.node.kv.reserved == 0
