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
from dataclasses import dataclass, field
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


@dataclass
class SwitchCosts:
    """Seconds each way of giving a GPU a model cost, as measured on this cluster:
    ``cold`` a new engine actor (placement group, process start, imports, the probe
    model), ``swap`` another model in a pooled actor, ``keep`` the same model again.
    :meth:`estimate` is the low median of the samples, so one slow sample (a busy
    machine) does not set the plan's load times."""

    cold: list[float] = field(default_factory=list)
    swap: list[float] = field(default_factory=list)
    keep: list[float] = field(default_factory=list)
    how: str = "measured"

    def estimate(self, kind: str) -> Optional[float]:
        samples = getattr(self, kind)
        return statistics.median_low(samples) if samples else None

    def as_dict(self) -> dict:
        return {"how": self.how, **{k: {"estimate_s": self.estimate(k), "samples_s": getattr(self, k)}
                                    for k in ("cold", "swap", "keep")}}


def start_pool(run: PreparedRun, gpus: int, swaps: int = 2, retries: int = 1) -> tuple[list, SwitchCosts]:
    """Start one warm engine actor per GPU (each in a one-GPU placement group, with the
    app's largest tiny model) the way a stage starts replicas, and time it: the cold
    starts, then ``swaps`` swaps (another seed: a real load) and one keep on each actor.
    Returns the pooled actors for the controller (GPU ``i`` gets actor ``i``) and the
    :class:`SwitchCosts`. An actor that dies meanwhile gives no sample and is not pooled;
    if all die the start runs again ``retries`` times."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raycolo.actors.controller import Pooled, stop_actor

    model = _probe_model(run)

    def config(seed: int) -> dict:
        return {"model_loading_config": {"model_id": model, "seed": seed},
                "engine_kwargs": {"cpu_threads": 1, "device": "auto"}}

    started = time.perf_counter()
    token = uuid.uuid4().hex[:8]
    groups = [placement_group([{"GPU": 1}]) for _ in range(gpus)]
    actors = [EngineActor.options(
        name=f"raycolo-pool-{i}~{token}", num_gpus=1, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote(config(0), f"raycolo-pool-{i}") for i, pg in enumerate(groups)]
    costs, alive, died = SwitchCosts(), {}, []
    pending = {a.info.remote(): i for i, a in enumerate(actors)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(done[0])
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError as exc:   # killed (or out of memory): no sample
            died.append(exc)
            continue
        costs.cold.append(time.perf_counter() - started)
        alive[i] = actors[i]
    steps = [("swap", config(1 + k % 2)) for k in range(swaps)] + [("keep", config(1 + (swaps - 1) % 2))]
    for kind, cfg in steps:
        calls = {actor.swap.remote(cfg, f"raycolo-pool-{i}"): i for i, actor in alive.items()}
        for ref, i in calls.items():
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                died.append(exc)
                del alive[i]
                continue
            getattr(costs, info["switch"]).append(info["load_s"])
    for i, pg in enumerate(groups):
        if i not in alive:
            stop_actor(actors[i], pg)
    if not alive:
        if retries > 0:
            return start_pool(run, gpus, swaps, retries - 1)
        raise RuntimeError(f"every pool actor died while starting: {died[-1]}")
    pooled = [Pooled((i,), groups[i], actor) for i, actor in alive.items()]
    return pooled, costs


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
    pooled = []
    if config.replica_start_s is None:
        pooled, costs = start_pool(run, gpus)
        log(f"warm pool of {len(pooled)} engine actors: cold start {costs.estimate('cold'):.2f}s, "
            f"swap {costs.estimate('swap'):.3f}s, keep {costs.estimate('keep'):.4f}s "
            f"(low medians of {len(costs.cold)}/{len(costs.swap)}/{len(costs.keep)} samples)")
        replica_start_s, cold_start_s = costs.estimate("swap"), costs.estimate("cold")
    else:
        replica_start_s = cold_start_s = config.replica_start_s
        costs = SwitchCosts(cold=[cold_start_s], swap=[replica_start_s], keep=[], how="given (--replica-start-s)")
    workload = run.workload
    if skipped:  # plan only what the journal does not hold
        from raycolo.runtime.remaining import remaining_workload
        workload = remaining_workload(run.workload, {n: run.communicator.node_done(n)
                                                     for n in run.workload.nodes})
    problem = PlanningProblem(workload, cluster, profile_dir=run.profile_dir,
                              max_num_seqs=config.max_num_seqs, replica_start_s=replica_start_s,
                              cold_start_s=cold_start_s)
    plan = get_policy(config.policy)(problem)
    log(f"plan ({plan.policy}): {len(plan.stages)} stages, predicted makespan "
        f"{plan.makespan_s:.1f}s on {gpus} GPUs, searched in {plan.search_s:.2f}s")
    controller = Controller(run, problem, plan, on_output=on_output)
    controller.pool = {p.gpus: p for p in pooled}
    try:
        controller.execute()
    finally:
        run.store.close()
    report = build_report(run, problem, plan, controller.summary(), replica_start_s,
                          probed=config.replica_start_s is None, skipped=skipped,
                          switch_costs=costs.as_dict())
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

