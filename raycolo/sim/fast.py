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

It makes exactly the decisions of :mod:`raycolo.sim.reference` (tests check this).
"""
from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from raycolo.costmodel.latency import IterationLatency
from raycolo.sim.reference import SchedulerDeadlock
from raycolo.sim.types import ReplicaWorkload, SchedulerLimits, SimResult


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


def simulate(work: ReplicaWorkload, limits: SchedulerLimits, latency: IterationLatency,
             stop_at: float = math.inf) -> SimResult:
    bs = limits.block_size
    max_seqs = limits.max_num_seqs
    max_tokens = limits.max_num_batched_tokens
    watermark = limits.watermark_blocks
    alpha, beta = latency.alpha, latency.beta
    flops_n, flops_c = latency.flops_n, latency.flops_c

    prompt = work.prompt_len.tolist()
    remaining = work.remaining.tolist()
    successor = work.successor.tolist()
    size = len(prompt)
    finish = [math.inf] * size
    generated = [0] * size

    # running: idx -> (decode count at admission, stored tokens at admission, admission seq,
    #                  decode count at which it finishes)
    running: dict[int, tuple[int, int, int, int]] = {}
    finish_heap: list[tuple[int, int, int]] = []
    phase_count = [0] * bs
    n = 0            # running sequences
    attended_base = 0  # attended tokens at decode count G are attended_base + n * G
    g = 0            # decode iterations so far
    free = limits.num_blocks
    seq = 0

    for idx, stored in work.running:
        running[idx] = (0, stored, seq, remaining[idx])
        heapq.heappush(finish_heap, (remaining[idx], seq, idx))
        seq += 1
        phase_count[(-stored) % bs] += 1
        n += 1
        attended_base += stored + 1
        free -= -(-stored // bs)
    queued = set(running) | set(work.waiting_first)
    ready = work.ready
    # Requests ready at 0 join the queue at once, in index order (FCFS); later ones wait.
    at_start = [i for i in np.flatnonzero(ready <= 0.0).tolist() if i not in queued]
    waiting: deque[int] = deque(work.waiting_first + at_start)
    later = np.flatnonzero(np.isfinite(ready) & (ready > 0.0)).tolist()
    pending = [(float(ready[i]), i) for i in later if i not in queued]
    heapq.heapify(pending)
    prefill_base, prefill_c, prefill_per_token = (latency.prefill_base, latency.prefill_c,
                                                  latency.prefill_per_token)
    w_tok, w_sq = latency.weight_flops_per_token, latency.prefill_attn_flops_per_sq

    heappop, heappush = heapq.heappop, heapq.heappush
    fresh = work.fresh.tolist()
    t = flops = useful = 0.0
    curve_t, curve_f, curve_u = [0.0], [0.0], [0.0]
    iterations = prefills = preemptions = 0
    stopped = False

    def remove(idx: int) -> int:
        """Take ``idx`` out of the running batch; returns the tokens it had stored."""
        nonlocal n, attended_base, free
        g_adm, stored_adm = running.pop(idx)[:2]
        phase_count[(g_adm - stored_adm) % bs] -= 1
        n -= 1
        attended_base -= stored_adm + 1 - g_adm
        stored = stored_adm + g - g_adm
        free += -(-stored // bs)
        generated[idx] += g - g_adm
        return stored

    while True:
        while pending and pending[0][0] <= t:
            waiting.append(heapq.heappop(pending)[1])

        # Prefill: admit from the head of the queue while slots, tokens and blocks allow.
        if waiting and n < max_seqs:
            m = tokens = sum_sq = fresh_tokens = 0
            free_after = free
            for idx in waiting:
                if n + m >= max_seqs:
                    break
                p = prompt[idx]
                if m and tokens + p > max_tokens:
                    break
                need = -(-p // bs)
                if free_after - need < watermark:
                    break
                m += 1
                tokens += p
                sum_sq += p * p
                if fresh[idx]:
                    fresh_tokens += p
                free_after -= need
            if m:
                f = w_tok * tokens + w_sq * sum_sq  # = latency.prefill_flops, inlined
                dt = prefill_base[m] + prefill_c[m] * f + prefill_per_token * tokens
                if t + dt > stop_at:
                    stopped = True
                    break
                t += dt
                flops += f
                useful += w_tok * (fresh_tokens + m)
                iterations += 1
                prefills += 1
                for _ in range(m):
                    idx = waiting.popleft()
                    generated[idx] += 1
                    left = remaining[idx] - 1
                    if left == 0:
                        finish[idx] = t
                        if successor[idx] >= 0:
                            heapq.heappush(pending, (t, successor[idx]))
                        continue
                    p = prompt[idx]
                    running[idx] = (g, p, seq, g + left)
                    heapq.heappush(finish_heap, (g + left, seq, idx))
                    seq += 1
                    phase_count[(g - p) % bs] += 1
                    n += 1
                    attended_base += p + 1 - g
                    free -= -(-p // bs)
                curve_t.append(t)
                curve_f.append(flops)
                curve_u.append(useful)
                continue

        if n:
            while True:  # drop heap entries of preempted requests
                g_fin, s, idx = finish_heap[0]
                entry = running.get(idx)
                if entry is not None and entry[2] == s:
                    break
                heapq.heappop(finish_heap)
            k = g_fin - g

            # First decode iteration (relative) at which block demand exceeds free blocks.
            if free < n * (-(-k // bs)):
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
                    while need > free:
                        victim = next(reversed(running))
                        v_g_adm, v_stored_adm = running[victim][:2]
                        if (v_g_adm - v_stored_adm) % bs == base:
                            need -= 1
                        remaining[victim] = running[victim][3] - g
                        prompt[victim] = remove(victim) + 1
                        fresh[victim] = False
                        waiting.appendleft(victim)
                        preemptions += 1
                    if not n:
                        continue
                    k = 1  # the reference retries admission after this one iteration
                else:
                    k = min(k, shortage_at)

            c0 = attended_base + n * g
            a, b = alpha[n], beta[n]
            if not waiting and pending:
                k = min(k, _iterations_until(pending[0][0] - t, a, b, c0, n))
            if stop_at < math.inf:
                k = min(k, _iterations_within(stop_at - t, a, b, c0, n))
                if k == 0:
                    stopped = True
                    break

            attended = k * c0 + n * k * (k - 1) / 2  # summed over the k iterations
            t += k * a + b * attended
            flops += k * flops_n[n] + flops_c * attended
            useful += w_tok * n * k
            iterations += k
            cycles, rest = divmod(k, bs)
            used = n * cycles
            base = g % bs
            for offset in range(rest):
                used += phase_count[(base + offset) % bs]
            free -= used
            g += k
            while finish_heap and finish_heap[0][0] == g:
                _, s, idx = heappop(finish_heap)
                entry = running.get(idx)
                if entry is None or entry[2] != s:
                    continue
                # inlined remove(): this is the hottest loop of the planner
                del running[idx]
                g_adm, stored_adm = entry[0], entry[1]
                phase_count[(g_adm - stored_adm) % bs] -= 1
                n -= 1
                attended_base -= stored_adm + 1 - g_adm
                free += -(-(stored_adm + g - g_adm) // bs)
                generated[idx] += g - g_adm
                finish[idx] = t
                if successor[idx] >= 0:
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
                f"request {waiting[0]} needs {-(-prompt[waiting[0]] // bs)} KV blocks; "
                f"the replica has {limits.num_blocks}")
        break

    snapshot = []
    for idx, (g_adm, stored_adm, _, _) in running.items():
        generated[idx] += g - g_adm
        snapshot.append((idx, stored_adm + g - g_adm))
    return SimResult(
        finish=np.asarray(finish), end_time=t, generated=np.asarray(generated, dtype=np.int64),
        curve_t=np.asarray(curve_t), curve_flops=np.asarray(curve_f), curve_useful=np.asarray(curve_u),
        running=snapshot, waiting=list(waiting),
        iterations=iterations, prefills=prefills, preemptions=preemptions, stopped=stopped)
