"""One node's scheduling logic (LeMix Algorithms 2 and 3), with no clock and no Ray.

A node is S pipeline stages, one GPU each. :class:`NodeScheduler` decides what every
stage runs next; an executor (the simulator of :mod:`raycolo.online.simulation.sim`, or the live
node actor) runs it and reports back. Every entry point takes the executor's ``now`` and
returns a :class:`NodeStep`: the ops to start now and the timers to arm, in order, plus
what happened (observed op times, tokens out, finished requests, trained tasks). These
data types (``Op``, ``Timer``, ``NodeStep``, ``Request``, ``Stage``) live in
:mod:`raycolo.online.scheduling.node_types`.

* Inference: Algorithm 3 batches arriving requests (up to ``max_batch`` queries, within
  ``T_w = max_wait`` forward latencies of the first; a training task closes the batch)
  into a *prefill* op that walks the stages; its last stage emits each request's first
  token. Then *decode* ops, one iteration of every running request per op, walk the
  stages; one decode op is in flight per node (iteration-level batching). A request
  ends when the executor says its last token came out (EOS, a stop string, or the
  simulator's sampled length), and at the latest at its ``max_tokens``.
* Training: a *train_f* op walks the stages forward, then *train_b* walks them back from
  stage S-1 to 0; each stage keeps the task's activations between the two.
* SEPARATE's weight *sync* op runs on every stage of a serving node.

A stage runs one op at a time, oldest ready first, unless the policy's stage rule
(:mod:`raycolo.online.scheduling.stage_rules`: Harli, SIRIUS, MACE) orders or holds back its ready
ops. Memory is a ledger per stage: a
prefill reserves each request's KV for its prompt plus ``max_tokens`` (what a real
engine knows, not the decode length it will turn out to have) until the request ends; a
training forward holds its activations until its backward on that stage. Memory-aware
policies run Algorithm 2 before a forward that would pass the threshold: wait in steps
of Δt (a timer), and after ``T_max`` run it *offloaded* (its memory on the host). Other
policies run it anyway and mark it *overrun*. What offload and overrun cost is the
executor's business (the simulator adds a transfer time and a slowdown).

Where the profile gives the stages a paged KV pool (``kv_blocks``: a live deployment's),
a prefill also reserves each request's blocks for its prompt plus ``max_tokens`` on every
stage, whatever the policy: a prefill starts on stage 0 only with the requests whose
blocks are free (the rest wait as a prefill of their own, in order), and the blocks come
back when the request ends. A stage worker then never runs out of blocks.
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Collection, Optional

from raycolo.online.scheduling.batch_rule import BatchRule
from raycolo.online.scheduling.kv_ledger import KVLedger
from raycolo.online.scheduling.microbatches import MicroBatches
from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import NodeProfile
from raycolo.online.scheduling.node_types import (FORWARD_KINDS, NodeStep, Op, OpKind, Request, Stage, Timer,
                                                forward_holdings)
from raycolo.online.scheduling.stage_rules import TRAIN_KINDS, StageRule
from raycolo.online.tasks import OnlineTask, TaskKind

class NodeScheduler:
    """Algorithms 2 and 3 for one node; see the module docstring."""

    def __init__(self, index: int, profile: NodeProfile, params: LemixParams, memory_aware: bool,
                 rule: Optional[StageRule] = None):
        self.index = index
        self.rule = rule if rule is not None else StageRule()   # which ready op a stage runs
        self.profile = profile
        self.params = params
        self.memory_aware = memory_aware
        self.batching = BatchRule.of(params, profile)
        self.stages = [Stage() for _ in range(profile.stages)]
        self.batch: list[OnlineTask] = []
        self.batch_c = 0
        self.batch_token = 0         # invalidates a scheduled close of an earlier batch
        self.joining: list[Request] = []
        self.decode_inflight = False
        self.queued_ops = 0          # ops ready or running on any stage
        self.update_count = 0        # cluster training tasks reflected in the served weights
        self.syncing = 0             # sync ops left on this node's stages
        self.active = False
        self.first_start: Optional[float] = None
        self.last_end = 0.0
        self.memory_waits = self.offloads = self.overruns = 0
        self.aborts = 0              # training tasks aborted for a prefill's memory (SIRIUS)
        self.micro = MicroBatches(index, profile.stages)   # elastic micro-batches (SIRIUS)
        self.aborted_bytes = 0.0
        self.kv = KVLedger(profile.kv_blocks, profile.block_size)   # each stage's paged KV pool
        self.generation = 0          # resets so far
        self._seq = 0                # the number of the node's next op
        self.armed: dict[int, Timer] = {}   # timers armed and not fired, by number
        self._timers = 0
        self._out = NodeStep()
        self._now = 0.0

    # -- entry points ----------------------------------------------------------------------
    def dispatch(self, task: OnlineTask, now: float) -> NodeStep:
        """The task reaches this node."""
        self._begin(now)
        if task.is_train:
            if self.batch:
                self._close_batch(self.batch_token)
            mem = self.profile.train_bytes(task.batch, task.length)
            self._ready(self._op(OpKind.TRAIN_F, 0, [task], mem))
        else:
            self.kv.refuse_too_long(task)
            if not self.batch:
                self.batch_token += 1
                self._out.actions.append(Timer(self.batching.closes_at(now), self.index, "close_batch",
                                               token=self.batch_token, generation=self.generation))
            self.batch.append(task)
            self.batch_c += task.batch
            self._set_active()
            if self.batching.full(self.batch_c):
                self._close_batch(self.batch_token)
        return self._end()

    def timer(self, timer: Timer, now: float) -> NodeStep:
        """A timer this node armed fires."""
        self._begin(now)
        self.armed.pop(timer.number, None)
        if timer.generation != self.generation:
            return self._end()
        if timer.kind == "close_batch":
            self._close_batch(timer.token)
        elif timer.kind == "rule_wake":
            stage = self.stages[timer.stage]
            if stage.wake_at is not None and stage.wake_at <= timer.at_s:
                stage.wake_at = None    # (a live clock may fire it a hair early: the rule re-arms)
            self._try_start(timer.stage)
        elif timer.kind == "memory_retry":
            stage = self.stages[timer.stage]
            stage.retry_pending = False
            timer.op.waited_s += timer.step_s
            self._try_start(timer.stage)
        else:
            raise ValueError(f"unknown timer kind {timer.kind!r}")
        return self._end()

    def sync(self, version: int, now: float) -> NodeStep:
        """SEPARATE: weights of ``version`` training tasks arrive; every stage loads them."""
        self._begin(now)
        self.syncing = len(self.stages)
        for s in range(len(self.stages)):
            self._ready(self._op(OpKind.SYNC, s, [], version=version))
        return self._end()

    def op_done(self, op: Op, now: float, finished: Collection[int] = ()) -> NodeStep:
        """``op`` ended on its stage. ``finished``: ids of requests whose token from this op
        (a last-stage prefill or decode) was their last; ``max_tokens`` ends one anyway."""
        self._begin(now)
        s = op.stage
        stage = self.stages[s]
        if stage.busy is not op:
            raise ValueError(f"node {self.index} stage {s}: {op.kind} op was not running")
        stage.busy = None
        stage.busy_s += now - op.start_s
        if op.kind in TRAIN_KINDS:
            stage.train_busy_s += now - op.start_s
        self.queued_ops -= 1
        self.last_end = now
        last = s == len(self.stages) - 1
        kv_before = self.kv.reserved
        if op.kind == OpKind.PREFILL:
            for r in op.tasks:
                self._out.observed.append((r.task_id, s, "forward", op.start_s, now))
            if not last:
                self._ready(self._op(OpKind.PREFILL, s + 1, op.tasks, op.mem_bytes, after=op))
            else:
                for r in op.tasks:
                    self._token_out(r, finished)
                self._decode_next()
        elif op.kind == OpKind.TRAIN_F:
            task = op.tasks[0]
            self._out.observed.append((self.micro.root_of(task).task_id, s, "forward", op.start_s, now))
            nxt = self._op(OpKind.TRAIN_F, s + 1, op.tasks, op.mem_bytes, after=op) if not last else \
                self._op(OpKind.TRAIN_B, s, op.tasks, op.mem_bytes)
            self._ready(nxt)
        elif op.kind == OpKind.TRAIN_B:
            task = op.tasks[0]
            self._out.observed.append((self.micro.root_of(task).task_id, s, "backward", op.start_s, now))
            stage.release((TaskKind.TRAIN, task.task_id))
            root = self.micro.backward_done(task, s)
            if s > 0:
                self._ready(self._op(OpKind.TRAIN_B, s - 1, op.tasks, op.mem_bytes, after=op))
            elif root is not None:
                self._out.trained.append(root)
        elif op.kind == OpKind.DECODE:
            if not last:
                self._ready(self._op(OpKind.DECODE, s + 1, op.tasks, after=op))
            else:
                self.decode_inflight = False
                for r in op.tasks:
                    r.context += 1
                    self._token_out(r, finished)
                self._decode_next()
        elif op.kind == OpKind.SYNC:
            self.syncing -= 1
            if self.syncing == 0:
                self.update_count = op.version
                self._out.synced = op.version
        self._try_start(s)
        if self.rule.holds:       # a held op may fit now that this one ended
            for other in range(len(self.stages)):
                if other != s:
                    self._try_start(other)
        elif s != 0 and self.kv.reserved < kv_before:   # a prefill waiting for KV blocks may fit now
            self._try_start(0)
        self._maybe_idle()
        return self._end()

    def reset(self, now: float) -> NodeStep:
        """The node's executor lost its state (its stage workers restarted: KV caches,
        activations and ops in flight are gone). Every op ready or running is dropped, the
        memory ledger is emptied, timers armed so far are void, and the work that was on
        the node comes back in ``lost``: each unfinished inference :class:`Request` (its
        ``generated`` tokens are already out) and each training task whose backward had
        not reached stage 0. The executor must not report the dropped ops' completion."""
        self._begin(now)
        lost: dict[int, object] = {}
        for r in self.joining:
            lost[r.task_id] = r
        for t in self.batch:
            lost[t.task_id] = Request(t, t.length)
        for stage in self.stages:
            ops = [op for _, _, op in stage.ready] + ([stage.busy] if stage.busy else [])
            for op in sorted(ops, key=lambda o: o.seq):
                for x in op.tasks:
                    lost.setdefault(x.task_id, x)
            if stage.busy is not None:
                stage.busy_s += now - stage.busy.start_s
            stage.ready, stage.busy, stage.held, stage.used_bytes = [], None, {}, 0.0
            stage.retry_pending, stage.wake_at = False, None
        self.kv.clear(lost.values())
        self._out.lost = sorted(self.micro.lost(list(lost.values())), key=lambda x: x.task_id)
        self.batch, self.batch_c, self.joining = [], 0, []
        self.decode_inflight = False
        self.queued_ops = self.syncing = 0
        self.generation += 1
        self.armed.clear()              # they fire void (their generation is old)
        self.last_end = max(self.last_end, now)
        self._maybe_idle()
        return self._end()

    # -- reading ---------------------------------------------------------------------------
    def busy_seconds(self, now: float) -> float:
        """Seconds the stages have been busy, counting ops in flight up to ``now``."""
        return sum(st.busy_s + (now - st.busy.start_s if st.busy else 0.0) for st in self.stages)

    # -- internals -------------------------------------------------------------------------
    def _begin(self, now: float) -> None:
        self._now = now
        self._out = NodeStep()

    def _end(self) -> NodeStep:
        out, self._out = self._out, NodeStep()
        for action in out.actions:        # timers get their numbers in the order armed
            if type(action) is Timer:
                action.number = self._timers
                self._timers += 1
                self.armed[action.number] = action
        return out

    def _op(self, kind: str, stage: int, tasks: list, mem: float = 0.0, after: Optional[Op] = None,
            version: Optional[int] = None) -> Op:
        self._seq += 1
        return Op(kind, self.index, stage, self._now, self._seq - 1, tasks, mem,
                  after=None if after is None else after.seq, generation=self.generation, version=version)

    def _close_batch(self, token: int) -> None:
        if token != self.batch_token or not self.batch:
            return
        tasks, self.batch, self.batch_c = self.batch, [], 0
        self.batch_token += 1
        requests = [Request(t, t.length) for t in tasks]
        for r in requests:
            r.kv_bytes = self.profile.inference_bytes(r.task.batch, r.task.length + r.task.token_budget)
        self._ready(self._op(OpKind.PREFILL, 0, requests, sum(r.kv_bytes for r in requests)))

    def _ready(self, op: Op) -> None:
        heapq.heappush(self.stages[op.stage].ready, (op.ready_s, op.seq, op))
        self.queued_ops += 1
        self._set_active()
        self._try_start(op.stage)

    def _try_start(self, s: int) -> None:
        stage = self.stages[s]
        if stage.busy is not None or not stage.ready:
            return
        capacity = self.profile.free_bytes
        limit = self.params.memory_threshold * capacity
        chosen, blocked = None, False
        for op in self.rule.order(self, s, [item[2] for item in stage.ready], self._now):
            if op.kind == OpKind.PREFILL and s == 0:     # it starts with the requests whose KV blocks are free
                fits = self.kv.fitting(op.tasks)
                if fits == 0:
                    continue      # it waits for blocks; the ops behind it need none
                if fits < len(op.tasks):     # the rest wait, in order, as a prefill of their own
                    op.tasks, rest = op.tasks[:fits], op.tasks[fits:]
                    op.mem_bytes = sum(r.kv_bytes for r in op.tasks)
                    later = self._op(OpKind.PREFILL, 0, rest, sum(r.kv_bytes for r in rest))
                    heapq.heappush(stage.ready, (later.ready_s, later.seq, later))   # queued: op may start now
                    self.queued_ops += 1
            if op.kind not in FORWARD_KINDS or op.offloaded or op.mem_bytes == 0:
                chosen = op
                break
            if blocked:
                continue  # forwards keep their order behind a waiting forward
            if not self.memory_aware or self.rule.fits(stage, op, limit):
                chosen = op
                break
            if op.kind == OpKind.PREFILL and self.rule.reclaims and \
                    self._reclaim(s, stage.used_bytes + op.mem_bytes - limit):
                chosen = op
                break
            if op.kind == OpKind.TRAIN_F and s == 0 and self.rule.elastic and self._shrink(stage, op, limit):
                chosen = op
                break
            if op.waited_s >= self.params.max_memory_wait * self.profile.forward_latency_s:
                op.offloaded = True  # Algorithm 2 line 10: give the stage its memory back
                self.offloads += 1
                chosen = op
                break
            blocked = True
            if not stage.retry_pending:
                stage.retry_pending = True
                step = self.params.check_interval * self.profile.forward_latency_s
                self.memory_waits += 1
                self._out.actions.append(Timer(self._now + step, self.index, "memory_retry",
                                               stage=s, op=op, step_s=step, generation=self.generation))
        if chosen is None:
            if not blocked and self.rule.holds:
                wake = rule_wake_timer(self, s, self._now)
                if wake is not None:
                    stage.wake_at = wake.at_s
                    self._out.actions.append(wake)
            return
        self.rule.started(s, chosen)
        stage.ready.remove((chosen.ready_s, chosen.seq, chosen))
        heapq.heapify(stage.ready)
        chosen.start_s = self._now
        if chosen.kind == OpKind.PREFILL and s == 0:
            self.kv.reserve(chosen.tasks)
        if chosen.kind in FORWARD_KINDS and not chosen.offloaded:
            if stage.used_bytes + chosen.mem_bytes > capacity:
                self.overruns += 1
                chosen.overrun = True
            for key, size in forward_holdings(chosen):
                stage.held[key] = size
                stage.used_bytes += size
        if chosen.kind == OpKind.TRAIN_F and s == 0:
            self.micro.forward_started(chosen.tasks[0])
        if chosen.kind == OpKind.TRAIN_B:
            chosen.step = self.micro.steps(chosen.tasks[0], s)
            if (TaskKind.TRAIN, chosen.tasks[0].task_id) not in stage.held:
                chosen.reload = True
        stage.busy = chosen
        self.first_start = self._now if self.first_start is None else self.first_start
        self._out.actions.append(chosen)

    def _shrink(self, stage: Stage, op: Op, limit: float) -> bool:
        """SIRIUS: the first forward ``op`` of a training task does not fit; start the
        largest micro-batch of its samples that does, and leave the rest waiting as another
        micro-batch (:mod:`raycolo.online.scheduling.microbatches`). False: not even one sample fits."""
        task = op.tasks[0]
        for samples in range(task.batch - 1, 0, -1):
            mem = self.profile.train_bytes(samples, task.length)
            if self.rule.fits(stage, replace(op, mem_bytes=mem), limit):
                break
        else:
            return False
        now_piece, rest = self.micro.split(task, samples)
        op.tasks, op.mem_bytes = [now_piece], mem
        later = self._op(OpKind.TRAIN_F, 0, [rest], self.profile.train_bytes(rest.batch, rest.length))
        heapq.heappush(stage.ready, (later.ready_s, later.seq, later))   # queued: the stage starts op now
        self.queued_ops += 1
        return True

    def _reclaim(self, s: int, need: float) -> bool:
        """SIRIUS: free ``need`` bytes on stage ``s`` by aborting training tasks that wait
        for their first backward (their forward is done on every stage, nothing of theirs
        runs or travels between stages), largest first; each runs again from its first
        forward. True when enough was freed (nothing is aborted otherwise)."""
        last = self.stages[-1]
        waiting = [op for _, _, op in last.ready if op.kind == OpKind.TRAIN_B]
        held = self.stages[s].held
        victims, freed = [], 0.0
        for op in sorted(waiting, key=lambda o: -held.get((TaskKind.TRAIN, o.tasks[0].task_id), 0.0)):
            if freed >= need:
                break
            size = held.get((TaskKind.TRAIN, op.tasks[0].task_id), 0.0)
            if size > 0:
                victims.append(op)
                freed += size
        if freed < need:
            return False
        for op in victims:
            task = op.tasks[0]
            last.ready.remove((op.ready_s, op.seq, op))
            self.queued_ops -= 1
            for stage in self.stages:
                self.aborted_bytes += stage.held.get((TaskKind.TRAIN, task.task_id), 0.0)
                stage.release((TaskKind.TRAIN, task.task_id))
            self.aborts += 1
            self._out.aborted.append(task.task_id)
            # queued, not started: the stage that called this is about to start the prefill
            self.micro.restarted(task)
            retry = self._op(OpKind.TRAIN_F, 0, [task], op.mem_bytes)
            heapq.heappush(self.stages[0].ready, (retry.ready_s, retry.seq, retry))
            self.queued_ops += 1
        heapq.heapify(last.ready)
        return True

    def _decode_next(self) -> None:
        if self.decode_inflight or not self.joining:
            return
        running, self.joining = self.joining, []
        self.decode_inflight = True
        self._ready(self._op(OpKind.DECODE, 0, running))

    def _token_out(self, r: Request, finished: Collection[int]) -> None:
        """A request's token left the last stage: it ends, or joins the next decode."""
        r.generated += 1
        self._out.tokens.append(r)
        if r.task_id in finished or r.generated >= r.task.token_budget:
            for stage in self.stages:
                stage.release((TaskKind.INFERENCE, r.task_id))
            self.kv.release(r)
            self._out.finished.append(r)
        else:
            self.joining.append(r)

    def _set_active(self) -> None:
        if not self.active:
            self.active = True
            self._out.activated = True

    def _maybe_idle(self) -> None:
        if self.active and self.queued_ops == 0 and not self.batch and not self.joining \
                and not self.decode_inflight:
            self.active = False
            self._out.idle = True

    def check_released(self) -> None:
        """Every byte held was released: memory is conserved (call after a run)."""
        if self.kv.reserved:
            raise RuntimeError(f"node {self.index}: {self.kv.reserved} KV blocks left reserved after the run")
        for s, stage in enumerate(self.stages):
            if stage.held or abs(stage.used_bytes) > 1.0:
                raise RuntimeError(f"node {self.index} stage {s}: memory left held after the run: "
                                   f"{len(stage.held)} tasks, {stage.used_bytes:.0f} bytes")


def rule_wake_timer(node: NodeScheduler, s: int, now: float) -> Optional[Timer]:
    """The rule held back every ready op of stage ``s``: the timer that looks again when
    it says (None: no time, or not later than ``now``, or a wake already armed no later)."""
    stage = node.stages[s]
    at = node.rule.wake_at(node, s, now)
    if at is None or at <= now or (stage.wake_at is not None and stage.wake_at <= at):
        return None
    return Timer(at, node.index, "rule_wake", stage=s, generation=node.generation)
