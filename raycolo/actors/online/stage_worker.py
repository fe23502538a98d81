"""Stage workers: the Ray Train workers of one node, each a pipeline stage that serves and trains.

A node is one ``TorchTrainer`` whose S workers hold consecutive layer slices of the model
(:class:`~raycolo.online.stages.stage_model.StageModel`, LoRA on their layers). Ray Train gives them
their process group (gloo on CPU, NCCL on GPU), gang placement, restarts and checkpoints.
:func:`stage_loop` is the train function: a worker registers as ``node-<n>/stage-<s>``
with the controller, then runs its ops (typed messages, :mod:`raycolo.online.stages.stage_ops`)
with :class:`~raycolo.online.stages.stage_process.StageProcess`. With ``stage.data_plane:
controller`` it pulls each op from the controller (each request for the next op carries
the result of the last: one actor call per op); with ``node`` the node's own loop runs
on its stage 0 and sends the other stages their ops (:mod:`raycolo.actors.online.node_worker`).
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Optional

from raycolo.online.stage_messages import WorkerInfo, WorkerStart
from raycolo.online.stages.checkpoints import newest_committed
from raycolo.engine.device_stats import device_reading
from raycolo.online.stages.stage_ops import QUIET, ReadAdapter, SaveCheckpoint, StageResult
from raycolo.engine.executor.idle_group import idle_group
from raycolo.online.stages.stage_process import StageProcess, build_stage, p2p_group

DEVICE_READING_EVERY_S = 2.0      # how often a stage reports its device's memory (and GPU use)


def _process_start_s() -> float:
    """When this process started (wall clock), from /proc where there is one."""
    try:
        ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _vocab_rules(model_id: str, vocab_size: int):
    """The sampling rules of the model's tokenizer (raycolo.generation.vocab_rules)."""
    from raycolo.engine.models import load_tokenizer
    from raycolo.generation.vocab_rules import VocabRules

    return VocabRules(load_tokenizer(model_id), vocab_size)


def stage_loop(config: dict) -> None:
    """``train_loop_per_worker`` of a node's TorchTrainer: build the stage, restore the
    run's checkpoint, register and serve. With the node-loop data plane a worker outlives
    a crash of the deployment's controller (its group's host is detached,
    :mod:`raycolo.actors.online.group_host`): it rolls back to the node's newest committed
    checkpoint and registers with the restarted controller."""
    import ray
    import ray.train
    import torch.distributed as dist

    from raycolo.engine.threads import apply_thread_policy

    process_s, train_function_s = _process_start_s(), time.time()
    ctx = ray.train.get_context()
    stage, stages = ctx.get_world_rank(), ctx.get_world_size()
    node = config["node"]
    apply_thread_policy(config.get("cpu_threads"))
    sys.setswitchinterval(config["switch_interval_s"])   # the GIL back to the compute soon (stage.switch_interval_s)
    controller = ray.get_actor(config["controller"], namespace=config["namespace"])
    stage_model, model_config = build_stage(config, config["layer_bounds"], stage)
    model_built_s = time.time()
    _warn_of_an_idle_gpu(config["device"], node, stage)
    if config.get("init_from"):   # lora.init_from: every stage starts from its part (a checkpoint wins)
        from safetensors.torch import load_file

        from raycolo.online.stages.stage_model import ADAPTER_WEIGHTS_FILE

        stage_model.load_lora_state(load_file(os.path.join(config["init_from"], ADAPTER_WEIGHTS_FILE)))
    initial = stage_model.lora_state()      # what a rejoin without a checkpoint rolls back to
    checkpoint = ray.train.get_checkpoint()
    restored, resumed = None, {}
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            restored, resumed = _restore(stage_model, stage, d)
    started = WorkerStart(process_s, train_function_s, model_built_s, time.time())
    dtype = next(stage_model.executor.layers[0].parameters()).dtype
    readings = DeviceReadings(next(stage_model.executor.layers[0].parameters()).device)
    rejoined = False
    inbox = None             # stage 0's node inbox: replicas place requests there while the controller is down
    if stage == 0 and config.get("data_plane") == "node":
        from raycolo.online.serving.node_inbox import NodeInbox

        inbox = NodeInbox(node, ray.util.get_node_ip_address())
    side = p2p_group(dist)       # every rank, once: a gloo group where the stages' group is NCCL
    messages = idle_group(dist)  # every rank, once: the node loop's messages, however long the node idles
    rules = None                 # the last stage samples: its tokenizer's rules (structured outputs, bad words)
    if stage == stages - 1:
        from raycolo.generation.vocab_rules import prefetched_rules

        rules = functools.partial(_vocab_rules, config["model_id"], model_config.vocab_size)
        if str(config["device"]).startswith("cuda"):
            # on a GPU stage, loaded now on a spare core; on a CPU stage every core computes, so
            # at the first request that needs them (a one-time pause of that step)
            rules = prefetched_rules(rules)
    while True:
        proc = StageProcess(stage_model, stage, stages, model_config.hidden_size, dtype, dist, side, messages,
                            rules)
        me = ray.get_runtime_context()
        epoch = ray.get(controller.register.remote(node, stage, WorkerInfo(started=started,
            actor_id=me.get_actor_id(), pid=os.getpid(), node_id=me.get_node_id(),
            node_ip=ray.util.get_node_ip_address(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
            restored_version=restored, restored_held=resumed.get("held"),
            restored_cursor=resumed.get("cursor"), placement_group=me.get_placement_group_id(),
            rejoined=rejoined, node_inbox=inbox and inbox.address)))
        incarnation = ray.get(controller.incarnation.remote())
        if not _serve(config, controller, node, stage, epoch, incarnation, proc, dist, readings, stage_model,
                      inbox):
            if inbox is not None:
                inbox.close()
            return
        # the controller restarted: what the adapter learnt since the node's newest committed
        # checkpoint is trained again by the new one (it plans from the checkpoints), so
        # every stage goes back to that checkpoint (or to its start without one)
        rejoin_s = time.time()
        restored, resumed = _roll_back(stage_model, stage, config, initial)
        started = WorkerStart(process_s, train_function_s, model_built_s, time.time(), rejoin_s)
        rejoined = True


def _serve(config: dict, controller, node: int, stage: int, epoch: int, incarnation: int, proc, dist,
           readings, stage_model, inbox=None) -> bool:
    """Run the stage's ops until the node stops (False) or the controller restarted (True:
    only with the node-loop data plane)."""
    import ray

    def checkpoint(op) -> StageResult | None:
        """SaveCheckpoint: every stage reports its part to Ray Train; None for other ops."""
        if not isinstance(op, SaveCheckpoint):
            return None
        # No flush of pending sends first: their receivers may be ops held back until the
        # checkpoint is done (the weights do not depend on them).
        proc.received(op.received)
        _report_checkpoint(stage_model, stage, op)
        if stage == 0:   # the node serves on while Ray Train commits the checkpoint
            threading.Thread(target=_await_commit, args=(controller, node, epoch, op.version, config["run_dir"]),
                             daemon=True).start()
        # the weights come back too: the controller keeps the version servable (@v<k>)
        return StageResult(op.seq, state=stage_model.lora_state(host=True))

    if config.get("data_plane") == "node":
        from raycolo.actors.online.node_worker import run_node_stage

        return run_node_stage(controller, node, stage, epoch, proc, dist, checkpoint, readings.annotate,
                              config["report_every_s"], incarnation, inbox)
    done = None              # the StageResult of the last op, reported with the next request
    while True:
        op = ray.get(controller.next_op.remote(node, stage, epoch, done))
        done = None
        if op is None:          # the deployment stops
            return False
        if isinstance(op, SaveCheckpoint):
            ray.get(controller.op_done.remote(node, stage, epoch, checkpoint(op)))
            continue
        if isinstance(op, ReadAdapter):
            controller.op_done.remote(node, stage, epoch, proc.run(op))
            continue
        if isinstance(op, QUIET):   # free KV blocks or activations (nothing to report)
            proc.run(op)
            continue
        try:
            result = proc.run(op)
        except Exception as exc:  # the op failed: the controller fails what it carried
            ray.get(controller.op_failed.remote(node, stage, epoch, op.seq, repr(exc)))
            raise
        readings.annotate(result)
        done = result


def _warn_of_an_idle_gpu(device: str, node: int, stage: int) -> None:
    """A worker Ray gave a real GPU (every stage group asks for one) that computes on the
    CPU because ``stage.device`` is ``cpu`` (the default) says so, once, in its log."""
    import logging

    import torch

    if str(device) == "cpu" and torch.cuda.is_available():
        logging.getLogger("raycolo.online").warning(
            "node %d stage %d: holds GPU %s but computes on the CPU (stage.device: cpu); set stage.device: "
            "cuda to run on it", node, stage, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _restore(stage_model, stage: int, directory: str) -> tuple[Optional[int], dict]:
    """Load stage ``stage``'s part of the checkpoint in ``directory``: the adapter version
    restored, and for stage 0 the samples it holds and the cursor saved with it (None and
    {} if the checkpoint has no part of this stage)."""
    import json

    from safetensors.torch import load_file

    path = os.path.join(directory, f"stage-{stage}.safetensors")
    if not os.path.exists(path):
        return None, {}
    stage_model.load_lora_state(load_file(path))
    with open(os.path.join(directory, f"stage-{stage}.json")) as f:
        version = json.load(f)["adapter_version"]
    resumed = {}
    if stage == 0:       # what the checkpoint's adapter was trained on
        for key, name in (("held", "held.json"), ("cursor", "cursor.json")):
            if os.path.exists(os.path.join(directory, name)):
                with open(os.path.join(directory, name)) as f:
                    resumed[key] = json.load(f)
    return version, resumed


def _roll_back(stage_model, stage: int, config: dict, initial: dict) -> tuple[Optional[int], dict]:
    """Forget everything since the node's newest committed checkpoint (a resuming
    deployment's; else the adapter's start): caches, stashed activations, gradients,
    optimizer moments, and the adapter's weights."""
    found = newest_committed(config["run_dir"]) if config.get("resume") else None
    stage_model.start_over(initial)
    if found is None:
        return None, {}
    return _restore(stage_model, stage, found.directory)


class DeviceReadings:
    """Adds the device's figures to a result every ``DEVICE_READING_EVERY_S``."""

    def __init__(self, device):
        self.device, self.next_s = device, 0.0

    def annotate(self, result: StageResult) -> None:
        if time.monotonic() >= self.next_s:
            result.device = device_reading(self.device)
            self.next_s = time.monotonic() + DEVICE_READING_EVERY_S


COMMIT_WAIT_S = 300.0


def _await_commit(controller, node: int, epoch: int, version: int, run_dir: str) -> None:
    """Tell the controller once Ray Train committed checkpoint ``version``. A report is
    only collected at the Train controller's next poll (about a second here): a group that
    dies before that restarts from the checkpoint before, so only a committed one counts.

    Read from the run's ``checkpoint_manager_snapshot.json``, which Ray Train rewrites at
    each commit, rather than ``ray.train.get_all_reported_checkpoints``: in a run restored
    from an earlier one of the same name (a resumed deployment) the snapshot's report
    index carries on from the old run while the new workers count from zero, and that call
    then waited past its timeout for commits that had happened."""
    import json
    import time

    path = os.path.join(run_dir, "checkpoint_manager_snapshot.json")
    deadline = time.monotonic() + COMMIT_WAIT_S
    committed = None
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                results = json.load(f).get("checkpoint_results", [])
            committed = max((r["metrics"]["adapter_version"] for r in results
                             if "adapter_version" in r.get("metrics", {})), default=None)
        except (OSError, ValueError, KeyError, TypeError):
            pass              # not written yet, or caught mid-rewrite
        if committed is not None and committed >= version:
            break
        time.sleep(0.2)
    controller.checkpoint_committed.remote(node, epoch, version, committed)


def _report_checkpoint(stage_model, stage: int, op: SaveCheckpoint) -> None:
    """Every stage calls ``ray.train.report`` (a barrier) with its adapter weights."""
    import json
    import tempfile

    import ray.train
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        state = {k: v.contiguous() for k, v in stage_model.lora_state().items()}
        save_file(state, os.path.join(d, f"stage-{stage}.safetensors"))
        with open(os.path.join(d, f"stage-{stage}.json"), "w") as f:
            json.dump({"adapter_version": op.version}, f)
        if stage == 0:
            with open(os.path.join(d, "cursor.json"), "w") as f:
                f.write(op.cursor)
            with open(os.path.join(d, "held.json"), "w") as f:
                f.write(op.held)
        ray.train.report({"adapter_version": op.version, "stage": stage},
                         checkpoint=ray.train.Checkpoint.from_directory(d))
