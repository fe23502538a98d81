"""A node's stage workers with the node's loop on the node (``stage.data_plane: node``).

Stage 0 of a node's worker group runs the node's
:class:`~raycolo.online.scheduling.node_loop.NodeLoop` in a
:class:`~raycolo.online.stages.node_pipeline.NodePipeline`: it runs its own ops, sends the
other stages theirs over the group's own process group, and talks to the controller
off its data path, from two threads:

* one waits for the controller's commands (``node_commands``: tasks placed here,
  cancellations, syncs, pauses for out-of-band work) and posts them to the pipeline;
* one sends the loop's reports (``node_report``: its events, and its requests' tokens for
  the controller's books),
  one at a time and at most one per ``stage.report_every_s``, each carrying whatever
  piled up meanwhile. On 2 cores a report per decode iteration cost the node about 1.5 ms
  of each iteration (bench/live_tbt.py), since the controller's side of it runs on the
  cores the stages use; a few milliseconds between reports is imperceptible in a stream.

The tokens of a request an HTTP replica admitted go from the loop's own thread straight to
that replica's token inbox (:class:`~raycolo.online.serving.token_wire.TokenSender`, one frame per
replica per loop turn), not through the controller.

If the controller dies (its long-poll fails), the loop serves on: what it holds, and the
requests replicas place in stage 0's node inbox meanwhile
(:mod:`raycolo.online.serving.node_inbox`). Once Ray restarted the controller (it answers
with another ``incarnation()``), the loop takes nothing new, runs dry and stops, and
every stage registers again with the new controller (:func:`run_node_stage` returns
True; :mod:`raycolo.actors.online.stage_worker` rolls back to the checkpoint first).

The other stages run :func:`~raycolo.online.stages.node_pipeline.serve_stage`. Checkpoints
(``ray.train.report``, a barrier of every stage) run on every stage as in the
controller's data plane (:mod:`raycolo.actors.online.stage_worker`).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Optional

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from raycolo.online.stages.node_pipeline import NodePipeline, serve_stage, stop_stages
from raycolo.online.scheduling.node_commands import Serve
from raycolo.online.scheduling.node_loop import NodeLoop
from raycolo.online.serving.beacon import watch
from raycolo.online.serving.node_inbox import NodeInbox, decode_request
from raycolo.online.serving.token_wire import TokenSender

REPORT_WAIT_S = 60.0      # a report the controller does not take within this long: the node stops
REJOIN_WAIT_S = 300.0     # how long a node whose controller died waits for Ray to restart it


def run_node_stage(controller, node: int, stage: int, epoch: int, proc, dist, special, annotate,
                   report_every_s: float, incarnation: int, inbox: Optional[NodeInbox] = None) -> bool:
    """The node-loop data plane of one stage worker (see the module docstring).
    ``special``: runs a checkpoint; ``annotate``: adds the device's figures to a result;
    ``report_every_s``: the least time between two reports (stage.report_every_s);
    ``incarnation``: the controller's, as it answered when the worker registered;
    ``inbox``: stage 0's node inbox, where replicas place requests while the controller
    is down. Returns whether the controller restarted meanwhile (the worker then
    registers with the new one), rather than stopped the node."""
    if stage > 0:
        return serve_stage(proc, dist, special=special, annotate=annotate).rejoin
    setup = ray.get(controller.node_setup.remote(node, epoch))
    if setup is None:          # a stale group, or the deployment stops: so do the other stages
        stop_stages(proc, dist)
        return False
    loop = NodeLoop(setup.node, setup.dpo_beta, setup.max_len,
                    sync_dir=lambda v: os.path.join(setup.sync_root, f"v{v}"), era=setup.era)
    pipeline = NodePipeline(loop, proc, dist, clock=time.time, started=setup.t0_wall, special=special,
                            on_answer=lambda s, result: controller.op_done.remote(node, s, epoch, result),
                            annotate=annotate)
    reports: queue.Queue = queue.Queue()
    sender = TokenSender()
    orphaned, ending = threading.Event(), threading.Event()    # the controller died; the loop ends for it
    if inbox is not None:
        def deliver(payload: bytes) -> bool:
            request = decode_request(payload, pipeline.now())
            sender.watch(request.task.task_id, request.front)
            pipeline.post([Serve(request)])
            return True

        inbox.attach(lambda: orphaned.is_set() and not ending.is_set(), deliver)
        watch(ray.get(controller.beacon.remote()), orphaned.set, name="controller-beacon")  # its end, at once
    threading.Thread(target=_take_commands, args=(controller, node, epoch, pipeline, sender, incarnation,
                                                  orphaned, ending), daemon=True, name="node-commands").start()
    reporter = threading.Thread(target=_send_reports, args=(controller, node, epoch, reports, pipeline,
                                                            report_every_s), daemon=True, name="node-reports")
    reporter.start()
    try:
        while not pipeline.stopped:
            pipeline.turn()
            if loop.report:
                report = loop.take_report()
                sender.send(report.tokens)
                reports.put(report)
    except Exception as exc:     # an op failed here or on another stage: the group restarts
        try:
            ray.get(controller.op_failed.remote(node, 0, epoch, -1, repr(exc)), timeout=REPORT_WAIT_S)
        except (RayActorError, ActorUnavailableError):
            pass                 # the controller is gone too: the new one hears of the group from Ray Train
        raise
    finally:
        reports.put(None)
    reporter.join(REPORT_WAIT_S)
    sender.close()
    pipeline.close()
    return pipeline.rejoining


def _take_commands(controller, node: int, epoch: int, pipeline: NodePipeline, sender: TokenSender,
                   incarnation: int, orphaned: threading.Event, ending: threading.Event) -> None:
    """Post the controller's commands to the pipeline. The node stops when the controller
    says so; if it died instead (``orphaned``), the loop serves on what it has, and what
    replicas place in its inbox, until Ray restarted it, then ends (``ending``) to
    register with the new one (``pipeline.rejoin``)."""
    while True:
        try:
            commands = ray.get(controller.node_commands.remote(node, epoch))
        except (RayActorError, ActorUnavailableError):     # it died: Ray restarts it
            commands = None
            orphaned.set()
        except Exception:        # the controller is gone: so is this deployment's run
            commands = None
            incarnation = None
        if commands is None and incarnation is not None and restarted(controller, incarnation):
            ending.set()
            sender.mute()        # the replicas admit its requests again, with what they streamed
            pipeline.rejoin()
            return
        for command in commands or ():
            if type(command) is Serve:     # before the loop sees it: its tokens know their way
                sender.watch(command.request.task.task_id, command.request.front)
        pipeline.post(commands)
        if commands is None:
            return


def restarted(controller, incarnation: int, wait_s: float = REJOIN_WAIT_S) -> bool:
    """Whether ``controller`` answers as another incarnation than ``incarnation`` (Ray
    restarted it), waiting up to ``wait_s`` for it to answer at all; False if it is the
    same one, or does not come back."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            return ray.get(controller.incarnation.remote(), timeout=10) != incarnation
        except (RayActorError, ActorUnavailableError, GetTimeoutError):
            time.sleep(0.1)
    return False


def _send_reports(controller, node: int, epoch: int, reports: queue.Queue, pipeline: NodePipeline,
                  every_s: float) -> None:
    sent = 0.0
    while True:
        time.sleep(max(0.0, sent + every_s - time.monotonic()))    # at most one report per every_s
        report = reports.get()
        sent = time.monotonic()
        last = report is None
        while not last:          # everything that piled up goes in one report
            try:
                more = reports.get_nowait()
            except queue.Empty:
                break
            if more is None:
                last = True
            elif more.era != report.era:     # a new scheduler's: the old era's goes first
                _report(controller, node, epoch, report, pipeline)
                report = more
            else:
                report.extend(more)
        if report is not None:
            _report(controller, node, epoch, report, pipeline)
        if last:
            return


def _report(controller, node: int, epoch: int, report, pipeline: NodePipeline) -> None:
    try:
        why = ray.get(controller.node_report.remote(node, epoch, report), timeout=REPORT_WAIT_S)
    except (RayActorError, ActorUnavailableError):
        return        # the controller died with its mirror: the node registers with the new one
    if why is not None:       # the controller's mirror parted from the loop: the group starts over
        pipeline.fail(why)
