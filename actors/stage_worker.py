"""Stage workers: the Ray Train workers of one node, each a pipeline stage that serves and trains.

A node is one ``TorchTrainer`` whose S workers hold consecutive layer slices of the model
(:class:`~raycolo.executor.stage.StageModel`, LoRA on their layers). Ray Train gives them
their process group (gloo on CPU, NCCL on GPU), gang placement, restarts and checkpoints.
:func:`stage_loop` is the train function: a worker registers as ``node-<n>/stage-<s>``
with the controller, then pulls ops from it forever and runs them (each request for the
next op carries the result of the last: one actor call per op).

Point-to-point traffic stays matched because every message is tagged: an op that feeds
the next stage (a forward's hidden states) or the stage before (a backward's input
gradient) sends with its own op id as the tag, and the op that consumes it names that id
(``after``) and receives exactly that tag. Consuming ops are only handed out after the
producing op reported done (the node scheduler readies them then), so every receive has
its send posted; sends are asynchronous (``isend``), so a stage never waits for its
neighbour to be free.
"""
from __future__ import annotations

import os
import threading
import time

import torch

from raycolo.engines.device_stats import device_reading

TAG_MOD = 1 << 30
DEVICE_READING_EVERY_S = 2.0      # how often a stage reports its device's memory (and GPU use)


class StageProcess:
    """What one worker does with an op payload (see :mod:`raycolo.actors.online_controller`)."""

    def __init__(self, stage_model, stage: int, stages: int, hidden_size: int, dtype, dist):
        self.model, self.stage, self.stages = stage_model, stage, stages
        self.hidden, self.dtype, self.dist = hidden_size, dtype, dist
        # where the stage computes, and where its point-to-point tensors live: NCCL sends
        # device tensors; gloo's send/recv take host tensors (a GPU stage over gloo, e.g.
        # two stages sharing one GPU, copies across)
        self.device = next(stage_model.executor.layers[0].parameters()).device
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        self.wire = self.device if nccl else torch.device("cpu")
        self.pending: dict[int, tuple] = {}   # seq -> (work, tensor) of isends not known received
        self.sent = 0                         # sends posted, all told

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.to(self.wire).contiguous()      # kept alive until the send completes
        self.pending[tag] = (self.dist.isend(tensor, dst, tag=tag % TAG_MOD), tensor)
        self.sent += 1

    def received(self, seqs) -> None:
        """The controller says these sends were consumed (the ops that receive them are
        done): let go of them. gloo's ``isend`` reports completion only to ``wait()``
        (``is_completed()`` stays False until then), so without this every hidden state a
        stage ever sent stayed referenced: a stage worker's memory grew with every op.
        ``wait()`` returns at once for a send that completed; sends not yet consumed are
        never waited for (their receivers may be ops held back behind a checkpoint)."""
        for seq in seqs or ():
            item = self.pending.pop(seq, None)
            if item is not None:
                item[0].wait()

    def _recv(self, shape, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.wire)
        self.dist.recv(buf, src, tag=tag % TAG_MOD)
        return buf.to(self.device)

    def _batch(self, samples):
        """A training op's token ids, labels (on the stage's device) and lengths."""
        from raycolo.executor.stage import training_batch, training_rows

        ids, labels, lengths = training_batch(training_rows(samples)[0])
        return ids.to(self.device), labels.to(self.device), lengths

    def run(self, op: dict) -> dict:
        kind = op["kind"]
        started = time.perf_counter()
        result: dict = {}
        first, last = self.stage == 0, self.stage == self.stages - 1
        if kind in ("prefill", "decode"):
            counts = op["counts"]
            hidden = None if first else self._recv((sum(counts), self.hidden), self.stage - 1, op["after"])
            tokens = op["tokens"] if first else [[0] * n for n in counts]
            out = self.model.forward(op["requests"], tokens, hidden, base=op.get("base", ()),
                                     pinned={int(r): d for r, d in op.get("pinned", {}).items()})
            if last:     # op["sampling"]: a raycolo.generation.sampler.SamplingRow per request (None: all greedy)
                from raycolo.generation.sampler import sample, sample_plain

                sampled = sample_plain(out) if op["sampling"] is None else sample(out, op["sampling"])
                result["tokens"] = sampled.tokens
                if any(lp is not None for lp in sampled.logprobs):
                    result["logprobs"] = sampled.logprobs
            else:
                self._send(out, self.stage + 1, op["seq"])
            for rid in op.get("release", []):
                self.model.release(rid)
        elif kind == "train_f":
            rows, t = op["shape"]
            preference = op.get("preference", False)
            ids, labels, lengths = self._batch(op["samples"]) if (first or last) else (None, None, op["lengths"])
            # a preference batch's hidden states carry the frozen base's rows too
            x = ids if first else self._recv((rows * (1 + preference), t, self.hidden), self.stage - 1, op["after"])
            out = self.model.train_forward(op["task"], x, lengths, labels if last else None,
                                           loss_scale=op.get("loss_scale", 1.0),
                                           preference=preference, beta=op.get("beta", 0.1))
            if last:
                result["loss"] = float(out)
            else:
                self._send(out, self.stage + 1, op["seq"])
        elif kind == "train_b":
            rows, t = op["shape"]
            rows *= 1 + op.get("preference", False)
            grad = None if last else self._recv((rows, t, self.hidden), self.stage + 1, op["after"])
            # a micro-batch of a task SIRIUS split accumulates with the task's others
            # (``group``); the last of them on this stage takes the step
            grad_in = self.model.train_backward(op["task"], grad, step=op.get("step", True), group=op.get("group"))
            if not first:
                self._send(grad_in, self.stage - 1, op["seq"])
        elif kind == "eval":     # a forward-only pass of a held-out batch: its loss, or a
            # preference batch's win rate and CLPD (MACE's alignment metrics)
            from raycolo.executor.losses import preference_stats, sequence_logprob
            from raycolo.executor.stage import causal_lm_loss, training_rows

            b, t = op["shape"]
            preference = training_rows(op["samples"])[1]
            ids, labels, lengths = self._batch(op["samples"])
            with torch.no_grad():
                x = ids if first else self._recv((b, t, self.hidden), self.stage - 1, op["after"])
                out = self.model.executor.forward_train(x, lengths)
            if last and preference:
                logp = sequence_logprob(out, labels)
                result.update(preference_stats(logp[:b // 2], logp[b // 2:]))
            elif last:
                result["loss"] = float(causal_lm_loss(out, labels))
            else:
                self._send(out, self.stage + 1, op["seq"])
        elif kind == "sync":
            from safetensors.torch import load_file

            from raycolo.executor.stage import ADAPTER_WEIGHTS_FILE

            self.model.load_lora_state(load_file(os.path.join(op["adapter"], ADAPTER_WEIGHTS_FILE)))
        elif kind == "release":
            for rid in op["requests"]:
                self.model.release(rid)
        elif kind == "drop":            # SIRIUS took the memory back: free the activations now
            for task in op["tasks"]:
                self.model.drop_training(task)
        else:
            raise ValueError(f"unknown op kind {kind!r}")
        result["seconds"] = time.perf_counter() - started
        return result


def stage_loop(config: dict) -> None:
    """``train_loop_per_worker`` of a node's TorchTrainer."""
    import ray
    import ray.train
    import torch.distributed as dist

    from raycolo.engines.models import load_model
    from raycolo.engines.threads import apply_thread_policy
    from raycolo.executor.stage import LoraSettings, StageModel, add_lora

    ctx = ray.train.get_context()
    stage, stages = ctx.get_world_rank(), ctx.get_world_size()
    node = config["node"]
    apply_thread_policy(config.get("cpu_threads"))
    controller = ray.get_actor(config["controller"], namespace=config["namespace"])
    model, _ = load_model(config["model_id"], seed=config["seed"], dtype=config["dtype"],
                          device=config["device"])
    lora = LoraSettings(**config["lora"])
    model = add_lora(model, lora)
    bounds = config["layer_bounds"]
    stage_model = StageModel(model, (bounds[stage], bounds[stage + 1]), config["num_blocks"],
                             config["block_size"], lr=lora.lr, pinned_cache=config["pinned_versions"])
    checkpoint = ray.train.get_checkpoint()
    restored = None          # the adapter version a restarted group resumes from
    resumed = {}             # stage 0: the samples that version holds, and the cursor saved with it
    if checkpoint is not None:
        import json

        from safetensors.torch import load_file
        with checkpoint.as_directory() as d:
            path = os.path.join(d, f"stage-{stage}.safetensors")
            if os.path.exists(path):
                stage_model.load_lora_state(load_file(path))
                with open(os.path.join(d, f"stage-{stage}.json")) as f:
                    restored = json.load(f)["adapter_version"]
                if stage == 0:       # what the checkpoint's adapter was trained on
                    for key, name in (("held", "held.json"), ("cursor", "cursor.json")):
                        if os.path.exists(os.path.join(d, name)):
                            with open(os.path.join(d, name)) as f:
                                resumed[key] = json.load(f)
    if restored is None and config.get("init_from"):   # lora.init_from: a restored checkpoint wins
        from safetensors.torch import load_file

        from raycolo.executor.stage import ADAPTER_WEIGHTS_FILE

        stage_model.load_lora_state(load_file(os.path.join(config["init_from"], ADAPTER_WEIGHTS_FILE)))
    proc = StageProcess(stage_model, stage, stages, model.config.hidden_size,
                        next(stage_model.executor.layers[0].parameters()).dtype, dist)
    me = ray.get_runtime_context()
    epoch = ray.get(controller.register.remote(node, stage, {
        "actor_id": me.get_actor_id(), "pid": os.getpid(), "node_id": me.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "restored_version": restored, "restored_held": resumed.get("held"),
        "restored_cursor": resumed.get("cursor"), "placement_group": me.get_placement_group_id()}))
    device = next(stage_model.executor.layers[0].parameters()).device
    next_reading = 0.0
    done = None              # (seq, result) of the last op, reported with the next request
    while True:
        op = ray.get(controller.next_op.remote(node, stage, epoch, done))
        done = None
        if op is None:          # the deployment stops
            return
        proc.received(op.get("received"))
        if op["kind"] == "checkpoint":
            # No flush of pending sends first: their receivers may be ops the controller
            # holds back until the checkpoint is done (the weights do not depend on them).
            _report_checkpoint(stage_model, stage, op)
            # the weights come back too: the controller keeps the version servable (@v<k>)
            ray.get(controller.op_done.remote(node, stage, epoch, op["seq"],
                                              {"seconds": 0.0, "state": stage_model.lora_state()}))
            if stage == 0:   # the node serves on while Ray Train commits the checkpoint
                threading.Thread(target=_await_commit, args=(controller, node, epoch, op["version"],
                                                             config["run_dir"]),
                                 daemon=True).start()
            continue
        if op["kind"] == "lora":
            controller.op_done.remote(node, stage, epoch, op["seq"], {"state": stage_model.lora_state()})
            continue
        if op["kind"] in ("release", "drop"):   # free KV blocks or activations (nothing to report)
            proc.run(op)
            continue
        try:
            result = proc.run(op)
        except Exception as exc:  # the op failed: the controller fails what it carried
            ray.get(controller.op_failed.remote(node, stage, epoch, op["seq"], repr(exc)))
            raise
        result["sends"] = (len(proc.pending), proc.sent)    # held (not known received), all told
        if time.monotonic() >= next_reading:   # the device's figures, every few seconds
            result["device"] = device_reading(device)
            next_reading = time.monotonic() + DEVICE_READING_EVERY_S
        done = (op["seq"], result)


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


def _report_checkpoint(stage_model, stage: int, op: dict) -> None:
    """Every stage calls ``ray.train.report`` (a barrier) with its adapter weights."""
    import json
    import tempfile

    import ray.train
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        state = {k: v.contiguous() for k, v in stage_model.lora_state().items()}
        save_file(state, os.path.join(d, f"stage-{stage}.safetensors"))
        with open(os.path.join(d, f"stage-{stage}.json"), "w") as f:
            json.dump({"adapter_version": op["version"]}, f)
        if stage == 0:
            with open(os.path.join(d, "cursor.json"), "w") as f:
                f.write(op["cursor"])
            with open(os.path.join(d, "held.json"), "w") as f:
                f.write(op["held"])
        ray.train.report({"adapter_version": op["version"], "stage": stage},
                         checkpoint=ray.train.Checkpoint.from_directory(d))
