"""What a run writes at the end: outputs.parquet, report.json and a planned-vs-actual Gantt."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from raycolo.offline.planner.gantt import Segment, plot_planned_vs_actual
from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.runtime.setup import PreparedRun

REPORT = "report.json"
GANTT = "gantt.png"


def build_report(run: PreparedRun, problem: PlanningProblem, plan: AppPlan, summary: dict,
                 replica_start_s: float, probed: bool, skipped: int,
                 switch_costs: Optional[dict] = None, compute_scales: Optional[dict] = None,
                 profile_only_makespan_s: Optional[float] = None) -> dict:
    comm = run.communicator
    actual = summary["actual_makespan_s"]
    planned_stages = [{"start_s": s.start_s, "end_s": s.end_s,
                       "models": [{"node": m.node, "dp": m.dp, "tp": m.tp, "replica_gpus": m.replica_gpus,
                                   "load_s": m.load_s, "switches": m.switches, "finishes": m.finishes}
                                  for m in s.models]}
                      for s in plan.stages]
    report = {
        "app": run.app.name,
        "dag": str(Path(run.config.dag).resolve()),
        "input": run.config.input,
        "output_dir": str(run.store.dir.resolve()),
        "policy": plan.policy,
        "seed": run.config.seed,
        "gpus": problem.cluster.num_gpus,
        "requests_total": comm.total,
        "requests_done": comm.done,
        "requests_skipped": skipped,
        "predicted_makespan_s": plan.makespan_s,
        "actual_makespan_s": actual,
        "prediction_error": (plan.makespan_s - actual) / actual if actual else None,
        # the plan replayed on the profiles alone (no measured compute scale), and its error
        "profile_only_makespan_s": profile_only_makespan_s,
        "profile_only_error": ((profile_only_makespan_s - actual) / actual
                               if actual and profile_only_makespan_s is not None else None),
        "search_s": plan.search_s,
        "replica_start_s": replica_start_s,
        "replica_start_measured": probed,
        # what the plan charged per replica start, and how it was obtained
        "switch_costs": switch_costs,
        "compute_scales": compute_scales,
        "planned_stages": planned_stages,
        "actual_stages": summary["stages"],
        "planned_node_finish_s": plan.node_finish_s,
        "costed_from": plan.costed_from,
    }
    report.update({k: v for k, v in summary.items() if k not in ("stages", "actual_makespan_s")})
    if skipped:
        report["notes"] = [f"resumed: {skipped} requests were done by an earlier run; the plan "
                           f"and its prediction cover the {comm.total - skipped} that were left"]
    return report


def write_report(run: PreparedRun, plan: AppPlan, segments: list[Segment], report: dict) -> Path:
    out = run.store.dir
    report["outputs"] = str(run.store.write_table().resolve())
    if run.config.gantt:
        boundaries = [s["start_s"] for s in report["actual_stages"][1:]]
        report["gantt"] = str(plot_planned_vs_actual(plan, segments, report["actual_makespan_s"],
                                                     boundaries, out / GANTT).resolve())
    path = out / REPORT
    path.write_text(json.dumps(report, indent=2, default=float))
    return path.resolve()
