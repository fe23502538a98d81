"""``raycolo sweep-online``: policies across request rates and training rates, with the
paper's Figure 11/12-style plots (throughput and SLO attainment against rate)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import NodeProfile
from raycolo.online.simulation.sim import simulate
from raycolo.online.tasks import poisson_workload
from raycolo.plots import pyplot, save_figure


def sweep(profile: NodeProfile, nodes: int, policies: Sequence[str], rates: Sequence[float],
          train_rates: Sequence[float], tasks: int, seed: int, lengths: str = "hh-rlhf",
          params: Optional[LemixParams] = None,
          progress: Optional[Callable[[str], None]] = None,
          make_policy: Optional[Callable] = None) -> list[dict]:
    """One row per (rate, training rate, policy); every policy sees the same tasks.
    ``make_policy(name, params, nodes=, train_rate=)`` builds a policy by name
    (``raycolo.policies.make_online_policy``)."""
    if make_policy is None:
        raise ValueError("sweep: make_policy is required (raycolo.policies.make_online_policy)")
    params = params or LemixParams()
    rows = []
    for alpha in train_rates:
        for rate in rates:
            workload = poisson_workload(rate, alpha, tasks, lengths=lengths, seed=seed)
            for policy in policies:
                if progress:
                    progress(f"rate {rate:g} rps, training {alpha:.0%}: {policy}")
                result = simulate(workload, profile, nodes,
                                  make_policy(policy, params, nodes=nodes, train_rate=alpha), params)
                rows.append({"rate": rate, "train_rate": alpha, **result.summary()})
    return rows


def format_tables(rows: list[dict], policies: Sequence[str]) -> str:
    out = []
    for metric, title, fmt in (("throughput", "throughput (tasks/s)", "{:>10.2f}"),
                               ("slo_attainment", "SLO attainment", "{:>10.1%}")):
        out.append(f"\n{title}")
        out.append(f"{'rate':>6} {'train':>6} " + " ".join(f"{p:>10}" for p in policies))
        cells = {(r["rate"], r["train_rate"], r["policy"]): r[metric] for r in rows}
        for rate, alpha in sorted({(r["rate"], r["train_rate"]) for r in rows}, key=lambda k: (k[1], k[0])):
            out.append(f"{rate:>6g} {alpha:>6.0%} " + " ".join(
                fmt.format(cells[(rate, alpha, p)]) for p in policies))
    return "\n".join(out)


def plot(rows: list[dict], policies: Sequence[str], out_dir: str | Path, title: str) -> list[Path]:
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    alphas = sorted({r["train_rate"] for r in rows})
    paths = []
    for metric, label, name in (("throughput", "throughput (tasks/s)", "throughput.png"),
                                ("slo_attainment", "SLO attainment", "slo_attainment.png")):
        fig, axes = plt.subplots(1, len(alphas), figsize=(4 * len(alphas), 3.2), squeeze=False)
        for ax, alpha in zip(axes[0], alphas):
            for policy in policies:
                pts = sorted((r["rate"], r[metric]) for r in rows
                             if r["train_rate"] == alpha and r["policy"] == policy)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
            ax.set_title(f"training rate {alpha:.0%}", fontsize=9)
            ax.set_xlabel("request rate (rps)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title, fontsize=10)
        paths.append(save_figure(fig, out_dir / name))
    return paths


def plot_timeline(result, path: str | Path, title: str) -> Path:
    """Active nodes over time, and each inference task's TTFT against the SLO."""
    import numpy as np

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=False)
    times = [t for t, _ in result.active_nodes]
    counts = [c for _, c in result.active_nodes]
    top.step(times, counts, where="post")
    top.set_ylabel("active nodes")
    top.set_xlabel("time (s)")
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)
    ttft = np.sort(result.ttft_s)
    bottom.plot(ttft, np.arange(1, len(ttft) + 1) / max(len(ttft), 1))
    bottom.axvline(result.slo_s, color="red", linestyle="--", label=f"SLO {result.slo_s * 1e3:.0f} ms")
    bottom.set_xlabel("TTFT (s)")
    bottom.set_ylabel("fraction of requests")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    return save_figure(fig, path)
