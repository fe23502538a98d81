"""Gantt chart of a plan: GPUs against time, coloured by node, loads hatched."""
from __future__ import annotations

from pathlib import Path

from raycolo.planner.schedule import AppPlan


def plot_gantt(plan: AppPlan, path: str | Path, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    nodes = sorted({m.node for s in plan.stages for m in s.models},
                   key=lambda n: min(i for i, s in enumerate(plan.stages) for m in s.models if m.node == n))
    cmap = plt.get_cmap("tab20" if len(nodes) > 10 else "tab10")
    colour = {n: cmap(i % cmap.N) for i, n in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * plan.gpus))
    for stage in plan.stages:
        for m in stage.models:
            for gpus in m.replica_gpus:
                for gpu in gpus:
                    load_end = min(stage.start_s + m.load_s, stage.end_s)
                    if m.load_s > 0:
                        ax.broken_barh([(stage.start_s, load_end - stage.start_s)], (gpu - 0.4, 0.8),
                                       facecolors=colour[m.node], alpha=0.35, hatch="///",
                                       edgecolor="black", linewidth=0.3)
                    ax.broken_barh([(load_end, stage.end_s - load_end)], (gpu - 0.4, 0.8),
                                   facecolors=colour[m.node], edgecolor="black", linewidth=0.3)
        ax.axvline(stage.end_s, color="grey", linewidth=0.4, linestyle=":")
    ax.set_yticks(range(plan.gpus))
    ax.set_yticklabels([f"GPU {g}" for g in range(plan.gpus)])
    ax.set_ylim(plan.gpus - 0.5, -0.5)
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, plan.makespan_s * 1.01 if plan.makespan_s else 1)
    ax.set_title(title or f"{plan.policy}: makespan {plan.makespan_s:.1f}s "
                 f"(lower bound {plan.lower_bound_s:.1f}s), {len(plan.stages)} stages")
    handles = [Patch(facecolor=colour[n], label=n) for n in nodes]
    handles.append(Patch(facecolor="white", hatch="///", edgecolor="black", label="loading"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
