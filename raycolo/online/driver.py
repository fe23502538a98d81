"""An asyncio executor of a :class:`~raycolo.online.scheduling.cluster.Cluster`: the live runtime's core.

The simulator (:mod:`raycolo.online.simulation.sim`) carries out a cluster's steps on an event heap
with op durations from a profile. :class:`ClusterDriver` carries out the same steps on
an asyncio event loop, whose clock is the executor's clock: it arms timers with
``loop.call_at``, sends decided tasks to their nodes, and starts every op as a task that
awaits an :class:`OpRunner` (live: the node's stage workers; in tests: a runner that
sleeps an op's profiled duration on a fake-time loop). Nothing in it knows which.

With a :class:`NodeLink` the nodes run as loops of their own (live: in their first
stage's process, :mod:`raycolo.online.scheduling.node_loop`) and the cluster's nodes are their
mirrors: the driver sends each node what the cluster wants of it (a task placed there,
SEPARATE's weight sync) through the link, never starts a node's ops or arms its timers,
and takes the node's events in with :meth:`ClusterDriver.absorb` as the node reports
them, checking that the mirror does what the node did.

Time is seconds since :meth:`ClusterDriver.start`. No Ray import: the controller actor
wraps this class.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable, Optional, Protocol

from raycolo.online.scheduling.cluster import Cluster, ClusterStep
from raycolo.online.scheduling.node_types import Op, Timer
from raycolo.online.scheduling.node_events import NodeEvent, OpResult, check_in_step
from raycolo.online.scheduling.scheduler import RECENT_DECISIONS, Decision
from raycolo.online.tasks import OnlineTask


class OpLost(Exception):
    """The op's node lost its state (its stage workers restarted) before the op's result
    was taken in: the node scheduler already dropped the op and placed its tasks again."""


class OpRunner(Protocol):
    async def run(self, op: Op) -> OpResult:
        """Execute ``op`` on its stage; return what came of it: the ids of requests whose
        token from it (a last-stage prefill or decode) was their last, and a training
        forward's loss where one is measured. Raises :class:`OpLost` if the op's node was
        reset (:meth:`ClusterDriver.node_lost`) meanwhile."""


class NodeLink(Protocol):
    def command(self, n: int, event: NodeEvent) -> None:
        """Have node ``n``'s loop apply ``event`` (Dispatched, Synced) at its own time."""


class ClusterDriver:
    def __init__(self, cluster: Cluster, runner: Optional[OpRunner], query_cost_s: float = 0.0,
                 retry_every_s: Optional[float] = None,
                 on_failed: Optional[Callable[[OnlineTask], None]] = None,
                 on_aborted: Optional[Callable[[list], None]] = None,
                 on_error: Optional[Callable[[BaseException], None]] = None,
                 link: Optional[NodeLink] = None):
        self.cluster = cluster
        self.runner = runner
        self.link = link                   # the nodes run as loops of their own (module docstring)
        cluster.mirrored = link is not None
        self.query_cost_s = query_cost_s   # a simulated decision cost; live: 0 (it is real)
        # Live: while training tasks are held back, retry them at least this often even if
        # nothing arrives or finishes (a simulator needs no tick: its trace ends).
        self.retry_every_s = retry_every_s
        self.on_failed = on_failed      # told of each task no node can run any more
        self.on_aborted = on_aborted    # told of (node, task id) training aborts (SIRIUS)
        self.on_error = on_error        # told once when an op fails and the run stops
        self._tick_armed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._t0 = 0.0
        self._inflight: set[asyncio.Task] = set()
        self._expected = 0
        self._done = asyncio.Event()
        self.error: Optional[BaseException] = None
        # CPU seconds spent in cluster callbacks (policy, cluster and node schedulers): the
        # live decision overhead, per event and in total (measured, never simulated).
        self.scheduling_s: deque = deque(maxlen=RECENT_DECISIONS)
        self.scheduling_total_s = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()

    def now(self) -> float:
        return self._loop.time() - self._t0

    # -- entry points ----------------------------------------------------------------------
    def submit(self, task: OnlineTask, last: bool = False) -> None:
        """A task arrives now."""
        self._expected += 1
        self._step(self.cluster.arrive, task, self.now(), last)

    def node_lost(self, n: int, back_after_s: Optional[float] = None) -> None:
        """Node ``n``'s executor lost its state now (a worker-group restart): its ops in
        flight are void (their runners raise :class:`OpLost`), its unfinished tasks are
        placed again, and nothing new goes there until :meth:`node_back` (a live executor
        calls it once the new group is complete; ``back_after_s`` calls it after that
        long, a restart's modelled duration; 0: back at once)."""
        self._step(self.cluster.node_lost, n, self.now(), restarting=back_after_s != 0)
        if back_after_s:
            self._loop.call_later(back_after_s, self.node_back, n)

    def node_back(self, n: int) -> None:
        """Node ``n``'s executor is back after :meth:`node_lost`: it takes work again."""
        self._step(self.cluster.node_back, n, self.now())

    def node_down(self, n: int) -> None:
        """Node ``n`` is gone for good: as :meth:`node_lost`, and nothing goes there again."""
        self._step(self.cluster.node_down, n, self.now())

    def absorb(self, n: int, event: NodeEvent, keys: list) -> None:
        """Node ``n``'s loop applied ``event`` and started the ops and armed the timers
        named ``keys`` (:func:`~raycolo.online.scheduling.node_events.action_key`): its mirror applies
        it too (raises :class:`~raycolo.online.scheduling.node_events.MirrorDiverged` where the two
        part)."""
        def checked() -> ClusterStep:
            step = self.cluster.apply(n, event)
            check_in_step(n, event, keys, step.actions)
            return step

        self._step(checked)

    async def replay(self, tasks: list[OnlineTask]) -> None:
        """Submit ``tasks`` at their arrival times, then wait until every one completed."""
        if self._loop is None:
            self.start()
        ordered = sorted(tasks, key=lambda t: (t.arrival_s, t.task_id))
        for i, task in enumerate(ordered):
            delay = task.arrival_s - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            self.submit(task, last=i == len(ordered) - 1)
        await self.drain()

    async def drain(self) -> None:
        """Wait until every submitted task completed (or an op failed: re-raised). No more
        arrivals are expected meanwhile, so held-back training tasks are released."""
        if self.cluster.scheduler.deferred and not self.cluster.scheduler.arrivals_done:
            self._step(self.cluster.retry, self.now(), end_of_arrivals=True)
        while not self._all_done():
            self._done.clear()
            await self._done.wait()
        if self.error is not None:
            raise self.error

    # -- internals -------------------------------------------------------------------------
    def _all_done(self) -> bool:
        metrics = self.cluster.metrics
        return self.error is not None or metrics.completed + len(metrics.failed) >= self._expected

    def _step(self, call, *args, **kwargs) -> None:
        """Run one cluster callback (the controller's and the node schedulers' work for an
        event), time it, and carry out what it returned."""
        started = time.perf_counter()
        step = call(*args, **kwargs)
        spent = time.perf_counter() - started
        self.scheduling_s.append(spent)
        self.scheduling_total_s += spent
        self._apply(step)

    def _apply(self, step: ClusterStep) -> None:
        for task in step.failed:
            if self.on_failed is not None:
                self.on_failed(task)
        if step.aborted and self.on_aborted is not None and self.link is None:   # a loop drops them itself
            self.on_aborted(step.aborted)
        for decision in step.decisions:
            self._loop.call_at(self._t0 + decision.decided_s + self.query_cost_s, self._dispatch, decision)
        for n, event in step.commands:
            self.link.command(n, event)
        for action in step.actions if self.link is None else ():   # a loop started its own
            if isinstance(action, Timer):
                self._loop.call_at(self._t0 + action.at_s, self._timer, action)
            else:
                task = self._loop.create_task(self._run(action))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
        if self.retry_every_s and self.cluster.scheduler.deferred and not self._tick_armed:
            self._tick_armed = True
            self._loop.call_later(self.retry_every_s, self._tick)
        if self._all_done():
            self._done.set()

    def _tick(self) -> None:
        self._tick_armed = False
        self._step(self.cluster.retry, self.now())

    def _dispatch(self, decision: Decision) -> None:
        # with a link, a command to the node's loop: the mirror applies it when the node's
        # report says it did
        self._step(self.cluster.dispatch, decision, self.now())

    def _timer(self, timer: Timer) -> None:
        self._step(self.cluster.timer, timer, self.now())

    async def _run(self, op: Op) -> None:
        try:
            outcome = await self.runner.run(op)
        except OpLost:           # its node was reset: node_lost already placed its tasks again
            return
        except Exception as exc:  # an op failed: the run stops with it
            first = self.error is None
            self.error = exc
            self._done.set()
            if first and self.on_error is not None:
                self.on_error(exc)
            return
        if op.generation != self.cluster.nodes[op.node].generation:
            return                # finished as its node was reset: dropped like the others
        self._step(self.cluster.op_done, op, self.now(), outcome.finished, outcome.loss)
