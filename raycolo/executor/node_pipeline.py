"""A node's data plane: its loop in stage 0's process, its ops to the stages over their
process group, no central actor per op.

:class:`NodePipeline` runs a :class:`~raycolo.online.node_loop.NodeLoop` in the process of
the node's first stage. Stage 0's own ops run in that process; stage s > 0 gets each of
its ops as a typed message over the stages' own process group
(:mod:`raycolo.executor.wire`), runs it in :func:`serve_stage` and answers its
:class:`~raycolo.executor.stage_ops.StageResult` the same way. A receiver thread per
remote stage waits for its answers (gloo's ``recv`` blocks the calling thread), so stage
0 computes while the other stages do. Activations still go stage to stage, tagged by op
(:mod:`raycolo.executor.stage_process`).

Pure torch: no Ray. The loop reads the time from ``clock`` (seconds), relative to its
start.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

from raycolo.executor.stage_ops import QUIET, StageResult, Stop
from raycolo.executor.stage_process import StageProcess
from raycolo.executor.wire import DOWN_TAG, UP_TAG, recv_message, send_message


class StageFailed(RuntimeError):
    """A stage's op raised: the node's state is lost (its group restarts)."""


class NodePipeline:
    """Drives a node loop on stage 0 (see the module docstring)."""

    def __init__(self, loop, proc: StageProcess, dist=None, group=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.loop, self.proc, self.dist, self.group = loop, proc, dist, group
        self.clock, self.started = clock, clock()
        self.local: deque = deque()
        self.answers: queue.Queue = queue.Queue()
        self.receivers = [threading.Thread(target=self._receive, args=(s,), daemon=True,
                                           name=f"stage-{s}-answers") for s in range(1, loop.stages)]
        for t in self.receivers:
            t.start()
        self.ops_run = [0] * loop.stages

    def now(self) -> float:
        return self.clock() - self.started

    def _receive(self, stage: int) -> None:
        while True:
            answer = recv_message(stage, UP_TAG, self.dist, self.group)
            self.answers.put((stage, answer))
            if answer is None:      # the stage stopped
                return

    def _send_out(self) -> None:
        for out in self.loop.take_outbox():
            if out.stage == 0:
                self.local.append(out.message)
            else:
                send_message(out.message, out.stage, DOWN_TAG, self.dist, self.group)

    def _absorb(self, stage: int, answer) -> None:
        if answer is not None and not isinstance(answer, StageResult):     # the op raised there
            raise StageFailed(f"stage {stage}: {answer!r}")
        if answer is not None:
            self.ops_run[stage] += 1
            self.loop.done(stage, answer, self.now())

    def turn(self, wait_s: float = 0.05) -> None:
        """One turn: take the stages' answers and due timers, send what they started, run
        one of stage 0's ops, or wait up to ``wait_s`` (or the next timer) for an answer."""
        self._send_out()
        while True:
            try:
                self._absorb(*self.answers.get_nowait())
            except queue.Empty:
                break
        self.loop.fire_due(self.now())
        self._send_out()
        if self.local:
            message = self.local.popleft()
            result = self.proc.run(message)
            if not isinstance(message, QUIET):
                self.ops_run[0] += 1
                self.loop.done(0, result, self.now())
            return
        due = self.loop.next_timer()
        timeout = wait_s if due is None else max(0.0, min(wait_s, due - self.now()))
        try:
            self._absorb(*self.answers.get(timeout=timeout))
        except queue.Empty:
            pass

    def run_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Turn until ``done()`` (raises TimeoutError after ``timeout_s``)."""
        deadline = self.clock() + timeout_s
        while not done():
            if self.clock() > deadline:
                raise TimeoutError(f"node {self.loop.node.index}: not done within {timeout_s:g} s")
            self.turn()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the other stages and their receivers."""
        for s in range(1, self.loop.stages):
            send_message(Stop(seq=-1), s, DOWN_TAG, self.dist, self.group)
        for t in self.receivers:
            t.join(timeout_s)


def serve_stage(proc: StageProcess, dist, group=None) -> int:
    """Stage s > 0 of a node: run what stage 0 sends until it says stop; answer each op's
    result (an op that raises answers the exception, then raises). Returns the ops run."""
    ran = 0
    while True:
        message = recv_message(0, DOWN_TAG, dist, group)
        if isinstance(message, Stop):
            send_message(None, 0, UP_TAG, dist, group)
            return ran
        try:
            result = proc.run(message)
        except Exception as exc:
            send_message(RuntimeError(repr(exc)), 0, UP_TAG, dist, group)
            raise
        if not isinstance(message, QUIET):
            ran += 1
            send_message(result, 0, UP_TAG, dist, group)
