"""Gantt charts: GPUs against time, coloured by node, loads hatched.

A chart is drawn from segments ``(gpu, start, load_end, end, node)``: a plan's stages
give them, and so does a real run (replica started, ready, stopped), so the planned and
the actual schedule are drawn the same way, one above the other.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from raycolo.offline.planner.schedule import AppPlan
from raycolo.plots import pyplot, save_figure

Segment = tuple[int, float, float, float, str]


def plan_segments(plan: AppPlan) -> list[Segment]:
    out = []
    for stage in plan.stages:
        for m in stage.models:
            load_end = min(stage.start_s + m.load_s, stage.end_s)
            out.extend((gpu, stage.start_s, load_end, stage.end_s, m.node)
                       for gpus in m.replica_gpus for gpu in gpus)
    return out


def _colours(plt, segment_lists: Iterable[list[Segment]]) -> dict[str, object]:
    nodes: list[str] = []
    for segments in segment_lists:
        for seg in sorted(segments, key=lambda s: s[1]):
            if seg[4] not in nodes:
                nodes.append(seg[4])
    cmap = plt.get_cmap("tab20" if len(nodes) > 10 else "tab10")
    return {n: cmap(i % cmap.N) for i, n in enumerate(nodes)}


def _draw(ax, segments: list[Segment], colour: dict, gpus: int, title: str,
          boundaries: Iterable[float] = (), x_max: Optional[float] = None) -> None:
    for gpu, start, load_end, end, node in segments:
        if load_end > start:
            ax.broken_barh([(start, load_end - start)], (gpu - 0.4, 0.8), facecolors=colour[node],
                           alpha=0.35, hatch="///", edgecolor="black", linewidth=0.3)
        if end > load_end:
            ax.broken_barh([(load_end, end - load_end)], (gpu - 0.4, 0.8), facecolors=colour[node],
                           edgecolor="black", linewidth=0.3)
    for t in boundaries:
        ax.axvline(t, color="grey", linewidth=0.4, linestyle=":")
    ax.set_yticks(range(gpus))
    ax.set_yticklabels([f"GPU {g}" for g in range(gpus)])
    ax.set_ylim(gpus - 0.5, -0.5)
    end = x_max if x_max is not None else max((s[3] for s in segments), default=1.0)
    ax.set_xlim(0, end * 1.01 if end else 1)
    ax.set_title(title, fontsize=10)


def _save(fig, ax, colour: dict, path: str | Path) -> Path:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=n) for n, c in colour.items()]
    handles.append(Patch(facecolor="white", hatch="///", edgecolor="black", label="loading"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return save_figure(fig, path)


def plot_gantt(plan: AppPlan, path: str | Path, title: str | None = None) -> Path:
    plt = pyplot()
    segments = plan_segments(plan)
    colour = _colours(plt, [segments])
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * plan.gpus))
    _draw(ax, segments, colour, plan.gpus,
          title or f"{plan.policy}: makespan {plan.makespan_s:.1f}s "
                   f"(lower bound {plan.lower_bound_s:.1f}s), {len(plan.stages)} stages",
          [s.end_s for s in plan.stages], plan.makespan_s)
    ax.set_xlabel("time (s)")
    return _save(fig, ax, colour, path)


def plot_planned_vs_actual(plan: AppPlan, actual: list[Segment], actual_makespan_s: float,
                           boundaries: Iterable[float], path: str | Path) -> Path:
    """The plan above, what really ran below, on one time axis."""
    plt = pyplot()
    planned = plan_segments(plan)
    colour = _colours(plt, [planned, actual])
    gpus = max(plan.gpus, 1 + max((s[0] for s in actual), default=0))
    x_max = max(plan.makespan_s, actual_makespan_s)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 2.2 + 0.9 * gpus), sharex=True)
    _draw(top, planned, colour, gpus, f"planned ({plan.policy}): {plan.makespan_s:.1f}s",
          [s.end_s for s in plan.stages], x_max)
    _draw(bottom, actual, colour, gpus, f"actual: {actual_makespan_s:.1f}s", boundaries, x_max)
    bottom.set_xlabel("time (s)")
    return _save(fig, top, colour, path)
