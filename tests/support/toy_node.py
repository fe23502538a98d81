"""A toy node for NodeScheduler's hand-worked tests (LeMix Algorithms 2 and 3).

The toy profile: 2 stages, 1 KV byte per token, 9 activation bytes per token (10 bytes a
training token holds), 1000 bytes free per stage (threshold 900), a forward latency of
1 s: T_w = 0.5 s, Δt = 0.05 s, T_max = 1 s.
"""
import heapq
import itertools

from raycolo.online.scheduling.node import NodeScheduler
from raycolo.online.scheduling.node_types import Timer
from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import NodeProfile
from raycolo.online.simulation.sim import ends_with, op_duration
from raycolo.online.tasks import OnlineTask


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
def _started(step, kind):
    (op,) = [o for o in step.started if o.kind == kind]
    return op
