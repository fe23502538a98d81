"""A node's data plane: its loop in stage 0's process, its ops to the stages over their
process group, no central actor per op.

:class:`NodePipeline` runs a :class:`~raycolo.online.scheduling.node_loop.NodeLoop` in the process of
the node's first stage. Stage 0's own ops run in that process; stage s > 0 gets each of
its ops as a typed message over the stages' message group (``StageProcess.messages``,
:mod:`raycolo.online.stages.stage_wire`; its timeout is a week, since a stage waits there
for as long as the node idles), runs it in :func:`serve_stage` and answers its
:class:`~raycolo.online.stages.stage_ops.StageResult` the same way. A receiver thread per
remote stage waits for its answers (gloo's ``recv`` blocks the calling thread), so stage
0 computes while the other stages do. Activations still go stage to stage, tagged by op
(:mod:`raycolo.online.stages.stage_process`).

The control plane's commands (:mod:`raycolo.online.scheduling.node_commands`) arrive through
:meth:`NodePipeline.post` (from any thread) and are applied between ops. A ``Pause``
holds back what the loop starts until nothing is in flight, says so in the loop's report,
and an ``OutOfBand`` then runs one message per stage (a checkpoint, an adapter read, an
evaluation) with every stage idle, answering each through ``on_answer``.

Pure torch: no Ray. The loop reads the time from ``clock`` (seconds), relative to
``started`` (default: when the pipeline was built).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Optional

from raycolo.generation import FinishReason
from raycolo.online.stages.stage_ops import QUIET, StageResult, StageWork, Stop
from raycolo.online.stages.stage_process import StageProcess
from raycolo.online.stages.stage_wire import DOWN_TAG, UP_TAG, recv_message, send_message
from raycolo.online.scheduling.node_commands import Adopt, OutOfBand, Pause


class StageFailed(RuntimeError):
    """A stage's op raised: the node's state is lost (its group restarts)."""


Special = Callable[[StageWork], Optional[StageResult]]   # runs what StageProcess does not (None: not mine)
COMMANDS = -1          # the inbox key of a list of commands (stages answer under their index)
FAILED = -2            # the inbox key of why the node must start over
REJOIN = -3            # the inbox key of: the control plane restarted, end once the node ran dry
REJOIN_DRAIN_S = 60.0  # how long a node whose control plane restarted may take to run dry


class NodePipeline:
    """Drives a node loop on stage 0 (see the module docstring)."""

    def __init__(self, loop, proc: StageProcess, dist=None,
                 clock: Callable[[], float] = time.perf_counter, started: Optional[float] = None,
                 special: Optional[Special] = None,
                 on_answer: Optional[Callable[[int, StageResult], None]] = None,
                 annotate: Optional[Callable[[StageResult], None]] = None):
        self.loop, self.proc, self.dist, self.group = loop, proc, dist, proc.messages
        self.clock = clock
        self.started = clock() if started is None else started
        self.special, self.on_answer, self.annotate = special, on_answer, annotate
        self.local: deque = deque()
        self.inbox: queue.Queue = queue.Queue()    # (stage, answer) or (COMMANDS, [command, ...] | None)
        self.inflight = 0              # messages sent (or queued here for stage 0) not yet answered
        self.pause: Optional[int] = None           # the Pause under way
        self.pause_told = False
        self.out_of_band: dict[int, int] = {}      # stage -> seq of its out-of-band message unanswered
        self.stopped = False           # the control plane said stop (a None command list)
        self.rejoining = False         # the control plane restarted: stop once the node ran dry
        self.rejoin_by = 0.0
        self.receivers = [threading.Thread(target=self._receive, args=(s,), daemon=True,
                                           name=f"stage-{s}-answers") for s in range(1, loop.stages)]
        for t in self.receivers:
            t.start()
        self.ops_run = [0] * loop.stages

    def now(self) -> float:
        return self.clock() - self.started

    def post(self, commands: Optional[list]) -> None:
        """Commands for the loop (None: stop), from any thread; applied at the next turn."""
        self.inbox.put((COMMANDS, commands))

    def rejoin(self) -> None:
        """The control plane restarted (from any thread): end the node's requests at their
        next token (their replicas admit them again to the restarted controller, with the
        tokens they streamed; the node's token sender is muted first), run its training
        tasks' ops to their end (a node that takes no new work runs dry), then
        stop (:attr:`rejoining`; the stages are told so by :meth:`close`). Stopping midway
        would leave activations on the wire that a later op of the same number would take;
        a node that does not run dry within ``REJOIN_DRAIN_S`` fails instead (its group
        starts over)."""
        self.inbox.put((REJOIN, None))

    def fail(self, why: str) -> None:
        """The node must start over (its mirror parted from it): the next turn raises."""
        self.inbox.put((FAILED, why))

    def _receive(self, stage: int) -> None:
        while True:
            answer = recv_message(stage, UP_TAG, self.dist, self.group)
            self.inbox.put((stage, answer))
            if answer is None:      # the stage stopped
                return

    def _send_out(self) -> None:
        if self.pause is not None:       # held back until the out-of-band work is done
            return
        for out in self.loop.take_outbox():
            if not isinstance(out.message, QUIET):
                self.inflight += 1
            if out.stage == 0:
                self.local.append(out.message)
            else:
                send_message(out.message, out.stage, DOWN_TAG, self.dist, self.group)

    def _absorb(self, stage: int, answer) -> None:
        if stage == COMMANDS:
            self._commands(answer)
            return
        if stage == FAILED:
            raise StageFailed(answer)
        if stage == REJOIN:
            self.rejoining, self.rejoin_by = True, time.monotonic() + REJOIN_DRAIN_S
            self.loop.end_requests(FinishReason.ABORT)
            if not self.out_of_band:      # a Pause whose out-of-band work will not come now
                self.pause = None
            return
        if answer is not None and not isinstance(answer, StageResult):     # the op raised there
            raise StageFailed(f"stage {stage}: {answer!r}")
        if answer is None:
            return
        if self.out_of_band.get(stage) == answer.seq:
            self._answered(stage, answer)
            return
        self.inflight -= 1
        self.ops_run[stage] += 1
        self.loop.done(stage, answer, self.now())

    def _commands(self, commands: Optional[list]) -> None:
        if commands is None:
            self.stopped = True
            return
        for command in commands:
            kind = type(command)
            if kind is Pause:
                self.pause, self.pause_told = command.token, False
            elif kind is OutOfBand:
                self._run_out_of_band(command.messages)
            elif kind is Adopt:        # a new clock too (commands come with the wall clock)
                self.loop.command(command, self.now())
                self.started = command.setup.t0_wall
            else:
                self.loop.command(command, self.now())

    def _run_out_of_band(self, messages: list) -> None:
        if self.pause is None or self.inflight:
            raise RuntimeError("out-of-band work must follow a Pause the node answered")
        for s, message in enumerate(messages[1:], start=1):   # first: stage 0 may wait for them (a barrier)
            self.out_of_band[s] = message.seq
            send_message(message, s, DOWN_TAG, self.dist, self.group)
        first = messages[0]
        result = self.special(first) if self.special is not None else None
        self._answered(0, result if result is not None else self.proc.run(first))

    def _answered(self, stage: int, result: StageResult) -> None:
        self.out_of_band.pop(stage, None)
        if self.on_answer is not None:
            self.on_answer(stage, result)
        if not self.out_of_band:
            self.pause = None

    def _run_local(self) -> None:
        message = self.local.popleft()
        result = self.proc.run(message)
        if isinstance(message, QUIET):
            return
        self.inflight -= 1
        self.ops_run[0] += 1
        if self.annotate is not None:
            self.annotate(result)
        self.loop.done(0, result, self.now())

    def turn(self, wait_s: float = 0.05) -> None:
        """One turn: take the stages' answers, commands and due timers, send what they
        started, run one of stage 0's ops, or wait up to ``wait_s`` (or the next timer)
        for an answer or a command."""
        self._send_out()
        while True:
            try:
                self._absorb(*self.inbox.get_nowait())
            except queue.Empty:
                break
        self.loop.fire_due(self.now())
        self._send_out()
        if self.local:
            self._run_local()
            return
        if self.rejoining and self.loop.idle and not self.inflight and not self.out_of_band:
            self.stopped = True       # every op chain ended: no activation is left on the wire
            return
        if self.rejoining and time.monotonic() > self.rejoin_by:
            raise StageFailed(f"the node's work did not end within {REJOIN_DRAIN_S:g} s of its controller's restart")
        if self.pause is not None and not self.pause_told and not self.inflight:
            self.loop.report.paused, self.pause_told = self.pause, True     # nothing in flight now
        due = self.loop.next_timer()
        timeout = wait_s if due is None else max(0.0, min(wait_s, due - self.now()))
        try:
            self._absorb(*self.inbox.get(timeout=timeout))
        except queue.Empty:
            pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the other stages and their receivers."""
        for s in range(1, self.loop.stages):
            send_message(Stop(seq=-1, rejoin=self.rejoining), s, DOWN_TAG, self.dist, self.group)
        for t in self.receivers:
            t.join(timeout_s)


def stop_stages(proc: StageProcess, dist) -> None:
    """Stop the other stages of stage 0's node where no :class:`NodePipeline` runs (the
    node ends before its loop started: the deployment stops, or the group is stale), and
    wait for each one's last answer. Without it, stage s > 0 waits in
    :func:`serve_stage` for an op that never comes, and the run ends only when its host
    gives up on it (a deployment stopped just after its start took 60 s)."""
    for s in range(1, proc.stages):
        send_message(Stop(seq=-1, rejoin=False), s, DOWN_TAG, dist, proc.messages)
    for s in range(1, proc.stages):
        recv_message(s, UP_TAG, dist, proc.messages)


def serve_stage(proc: StageProcess, dist, special: Optional[Special] = None,
                annotate: Optional[Callable[[StageResult], None]] = None) -> Stop:
    """Stage s > 0 of a node: run what stage 0 sends until it says stop; answer each op's
    result (an op that raises answers the exception, then raises). ``special``: runs the
    messages StageProcess does not (a checkpoint); ``annotate``: adds to a result before
    it is answered (the device's figures). Returns the Stop it ended with. The messages
    travel on ``proc.messages``, where a stage may wait for its next op as long as the
    node idles."""
    group = proc.messages
    while True:
        message = recv_message(0, DOWN_TAG, dist, group)
        if isinstance(message, Stop):
            send_message(None, 0, UP_TAG, dist, group)
            return message
        try:
            result = special(message) if special is not None else None
            if result is None:
                result = proc.run(message)
        except Exception as exc:
            send_message(RuntimeError(repr(exc)), 0, UP_TAG, dist, group)
            raise
        if not isinstance(message, QUIET):
            if annotate is not None:
                annotate(result)
            send_message(result, 0, UP_TAG, dist, group)
