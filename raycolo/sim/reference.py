"""Reference simulator: one Python loop iteration per engine iteration.

It is deliberately plain so that it can be read against docs/simulator.md; tests check
that :func:`raycolo.sim.fast.simulate` agrees with it on many random workloads.
"""
from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from raycolo.costmodel.latency import IterationLatency
from raycolo.sim.types import ReplicaWorkload, SchedulerLimits, SimResult, ceil_div


class SchedulerDeadlock(RuntimeError):
    pass


def simulate(work: ReplicaWorkload, limits: SchedulerLimits, latency: IterationLatency,
             stop_at: float = math.inf) -> SimResult:
    bs = limits.block_size
    prompt = work.prompt_len.copy()
    remaining = work.remaining.copy()
    successor = work.successor
    finish = np.full(len(work), math.inf)
    generated = np.zeros(len(work), dtype=np.int64)

    free = limits.num_blocks
    running: list[int] = []
    stored: dict[int, int] = {}
    blocks: dict[int, int] = {}
    for idx, tokens in work.running:
        running.append(idx)
        stored[idx] = tokens
        blocks[idx] = ceil_div(tokens, bs)
        free -= blocks[idx]
    waiting: deque[int] = deque(work.waiting_first)
    queued = set(running) | set(work.waiting_first)
    pending = [(work.ready[i], i) for i in range(len(work))
               if i not in queued and not math.isinf(work.ready[i])]
    heapq.heapify(pending)

    fresh = work.fresh.copy()
    per_token = latency.weight_flops_per_token
    t = flops = useful = 0.0
    curve_t, curve_f, curve_u = [0.0], [0.0], [0.0]
    iterations = prefills = preemptions = 0
    stopped = False

    def complete(idx: int) -> None:
        finish[idx] = t
        if successor[idx] >= 0:
            heapq.heappush(pending, (t, int(successor[idx])))

    while True:
        while pending and pending[0][0] <= t:
            waiting.append(heapq.heappop(pending)[1])

        batch, tokens, sum_sq, free_after = [], 0, 0, free
        for idx in waiting:
            if len(running) + len(batch) >= limits.max_num_seqs:
                break
            p = int(prompt[idx])
            if batch and tokens + p > limits.max_num_batched_tokens:
                break
            need = ceil_div(p, bs)
            if free_after - need < limits.watermark_blocks:
                break
            batch.append(idx)
            tokens += p
            sum_sq += p * p
            free_after -= need
        if batch:
            dt = latency.prefill_seconds(len(batch), tokens, sum_sq)
            if t + dt > stop_at:
                stopped = True
                break
            t += dt
            flops += latency.prefill_flops(tokens, sum_sq)
            useful += per_token * (sum(int(prompt[i]) for i in batch if fresh[i]) + len(batch))
            iterations += 1
            prefills += 1
            for idx in batch:
                waiting.popleft()
                generated[idx] += 1
                remaining[idx] -= 1
                if remaining[idx] == 0:
                    complete(idx)
                else:
                    running.append(idx)
                    stored[idx] = int(prompt[idx])
                    blocks[idx] = ceil_div(stored[idx], bs)
                    free -= blocks[idx]
            curve_t.append(t)
            curve_f.append(flops)
            curve_u.append(useful)
            continue

        if running:
            need = sum(1 for i in running if stored[i] % bs == 0)
            while need > free:
                victim = running.pop()
                free += blocks.pop(victim)
                if stored[victim] % bs == 0:
                    need -= 1
                prompt[victim] = stored.pop(victim) + 1
                fresh[victim] = False
                waiting.appendleft(victim)
                preemptions += 1
            if not running:
                continue
            attended = sum(stored[i] + 1 for i in running)
            dt = latency.decode_seconds(len(running), attended)
            if t + dt > stop_at:
                stopped = True
                break
            t += dt
            flops += latency.decode_flops(len(running), attended)
            useful += per_token * len(running)
            iterations += 1
            still = []
            for i in running:
                if stored[i] % bs == 0:
                    blocks[i] += 1
                    free -= 1
                stored[i] += 1
                generated[i] += 1
                remaining[i] -= 1
                if remaining[i] == 0:
                    free += blocks.pop(i)
                    del stored[i]
                    complete(i)
                else:
                    still.append(i)
            running = still
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
        if waiting:
            raise SchedulerDeadlock(
                f"request {waiting[0]} needs {ceil_div(int(prompt[waiting[0]]), bs)} KV blocks; "
                f"the replica has {limits.num_blocks}")
        break

    return SimResult(
        finish=finish, end_time=t, generated=generated,
        curve_t=np.asarray(curve_t), curve_flops=np.asarray(curve_f), curve_useful=np.asarray(curve_u),
        running=[(i, stored[i]) for i in running], waiting=list(waiting),
        iterations=iterations, prefills=prefills, preemptions=preemptions, stopped=stopped)
