"""Reference simulator: one Python loop iteration per engine iteration.

The decisions come from :class:`raycolo.batching.step_scheduler.FcfsBlockScheduler`, the very code
the torch engine schedules with; this module only adds the clock (the latency model).
Tests check that :func:`raycolo.offline.sim.fast.simulate` agrees with it on many random
workloads, so the fast path predicts what the engine's scheduler does.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from raycolo.offline.costmodel.latency import IterationLatency
from raycolo.batching.step_scheduler import FcfsBlockScheduler, StepKind
from raycolo.offline.sim.types import ReplicaWorkload, SimResult
from raycolo.batching.limits import SchedulerLimits, ceil_div


class SchedulerDeadlock(RuntimeError):
    pass


def simulate(work: ReplicaWorkload, limits: SchedulerLimits, latency: IterationLatency,
             stop_at: float = math.inf) -> SimResult:
    remaining = work.remaining.copy()
    successor = work.successor
    finish = np.full(len(work), math.inf)
    generated = np.zeros(len(work), dtype=np.int64)
    fresh = work.fresh.copy()
    per_token = latency.weight_flops_per_token

    sched = FcfsBlockScheduler(limits)
    for idx, tokens in work.running:
        sched.add_running(idx, tokens)
    sched.add_front(work.waiting_first, [int(work.prompt_len[i]) for i in work.waiting_first])
    queued = {i for i, _ in work.running} | set(work.waiting_first)
    pending = [(work.ready[i], i) for i in range(len(work))
               if i not in queued and not math.isinf(work.ready[i])]
    heapq.heapify(pending)

    t = flops = useful = 0.0
    curve_t, curve_f, curve_u = [0.0], [0.0], [0.0]
    iterations = prefills = preemptions = 0
    stopped = False

    def complete(idx: int) -> None:
        finish[idx] = t
        sched.finished(idx)
        if successor[idx] >= 0:
            heapq.heappush(pending, (t, int(successor[idx])))

    while True:
        while pending and pending[0][0] <= t:
            idx = heapq.heappop(pending)[1]
            sched.add(idx, int(work.prompt_len[idx]))

        decision = sched.schedule()
        if decision.kind == StepKind.PREFILL:
            lens = [sched.prompt_len[i] for i in decision.seqs]
            tokens, sum_sq = sum(lens), sum(p * p for p in lens)
            dt = latency.prefill_seconds(len(lens), tokens, sum_sq)
            if t + dt > stop_at:
                sched.add_front(decision.seqs, lens)  # not started: back to the queue head
                stopped = True
                break
            t += dt
            flops += latency.prefill_flops(tokens, sum_sq)
            useful += per_token * (sum(p for i, p in zip(decision.seqs, lens) if fresh[i]) + len(lens))
            iterations += 1
            prefills += 1
            for idx in decision.seqs:
                generated[idx] += 1
                remaining[idx] -= 1
                if remaining[idx] == 0:
                    complete(idx)
                else:
                    sched.prefilled(idx)
            curve_t.append(t)
            curve_f.append(flops)
            curve_u.append(useful)
            continue

        if decision.kind == StepKind.DECODE:
            preemptions += len(decision.preempted)
            for victim in decision.preempted:
                fresh[victim] = False
            if not decision.seqs:
                continue
            attended = sum(sched.stored[i] + 1 for i in decision.seqs)
            dt = latency.decode_seconds(len(decision.seqs), attended)
            if t + dt > stop_at:
                stopped = True
                break
            t += dt
            flops += latency.decode_flops(len(decision.seqs), attended)
            useful += per_token * len(decision.seqs)
            iterations += 1
            sched.decoded(decision.seqs)
            for idx in decision.seqs:
                generated[idx] += 1
                remaining[idx] -= 1
                if remaining[idx] == 0:
                    complete(idx)
            curve_t.append(t)
            curve_f.append(flops)
            curve_u.append(useful)
            continue

        if pending:
            if pending[0][0] > stop_at:
                stopped = True
                break
            t = pending[0][0]
            continue
        if sched.waiting:
            head = sched.waiting[0]
            raise SchedulerDeadlock(
                f"request {head} needs {ceil_div(sched.prompt_len[head], limits.block_size)} KV "
                f"blocks; the replica has {limits.num_blocks}")
        break

    return SimResult(
        finish=finish, end_time=t, generated=generated,
        curve_t=np.asarray(curve_t), curve_flops=np.asarray(curve_f), curve_useful=np.asarray(curve_u),
        running=[(i, sched.stored[i]) for i in sched.running], waiting=list(sched.waiting),
        iterations=iterations, prefills=prefills, preemptions=preemptions, stopped=stopped)
