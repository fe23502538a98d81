"""Run an application on a Ray cluster: connect, plan, execute, report.

Used by ``jobs/run_dag.py`` (``ray job submit``) and by ``raycolo run`` (an embedded
local cluster). Everything that can be wrong with the inputs is checked by
:func:`raycolo.runtime.setup.prepare` before Ray is touched.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from typing import Callable, Optional

import ray

from raycolo.actors.local_cluster import start_local
from raycolo.actors.engine_actor import EngineActor
from raycolo.errors import ConfigError
from raycolo.planner.problem import PlanningProblem
from raycolo.runtime.setup import PreparedRun, RunConfig, prepare

PROBE_MODEL = "tiny-llama-s"


def connect(config: RunConfig, local_gpus: Optional[int] = None) -> None:
    """Join the cluster the job runs on, or start a local one with logical GPUs.

    Inside ``ray job submit`` (``RAY_ADDRESS`` is set) or with ``--address``, this joins
    that cluster. Otherwise it starts a private local cluster declaring ``local_gpus``
    GPUs; ``address="local"`` ignores a stale ``ray_current_cluster`` file left by
    ``ray stop``.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if config.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=config.address, log_to_driver=False)
        return
    gpus = local_gpus or config.gpus or 2
    start_local(num_gpus=gpus, num_cpus=gpus + 2, include_dashboard=False, log_to_driver=False)


def cluster_gpus() -> int:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus <= 0:
        raise ConfigError("--gpus: the Ray cluster has no GPUs; start it with "
                          "'ray start --head --num-gpus N' (logical GPUs work on a CPU machine)")
    return gpus


def probe_replica_start(run: PreparedRun, concurrent: int = 2, retries: int = 1) -> float:
    """Seconds from asking for engine actors to their first answer (placement group,
    process start, imports, a tiny engine), with ``concurrent`` started the way a stage
    start starts replicas; the median of those that answered (a probe whose process died
    gives no sample; with none, the probe runs again ``retries`` times). Real models add
    their profiled load time on top."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    model = _probe_model(run)
    started = time.perf_counter()
    groups = [placement_group([{"GPU": 1}]) for _ in range(concurrent)]
    token = uuid.uuid4().hex[:8]
    actors = [EngineActor.options(
        name=f"raycolo-probe-{i}~{token}",
        num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote({"model_loading_config": {"model_id": model},
              "engine_kwargs": {"cpu_threads": 1, "device": "cpu"}}, f"raycolo-probe-{i}")
        for i, pg in enumerate(groups)]
    pending = {a.info.remote(): a for a in actors}
    times, died = [], []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        actor = pending.pop(done[0])
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError as exc:   # a probe killed (or out of memory): no sample
            died.append(exc)
            continue
        times.append(time.perf_counter() - started)
        actor.__ray_terminate__.remote()  # graceful: no SIGTERM noise
    for pg in groups:
        remove_placement_group(pg)
    if not times:
        if retries > 0:
            return probe_replica_start(run, concurrent, retries - 1)
        raise RuntimeError(f"every replica-start probe died: {died[-1]}")
    return statistics.median(times)


def _probe_model(run: PreparedRun) -> str:
    """The app's largest tiny model (building its random weights is part of the start),
    or the smallest tiny model when the app runs checkpoints (their load is profiled)."""
    from raycolo.catalog import get_model
    from raycolo.engines.models import MAX_RANDOM_PARAMS

    tiny = [get_model(n.model) for n in run.app.nodes if n.checkpoint is None]
    tiny = [m for m in tiny if m.hf_architecture and m.num_params <= MAX_RANDOM_PARAMS]
    return max(tiny, key=lambda m: m.num_params).name if tiny else PROBE_MODEL


def run_application(config: RunConfig, on_output: Optional[Callable] = None,
                    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    """Run ``config.dag`` end to end; returns the report (also written to report.json)."""
    from raycolo.actors.controller import Controller
    from raycolo.policies import get_policy
    from raycolo.runtime.report import build_report, write_report

    run = prepare(config)
    total, skipped = run.communicator.total, run.communicator.done
    log(f"{run.app.name}: {total} requests over {len(run.workload.nodes)} nodes"
        + (f", {skipped} already done in {config.output} (resuming)" if skipped else ""))
    connect(config)
    gpus = config.gpus or cluster_gpus()
    cluster = run.cluster(gpus)
    if config.replica_start_s is None:
        replica_start_s = probe_replica_start(run, concurrent=min(gpus, 4))
        log(f"replica start measured: {replica_start_s:.1f}s")
    else:
        replica_start_s = config.replica_start_s
    workload = run.workload
    if skipped:  # plan only what the journal does not hold
        from raycolo.runtime.remaining import remaining_workload
        workload = remaining_workload(run.workload, {n: run.communicator.node_done(n)
                                                     for n in run.workload.nodes})
    problem = PlanningProblem(workload, cluster, profile_dir=run.profile_dir,
                              max_num_seqs=config.max_num_seqs, replica_start_s=replica_start_s)
    plan = get_policy(config.policy)(problem)
    log(f"plan ({plan.policy}): {len(plan.stages)} stages, predicted makespan "
        f"{plan.makespan_s:.1f}s on {gpus} GPUs, searched in {plan.search_s:.2f}s")
    controller = Controller(run, problem, plan, on_output=on_output)
    try:
        controller.execute()
    finally:
        run.store.close()
    report = build_report(run, problem, plan, controller.summary(), replica_start_s,
                          probed=config.replica_start_s is None, skipped=skipped)
    path = write_report(run, plan, controller.segments(), report)
    log(f"done: {report['requests_done']}/{report['requests_total']} requests, actual makespan "
        f"{report['actual_makespan_s']:.1f}s vs predicted {report['predicted_makespan_s']:.1f}s "
        f"({report['prediction_error']:+.1%})")
    report["report_path"] = str(path)
    return report


def report_line(report: dict) -> str:
    return f"report: {report['report_path']}"


def dump(report: dict) -> str:
    return json.dumps(report, indent=2, default=str)

