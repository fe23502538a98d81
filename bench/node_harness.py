"""Run one node's data plane on this machine, without Ray: S stage processes over a gloo
(or NCCL) group, the node loop in stage 0's.

Tests (tests/online/test_node_loop.py) and ``bench/node_loop.py`` use it to check the node loop against
transformers and to time it against the executor's own step. :func:`run_node` spawns one
process per stage; each loads the checkpoint, keeps its layer slice
(:class:`~raycolo.online.stages.stage_model.StageModel`, LoRA on), and stage 0 builds the node's
scheduler exactly as the cluster builds its mirror (:func:`raycolo.online.scheduling.cluster.node_scheduler`)
and runs it in a :class:`~raycolo.online.stages.node_pipeline.NodePipeline`. Work arrives at the
times the spec gives. What comes back: every request's tokens and finish reason, every
training task's loss, the node's report (its events, for a mirror to replay) and the
time each token came out.

Pure torch (and the standard library's multiprocessing): no Ray.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Optional

RESULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RequestSpec:
    prompt: list
    max_tokens: int
    at_s: float = 0.0
    base: bool = False          # served by the base model (LoRA off)
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class TrainSpec:
    samples: list               # (prompt ids, completion ids) pairs
    at_s: float = 0.0


@dataclass
class NodeRunSpec:
    config: dict                # an OnlineConfig (model_loading_config, stages, policy, lemix, lora, ...)
    requests: list = field(default_factory=list)     # RequestSpec
    training: list = field(default_factory=list)     # TrainSpec
    threads: int = 1            # torch threads per stage process
    timeout_s: float = 300.0
    collective_timeout_s: Optional[float] = None   # the stages' group's (None: torch's, 30 minutes)
    stop_before_loop: bool = False    # stage 0 stops the others before any loop runs (a node that
    # ends before its loop started: node_pipeline.stop_stages)
    answer_timeout_s: float = RESULT_TIMEOUT_S     # how long the caller waits for each stage


@dataclass
class NodeRunResult:
    tokens: dict                # request index -> its token ids
    finish: dict                # request index -> finish reason
    token_times: dict           # request index -> the loop's time (s) of each token
    losses: dict                # training index -> its loss
    report: object              # the node loop's NodeReport (every event since the start)
    ops_run: list               # ops each stage ran
    lora: dict = field(default_factory=dict)   # stage -> its LoRA weights (numpy) after the run


def _stage_main(rank: int, spec: NodeRunSpec, store_path: str, out) -> None:
    try:
        out.put((rank, _run_stage(rank, spec, store_path)))
    except BaseException as exc:     # noqa: BLE001 - reported to the caller
        out.put((rank, RuntimeError(f"stage {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")))


def _run_stage(rank: int, spec: NodeRunSpec, store_path: str):
    import torch
    import torch.distributed as dist

    from raycolo.engine.executor.idle_group import idle_group
    from raycolo.online.stages.node_pipeline import serve_stage
    from raycolo.online.stages.stage_process import StageProcess, build_stage, p2p_group
    from raycolo.online.config import OnlineConfig, layer_bounds, model_hf_config, stage_build

    torch.set_num_threads(spec.threads)
    cfg = OnlineConfig.model_validate(spec.config)
    stages = cfg.stages
    device = torch.device(cfg.stage.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    if stages > 1:     # as Ray Train makes a stage worker's group, then the groups the stage worker adds
        timeout = {} if spec.collective_timeout_s is None else {
            "timeout": datetime.timedelta(seconds=spec.collective_timeout_s)}
        dist.init_process_group(cfg.stage.backend, store=dist.FileStore(store_path, stages), rank=rank,
                                world_size=stages, **timeout,
                                **({"device_id": torch.device("cuda", 0)} if cfg.stage.backend == "nccl" else {}))
    tensors, messages = (p2p_group(dist), idle_group(dist)) if stages > 1 else (None, None)
    model_id = cfg.model_loading_config.model_id
    stage_model, model_config = build_stage(stage_build(cfg), layer_bounds(model_hf_config(model_id).num_hidden_layers,
                                                                            stages), rank)
    dtype = next(stage_model.executor.layers[0].parameters()).dtype
    proc = StageProcess(stage_model, rank, stages, model_config.hidden_size, dtype, dist if stages > 1 else None,
                        tensors, messages)
    try:
        if rank > 0:
            serve_stage(proc, dist)
            return {"lora": _lora(stage_model)}
        return _drive(spec, cfg, proc, dist if stages > 1 else None, model_config, stage_model)
    finally:
        if stages > 1:
            dist.barrier()
            dist.destroy_process_group()


def _lora(stage_model) -> dict:
    return {k: v.detach().float().cpu().numpy() for k, v in stage_model.lora_state().items()}


def _drive(spec: NodeRunSpec, cfg, proc, dist, model_config, stage_model) -> dict:
    from raycolo.engine.models import load_tokenizer
    from raycolo.online.stages.node_pipeline import NodePipeline
    from raycolo.generation import SamplingParams, stop_token_set
    from raycolo.online.scheduling.cluster import node_scheduler
    from raycolo.online.config import live_profile
    from raycolo.online.scheduling.node_events import OpDone
    from raycolo.online.scheduling.node_loop import NodeLoop, NodeReport
    from raycolo.online.stage_messages import ServedRequest
    from raycolo.online.tasks import OnlineTask
    from raycolo.online.policies import make_online_policy

    if spec.stop_before_loop:
        from raycolo.online.stages.node_pipeline import stop_stages

        stop_stages(proc, dist)
        return {"tokens": {}, "finish": {}, "token_times": {}, "losses": [], "report": None,
                "ops_run": [0] * cfg.stages, "lora": _lora(stage_model)}
    profile = live_profile(cfg, model_config)
    policy = make_online_policy(cfg.policy, cfg.lemix, nodes=1, train_rate=cfg.train_rate)
    loop = NodeLoop(node_scheduler(policy, profile, cfg.lemix, 0), cfg.lora.dpo_beta, cfg.lora.max_len)
    pipe = NodePipeline(loop, proc, dist)
    eos = load_tokenizer(cfg.model_loading_config.model_id).eos_token_ids
    arrivals = sorted([(r.at_s, 0, i) for i, r in enumerate(spec.requests)] +
                      [(t.at_s, 1, i) for i, t in enumerate(spec.training)])
    served: dict[int, ServedRequest] = {}
    report_events, token_times, losses = [], {}, {}
    while arrivals or not loop.idle or len(losses) < len(spec.training):
        now = pipe.now()
        while arrivals and arrivals[0][0] <= now:
            _, is_train, i = arrivals.pop(0)
            if is_train:
                samples = spec.training[i].samples
                length = max(len(p) + len(c) for p, c in samples)
                loop.train(OnlineTask(1_000_000 + i, "train", now, length, len(samples)), samples, now)
            else:
                r = spec.requests[i]
                params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed,
                                        ignore_eos=r.ignore_eos)
                task = OnlineTask(i, "inference", now, len(r.prompt), max_tokens=r.max_tokens)
                served[i] = ServedRequest(task, list(r.prompt), params, seed=r.seed,
                                          stop_ids=stop_token_set(params, eos), base=r.base)
                loop.serve(served[i], now)
        pipe.turn(wait_s=min(0.05, max(0.0, arrivals[0][0] - now)) if arrivals else 0.05)
        report = loop.take_report()
        report_events.extend(report.events)
        for event, _ in report.events:
            if type(event) is OpDone and event.loss is not None:
                losses[event.seq] = event.loss
        for t in report.tokens:
            token_times.setdefault(t.task_id, []).append(pipe.now())
        if pipe.now() > spec.timeout_s:
            raise TimeoutError(f"the node did not finish its work within {spec.timeout_s:g} s")
    pipe.close()

    return {"tokens": {i: list(q.generated) for i, q in served.items()},
            "finish": {i: q.finish_reason for i, q in served.items()},
            "token_times": token_times, "losses": [losses[k] for k in sorted(losses)],
            "report": NodeReport(0, report_events), "ops_run": pipe.ops_run, "lora": _lora(stage_model)}


def run_node(spec: NodeRunSpec) -> NodeRunResult:
    """Run ``spec``'s work on one node of ``config.stages`` stage processes (spawned)."""
    from raycolo.online.config import OnlineConfig

    stages = OnlineConfig.model_validate(spec.config).stages
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_stage_main, args=(rank, spec, store, out), daemon=True)
                 for rank in range(stages)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            while len(results) < stages:
                try:
                    rank, value = out.get(timeout=spec.answer_timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"the node's stages did not answer within {spec.answer_timeout_s:g} s") from None
                if isinstance(value, BaseException):
                    raise value
                results[rank] = value
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    first = results[0]
    lora = {0: first["lora"], **{r: results[r]["lora"] for r in range(1, stages)}}
    return NodeRunResult(first["tokens"], first["finish"], first["token_times"],
                         dict(enumerate(first["losses"])), first["report"], first["ops_run"], lora)

