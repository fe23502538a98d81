"""Run an application on a Ray cluster: connect, plan, execute, report.

Used by ``jobs/run_dag.py`` (``ray job submit``) and by ``raycolo run`` (an embedded
local cluster). Everything that can be wrong with the inputs is checked by
:func:`raycolo.offline.runtime.setup.prepare` before Ray is touched.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable, Optional

import ray

from raycolo.actors.local_cluster import join_or_start
from raycolo.actors.offline.gpu_nodes import GpuNodes
from raycolo.actors.offline.pool import ComputeScales, SwitchCosts, load_costs, start_pool
from raycolo.errors import ConfigError
from raycolo.offline.planner.engines import SWITCH_KINDS
from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.runtime.setup import RunConfig, prepare


def connect(config: RunConfig, local_gpus: Optional[int] = None) -> None:
    """Join the cluster the job runs on, or start a local one with logical GPUs.

    Inside ``ray job submit`` (``RAY_ADDRESS`` is set) or with ``--address``, this joins
    that cluster (:func:`join_cluster`: a cluster that does not answer is a ConfigError
    naming ``--address`` within seconds). Otherwise it starts a private local cluster declaring ``local_gpus``
    GPUs (else ``--gpus``, else the machine's own by NVML, else 2 logical ones; never more than
    the machine has where it has any); ``address="local"`` ignores a stale ``ray_current_cluster`` file left by
    ``ray stop``.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    from raycolo.engine.device_stats import LOGICAL_GPUS, local_cluster_gpus, physical_gpus

    gpus = local_gpus or config.gpus
    address = config.address or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":     # a local cluster (else Ray ignores both counts)
        gpus = local_cluster_gpus(gpus, physical_gpus())
    gpus = gpus or LOGICAL_GPUS
    join_or_start(address, num_gpus=gpus, num_cpus=gpus + 2,
                  include_dashboard=False, log_to_driver=False, namespace=None)


def cluster_gpus() -> int:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus <= 0:
        raise ConfigError("--gpus: the Ray cluster has no GPUs; start it with "
                          "'ray start --head --num-gpus N' (logical GPUs work on a CPU machine)")
    return gpus


def run_application(config: RunConfig, on_output: Optional[Callable] = None,
                    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    """Run ``config.dag`` end to end; returns the report (also written to report.json).

    When the cluster loses GPUs mid-run (a node leaves; the controller notices within
    ``config.node_loss_s``), every actor is stopped and what the journal does not hold is
    planned again on the GPUs that remain, as a resume would (nothing journaled runs
    twice; requests that were in flight run again). No GPU left: :class:`RunFailed`."""
    from raycolo.actors.offline.failures import CapacityLost, RunFailed

    replans: list[dict] = []
    state: dict = {}
    while True:
        try:
            return _run_once(config, on_output, log, replans, state)
        except CapacityLost as exc:
            if exc.gpus_left <= 0:
                raise RunFailed(f"{exc}; no GPU is left to plan on (resubmit with the same "
                                f"--output to resume)") from None
            gpus = min(exc.gpus_left, config.gpus or exc.gpus_left)
            group = math.gcd(config.nvlink_group, gpus) if config.nvlink_group else None
            replans.append({"gpus_before": exc.gpus_before, "gpus_after": gpus,
                            "lost_nodes": exc.lost_nodes, "reason": str(exc),
                            "requests_done_before": state.get("done", 0)})
            log(f"{exc}; planning what is left on {gpus} GPUs")
            config = config.model_copy(update={
                "gpus": gpus, "nvlink_group": group,
                # no warm pool again: the first start's measured cold start prices every replica
                "replica_start_s": config.replica_start_s if config.replica_start_s is not None
                else state.get("cold_start_s")})


def _run_once(config: RunConfig, on_output: Optional[Callable], log: Callable[[str], None],
              replans: list[dict], state: dict) -> dict:
    from raycolo.actors.offline.controller import Controller
    from raycolo.offline.planner.replay import replay
    from raycolo.offline.policies import get_policy
    from raycolo.offline.runtime.report import build_report, write_report

    run = prepare(config)
    total, skipped = run.communicator.total, run.communicator.done
    log(f"{run.app.name}: {total} requests over {len(run.workload.nodes)} nodes"
        + (f", {skipped} already done in {config.output} (resuming)" if skipped else ""))
    if total and skipped >= total:
        return _already_done(run, log)
    connect(config)
    gpus = config.gpus or cluster_gpus()
    cluster = run.cluster(gpus)
    nodes = GpuNodes.of_cluster(gpus)        # planner GPU ids in blocks per Ray node (gpu_nodes.py)
    straddling = nodes.straddling(cluster.nvlink_group)
    if straddling:
        log(f"note: NVLink groups of {cluster.nvlink_group} GPUs straddle Ray nodes (planner GPUs "
            + ", ".join("/".join(map(str, g)) for g in straddling[:4]) + "): their replicas span nodes; "
            "--nvlink-group should divide each node's GPUs")
    workload = run.workload
    if skipped:  # plan only what the journal does not hold
        from raycolo.offline.runtime.remaining import remaining_workload
        workload = remaining_workload(run.workload, {n: run.communicator.node_done(n)
                                                     for n in run.workload.nodes})
    profiled = PlanningProblem(run.workload, cluster, profile_dir=run.profile_dir,
                               max_num_seqs=config.max_num_seqs)
    models = sorted({w.model.name for w in run.workload.nodes.values()})
    pooled = []
    if config.replica_start_s is None:
        started = time.perf_counter()
        pooled, costs, scales = start_pool(run, profiled, gpus, nodes=nodes)
        measured = [k for k in SWITCH_KINDS if getattr(costs, k)]
        log(f"warm pool of {len(pooled)} engine actors in {time.perf_counter() - started:.1f}s: "
            + ", ".join(f"{k} {costs.estimate(k):.4f}s" for k in measured)
            + f" (low medians of {'/'.join(str(len(getattr(costs, k))) for k in measured)} samples)")
        replica_start_s, cold_start_s = costs.estimate("swap"), costs.estimate("cold")
        state["cold_start_s"] = cold_start_s
        switch_costs = load_costs(run, profiled, pooled, costs)
        if scales.samples:
            log("compute against the profiles: " + ", ".join(
                f"{m} x{k:.2f}" for m, k in scales.scales(models).items()))
    else:
        replica_start_s = cold_start_s = config.replica_start_s
        costs = SwitchCosts(cold=[cold_start_s], swap=[replica_start_s], keep=[], how="given (--replica-start-s)")
        scales = ComputeScales(how="not measured (--replica-start-s: no pool start): the profiles as they are")
        switch_costs = None
    costed = dict(workload=workload, cluster=cluster, profile_dir=run.profile_dir,
                  max_num_seqs=config.max_num_seqs, replica_start_s=replica_start_s,
                  cold_start_s=cold_start_s, load_costs=switch_costs)
    problem = PlanningProblem(**costed, compute_scale=scales.scales(models))
    plan = get_policy(config.policy)(problem)
    log(f"plan ({plan.policy}): {len(plan.stages)} stages, predicted makespan "
        f"{plan.makespan_s:.1f}s on {gpus} GPUs, searched in {plan.search_s:.2f}s")
    for line in plan.costed_from_lines():
        log(line)
    # the same plan as the profiles alone predict it (no compute scale): the report's
    # measure of what the pool's compute probe changed
    profile_only = replay(PlanningProblem(**costed), plan).makespan_s if scales.samples else plan.makespan_s
    controller = Controller(run, problem, plan, on_output=on_output)
    controller.pool = {p.gpus: p for p in pooled}
    controller.replica_set.gpu_nodes = nodes
    try:
        controller.execute()
    finally:
        state["done"] = run.communicator.done
        run.store.close()
    report = build_report(run, problem, plan, controller.summary(), replica_start_s,
                          probed=config.replica_start_s is None, skipped=skipped,
                          switch_costs=costs.as_dict(), compute_scales=scales.as_dict(models),
                          profile_only_makespan_s=profile_only)
    report["gpu_nodes"] = list(nodes.owners)    # the Ray node of each planner GPU id
    if replans:
        report["replans"] = replans
        report.setdefault("notes", []).extend(
            f"the cluster lost GPUs ({r['gpus_before']} -> {r['gpus_after']}) after "
            f"{r['requests_done_before']} requests were done; the rest was planned again" for r in replans)
    path = write_report(run, plan, controller.segments(), report)
    log(f"done: {report['requests_done']}/{report['requests_total']} requests, actual makespan "
        f"{report['actual_makespan_s']:.1f}s vs predicted {report['predicted_makespan_s']:.1f}s "
        f"({report['prediction_error']:+.1%})")
    report["report_path"] = str(path)
    return report


def _already_done(run, log: Callable[[str], None]) -> dict:
    """The journal in ``--output`` holds every request: nothing is planned or started. The
    outputs table is written again from the journal (a run stopped after its last output
    but before its table loses nothing); the finished run's report is returned as it is,
    or, where it never got written, a short one that says so."""
    from raycolo.offline.runtime.report import REPORT

    try:
        outputs = run.store.write_table().resolve()
    finally:
        run.store.close()
    path = run.store.dir / REPORT
    total = run.communicator.total
    note = f"all {total} requests were already done in {run.config.output}: nothing ran again"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        report = {"app": run.app.name, "requests_total": total, "requests_done": total,
                  "requests_skipped": total, "requests_run": 0, "outputs": str(outputs), "notes": [note]}
        path.write_text(json.dumps(report, indent=2))
    log(f"{run.app.name}: {note} (outputs {outputs})")
    report["report_path"] = str(path.resolve())
    report["already_done"] = True
    return report


def report_line(report: dict) -> str:
    return f"report: {report['report_path']}"


def dump(report: dict) -> str:
    return json.dumps(report, indent=2, default=str)

