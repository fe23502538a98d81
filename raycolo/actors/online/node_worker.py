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

The other stages run :func:`~raycolo.online.stages.node_pipeline.serve_stage`. Checkpoints
(``ray.train.report``, a barrier of every stage) run on every stage as in the
controller's data plane (:mod:`raycolo.actors.online.stage_worker`).
"""
from __future__ import annotations

import os
import queue
import threading
import time

import ray

from raycolo.online.stages.node_pipeline import NodePipeline, serve_stage
from raycolo.online.scheduling.node_commands import Serve
from raycolo.online.scheduling.node_loop import NodeLoop
from raycolo.online.serving.token_wire import TokenSender

REPORT_WAIT_S = 60.0      # a report the controller does not take within this long: the node stops


def run_node_stage(controller, node: int, stage: int, epoch: int, proc, dist, special, annotate,
                   report_every_s: float) -> None:
    """The node-loop data plane of one stage worker (see the module docstring).
    ``special``: runs a checkpoint; ``annotate``: adds the device's figures to a result;
    ``report_every_s``: the least time between two reports (stage.report_every_s)."""
    if stage > 0:
        serve_stage(proc, dist, special=special, annotate=annotate)
        return
    setup = ray.get(controller.node_setup.remote(node, epoch))
    if setup is None:          # a stale group
        return
    loop = NodeLoop(setup.node, setup.dpo_beta, setup.max_len,
                    sync_dir=lambda v: os.path.join(setup.sync_root, f"v{v}"), era=setup.era)
    pipeline = NodePipeline(loop, proc, dist, clock=time.time, started=setup.t0_wall, special=special,
                            on_answer=lambda s, result: controller.op_done.remote(node, s, epoch, result),
                            annotate=annotate)
    reports: queue.Queue = queue.Queue()
    sender = TokenSender()
    threading.Thread(target=_take_commands, args=(controller, node, epoch, pipeline, sender), daemon=True,
                     name="node-commands").start()
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
        ray.get(controller.op_failed.remote(node, 0, epoch, -1, repr(exc)), timeout=REPORT_WAIT_S)
        raise
    finally:
        reports.put(None)
    reporter.join(REPORT_WAIT_S)
    sender.close()
    pipeline.close()


def _take_commands(controller, node: int, epoch: int, pipeline: NodePipeline, sender: TokenSender) -> None:
    while True:
        try:
            commands = ray.get(controller.node_commands.remote(node, epoch))
        except Exception:        # the controller is gone: so is this deployment's run
            commands = None
        for command in commands or ():
            if type(command) is Serve:     # before the loop sees it: its tokens know their way
                sender.watch(command.request.task.task_id, command.request.front)
        pipeline.post(commands)
        if commands is None:
            return


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
    why = ray.get(controller.node_report.remote(node, epoch, report), timeout=REPORT_WAIT_S)
    if why is not None:       # the controller's mirror parted from the loop: the group starts over
        pipeline.fail(why)
