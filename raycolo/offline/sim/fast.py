"""Event-driven continuous-batching simulator.

Between events the running batch only grows by one token per sequence per decode
iteration, so a run of ``K`` decode iterations costs, in closed form,
``K*alpha + beta*(K*C0 + n*K*(K-1)/2)`` seconds (``C0`` = attended tokens at its start).
The loop therefore advances straight to the next event:

* the next request finish (a heap keyed by the decode-iteration count it finishes at);
* the next KV-block shortage (block demand grows with a period of ``block_size``
  iterations; requests are counted by the phase at which they need a new block);
* the next arrival, when the waiting queue is empty (ready time solved from the quadratic);
* the stop time, when a snapshot is wanted.

It makes exactly the decisions of :mod:`raycolo.offline.sim.reference` (tests check this).

The planner runs it thousands of times per plan, so the loop is lean: requests finishing
at the same decode count share one heap entry, ``generated`` and the iteration count are
derived at the end, where the KV blocks can never bind (a full batch of the longest
requests fits) the block books are not kept, and once nothing can join the batch any
more :func:`_drain` runs it to its end without the queue and block bookkeeping. None of
this changes a result by a bit (tests compare with the plain event loop).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import islice
from typing import Optional

import numpy as np

from raycolo.offline.costmodel.latency import IterationLatency
from raycolo.offline.sim.reference import SchedulerDeadlock
from raycolo.offline.sim.types import ReplicaWorkload, SimResult
from raycolo.batching.limits import SchedulerLimits


def _run_seconds(k: int, alpha: float, beta: float, c0: int, n: int) -> float:
    return k * alpha + beta * (k * c0 + n * k * (k - 1) / 2)


def _iterations_until(delta: float, alpha: float, beta: float, c0: int, n: int) -> int:
    """Smallest k >= 1 whose run of k iterations lasts at least ``delta`` seconds."""
    lin = alpha + beta * (c0 - n / 2)
    quad = beta * n / 2
    if quad > 0:
        k = math.ceil((-lin + math.sqrt(max(lin * lin + 4 * quad * delta, 0.0))) / (2 * quad))
    else:
        k = math.ceil(delta / lin) if lin > 0 else 1
    k = max(1, k)
    while k > 1 and _run_seconds(k - 1, alpha, beta, c0, n) >= delta:
        k -= 1
    while _run_seconds(k, alpha, beta, c0, n) < delta:
        k += 1
    return k


def _iterations_within(budget: float, alpha: float, beta: float, c0: int, n: int) -> int:
    """Largest k >= 0 whose run of k iterations ends within ``budget`` seconds."""
    if _run_seconds(1, alpha, beta, c0, n) > budget:
        return 0
    k = _iterations_until(budget, alpha, beta, c0, n)
    return k if _run_seconds(k, alpha, beta, c0, n) <= budget else k - 1


def _drain(running: dict[int, tuple[int, int, int]], ending: dict[int, list[int]], g: int, n: int,
           s0_sum: int, free: int, bs: int, latency: IterationLatency,
           clock: tuple[float, float, float], finish: list[float], curves: tuple[list, list, list]
           ) -> Optional[tuple[float, float, float, int]]:
    """Run the batch to its end when nothing can join it any more (the event loop's state).

    None (and nothing done) unless the free KV blocks cover every running request's growth
    to its end. Then no shortage can cut a decode run, so the runs end exactly at the
    finish decode counts: the decode step of :func:`simulate` without the queue, block and
    stop bookkeeping, the same arithmetic in the same order. Returns (t, flops, useful, g)
    at the end; fills ``finish`` and extends ``curves``.
    """
    growth = n * -(-(max(ending) - g) // bs)  # at most; exactly, if that is too many:
    if growth > free and sum((s0 + g_fin + bs - 1) // bs - (s0 + g + bs - 1) // bs
                             for s0, _, g_fin in running.values()) > free:
        return None
    alpha, beta, flops_n, flops_c = latency.alpha, latency.beta, latency.flops_n, latency.flops_c
    w_tok = latency.weight_flops_per_token
    t, flops, useful = clock
    curve_t, curve_f, curve_u = curves
    for end in sorted(ending):
        k = end - g
        c0 = s0_sum + n * (g + 1)
        a, b = alpha[n], beta[n]
        attended = k * c0 + n * k * (k - 1) / 2
        t += k * a + b * attended
        flops += k * flops_n[n] + flops_c * attended
        useful += w_tok * n * k
        g = end
        done = ending[end]
        n -= len(done)
        for idx in done:
            s0_sum -= running[idx][0]
            finish[idx] = t
        curve_t.append(t)
        curve_f.append(flops)
        curve_u.append(useful)
    return t, flops, useful, g


def simulate(work: ReplicaWorkload, limits: SchedulerLimits, latency: IterationLatency,
             stop_at: float = math.inf, shortcuts: bool = True) -> SimResult:
    """Simulate one replica from its start (``stop_at``: stop there, keeping the queues).

    ``shortcuts=False``: keep the block books and step every event to the end, for the
    tests that check the shortcuts change nothing.
    """
    bs = limits.block_size
    max_seqs = limits.max_num_seqs
    max_tokens = limits.max_num_batched_tokens
    watermark = limits.watermark_blocks
    alpha, beta = latency.alpha, latency.beta
    flops_n, flops_c = latency.flops_n, latency.flops_c
    prefill_base, prefill_c, prefill_per_token = (latency.prefill_base, latency.prefill_c,
                                                  latency.prefill_per_token)
    w_tok, w_sq = latency.weight_flops_per_token, latency.prefill_attn_flops_per_sq
    heappop, heappush = heapq.heappop, heapq.heappush
    stoppable = stop_at < math.inf

    prompt = work.prompt_len.tolist()
    blocks = ((work.prompt_len + (bs - 1)) // bs).tolist()  # KV blocks of each prompt
    # tokens left to generate as of the request's last admission (its finish decode count
    # is set then); ``generated`` is derived from it at the end
    remaining = work.remaining.tolist()
    successor = work.successor.tolist()
    chained = len(successor) > 0 and work.successor.max() >= 0
    fresh = work.fresh.tolist()
    finish = [math.inf] * len(prompt)

    # running: idx -> (s0, block phase, decode count at which it finishes), in admission
    # order. A request admitted at decode count g_adm with s stored tokens has s0 = s - g_adm:
    # at decode count G it has stored s0 + G tokens, attends s0 + G + 1 and needs a new KV
    # block when (G - phase) % bs == 0, phase = -s0 % bs. The batch attends
    # s0_sum + n * (G + 1) tokens.
    running: dict[int, tuple[int, int, int]] = {}
    ending: dict[int, list[int]] = {}  # decode count -> requests finishing there, admission order
    phase_count = [0] * bs
    n = s0_sum = 0   # running sequences, sum of their s0
    g = 0            # decode iterations so far
    free = limits.num_blocks

    for idx, stored in work.running:  # at decode count 0: s0 = stored
        phase = -stored % bs
        running[idx] = (stored, phase, remaining[idx])
        ending.setdefault(remaining[idx], []).append(idx)
        phase_count[phase] += 1
        n += 1
        s0_sum += stored
        free -= -(-stored // bs)
    finish_at = list(ending)  # a heap of ending's keys
    heapq.heapify(finish_at)
    # Whether KV blocks never bind: a full batch of the longest requests fits. Then no
    # admission waits for blocks and no decode run is cut, and the block books (``free``,
    # ``room``) are not kept.
    longest = int(((work.prompt_len + work.remaining + bs - 1) // bs).max(initial=0))
    for idx, stored in work.running:
        longest = max(longest, -(-(stored + remaining[idx]) // bs))
    roomy = shortcuts and min(max_seqs, len(prompt)) * longest <= limits.num_blocks - watermark
    queued = set(running) | set(work.waiting_first)
    ready = work.ready
    # Requests ready at 0 join the queue at once, in index order (FCFS); later ones wait.
    at_start = np.flatnonzero(ready <= 0.0).tolist()
    if queued:
        at_start = [i for i in at_start if i not in queued]
    waiting: deque[int] = deque(work.waiting_first + at_start)
    later = np.flatnonzero(np.isfinite(ready) & (ready > 0.0)).tolist()
    pending = [(float(ready[i]), i) for i in later if i not in queued]
    heapq.heapify(pending)

    t = flops = useful = 0.0
    curve_t, curve_f, curve_u = [0.0], [0.0], [0.0]
    prefills = preemptions = 0
    stopped = False
    # try _drain when the batch is no larger than this (halved after a try that fails); not
    # where finishes release successors, nor when the run may stop
    drain_below = max_seqs if shortcuts and not stoppable and not chained else 0

    while True:
        while pending and pending[0][0] <= t:
            waiting.append(heappop(pending)[1])

        # Prefill: admit from the head of the queue while slots, tokens and blocks allow.
        if waiting and n < max_seqs:
            m = tokens = sum_sq = fresh_tokens = 0
            room = free - watermark  # blocks the admitted prompts may take
            for idx in islice(waiting, max_seqs - n):
                p = prompt[idx]
                if m and tokens + p > max_tokens:
                    break
                if not roomy:
                    need = blocks[idx]
                    if need > room:
                        break
                    room -= need
                m += 1
                tokens += p
                sum_sq += p * p
                if fresh[idx]:
                    fresh_tokens += p
            if m:
                f = w_tok * tokens + w_sq * sum_sq  # = latency.prefill_flops, inlined
                dt = prefill_base[m] + prefill_c[m] * f + prefill_per_token * tokens
                if t + dt > stop_at:
                    stopped = True
                    break
                t += dt
                flops += f
                useful += w_tok * (fresh_tokens + m)
                prefills += 1
                # all m join the batch (undone below for a request done at its first token)
                n += m
                s0_sum += tokens - m * g
                free = room + watermark
                for _ in range(m):
                    idx = waiting.popleft()
                    left = remaining[idx] - 1
                    if left == 0:
                        finish[idx] = t
                        n -= 1
                        s0_sum -= prompt[idx] - g
                        free += blocks[idx]
                        if chained and successor[idx] >= 0:
                            heappush(pending, (t, successor[idx]))
                        continue
                    s0 = prompt[idx] - g
                    phase = -s0 % bs
                    g_fin = g + left
                    running[idx] = (s0, phase, g_fin)
                    bucket = ending.get(g_fin)
                    if bucket is None:
                        ending[g_fin] = [idx]
                        heappush(finish_at, g_fin)
                    else:
                        bucket.append(idx)
                    phase_count[phase] += 1
                curve_t.append(t)
                curve_f.append(flops)
                curve_u.append(useful)
                continue

        if n:
            if n <= drain_below and not waiting and not pending:
                drained = _drain(running, ending, g, n, s0_sum, math.inf if roomy else free, bs,
                                 latency, (t, flops, useful),
                                 finish, (curve_t, curve_f, curve_u))
                if drained is not None:
                    t, flops, useful, g = drained
                    running.clear()
                    break
                drain_below = n // 2
            k = finish_at[0] - g

            # First decode iteration (relative) at which block demand exceeds free blocks.
            if not roomy and free < n * (-(-k // bs)):
                cycles = free // n
                budget = free - cycles * n
                offset, acc, base = 0, 0, g % bs
                while True:
                    acc += phase_count[(base + offset) % bs]
                    if acc > budget:
                        break
                    offset += 1
                shortage_at = cycles * bs + offset
                if shortage_at == 0:
                    need = phase_count[base]
                    while need > free:  # preempt the latest admitted, back to the queue head
                        victim = next(reversed(running))
                        s0, phase, g_fin = running.pop(victim)
                        if phase == base:
                            need -= 1
                        bucket = ending[g_fin]
                        bucket.remove(victim)
                        if not bucket:
                            del ending[g_fin]
                            finish_at.remove(g_fin)
                            heapq.heapify(finish_at)
                        phase_count[phase] -= 1
                        n -= 1
                        s0_sum -= s0
                        stored = s0 + g
                        free += -(-stored // bs)
                        remaining[victim] = g_fin - g
                        prompt[victim] = stored + 1
                        blocks[victim] = -(-(stored + 1) // bs)
                        fresh[victim] = False
                        waiting.appendleft(victim)
                        preemptions += 1
                    if not n:
                        continue
                    k = 1  # the reference retries admission after this one iteration
                else:
                    k = min(k, shortage_at)

            c0 = s0_sum + n * (g + 1)  # attended tokens at the first of the k iterations
            a, b = alpha[n], beta[n]
            if not waiting and pending:
                k = min(k, _iterations_until(pending[0][0] - t, a, b, c0, n))
            if stoppable and _run_seconds(k, a, b, c0, n) > stop_at - t:
                # (the run time grows with k: a run that fits needs no search)
                k = min(k, _iterations_within(stop_at - t, a, b, c0, n))
                if k == 0:
                    stopped = True
                    break

            attended = k * c0 + n * k * (k - 1) / 2  # summed over the k iterations
            t += k * a + b * attended
            flops += k * flops_n[n] + flops_c * attended
            useful += w_tok * n * k
            if not roomy:
                # KV blocks the k iterations take: n per full cycle of bs, plus the phases
                # met in the partial cycle
                cycles, rest = divmod(k, bs)
                used = n * cycles
                if rest:
                    base = g % bs
                    end = base + rest
                    if end <= bs:
                        used += sum(phase_count[base:end])
                    else:
                        used += sum(phase_count[base:]) + sum(phase_count[:end - bs])
                free -= used
            g += k
            if finish_at[0] == g:
                heappop(finish_at)
                done = ending.pop(g)
                n -= len(done)
                g_up = g + bs - 1  # blocks of x tokens: (x + bs - 1) // bs
                for idx in done:  # the hottest loop of the planner
                    s0, phase, _ = running.pop(idx)
                    phase_count[phase] -= 1
                    s0_sum -= s0
                    free += (s0 + g_up) // bs
                    finish[idx] = t
                    if chained and successor[idx] >= 0:
                        heappush(pending, (t, successor[idx]))
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
                f"request {waiting[0]} needs {blocks[waiting[0]]} KV blocks; "
                f"the replica has {limits.num_blocks}")
        break

    snapshot = []
    for idx, (s0, _, g_fin) in running.items():
        snapshot.append((idx, s0 + g))
        remaining[idx] = g_fin - g
    finish_arr = np.asarray(finish)
    left = np.asarray(remaining, dtype=np.int64)
    left[np.isfinite(finish_arr)] = 0
    return SimResult(
        finish=finish_arr, end_time=t, generated=work.remaining - left,
        curve_t=np.asarray(curve_t), curve_flops=np.asarray(curve_f), curve_useful=np.asarray(curve_u),
        running=snapshot, waiting=list(waiting),
        iterations=prefills + g, prefills=prefills, preemptions=preemptions, stopped=stopped)
