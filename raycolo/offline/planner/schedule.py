"""Plans as data: the stages a policy chose, in the JSON shape the CLI promises."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class PlannedModel:
    node: str
    model: str
    dp: int
    tp: int
    gpus: list[int]
    replica_gpus: list[list[int]]
    load_s: float          # seconds spent loading at the stage start (0: kept from before)
    reloaded: bool
    finishes: bool         # this node finishes within the stage
    requests_done: int     # requests of this node completed during the stage
    # per replica, how it gets its engine (cold, swap, wake, keep: raycolo.offline.planner.engines)
    # where the planner followed the runtime's engine actors; else empty
    switches: list[str] = field(default_factory=list)


@dataclass
class PlanStage:
    start_s: float
    end_s: float
    models: list[PlannedModel]


@dataclass
class AppPlan:
    policy: str
    makespan_s: float
    search_s: float
    lower_bound_s: float
    stages: list[PlanStage]
    node_finish_s: dict[str, float]
    simulations: int = 0
    gpus: int = 0
    notes: list[str] = field(default_factory=list)
    # True only when a complete branch and bound showed no plan in the stage space is
    # shorter (``optimal``, or ``samullm-search`` on a small problem); then
    # ``lower_bound_s`` is the makespan itself.
    proven_optimal: bool = False
    # makespan / lower_bound_s - 1 where a search bounded the optimum (None: not searched)
    optimality_gap: Optional[float] = None
    # per (model, tp) the plan runs: the engine profile its costs came from, or the
    # roofline defaults (PlanningProblem.cost_sources)
    costed_from: list[dict] = field(default_factory=list)

    @property
    def end_to_end_s(self) -> float:
        return self.search_s + self.makespan_s

    def costed_from_lines(self) -> list[str]:
        """One line per source of the plan's costs: the (model, tp)s it costs, then what it is."""
        by_note: dict[str, list[str]] = {}
        for c in self.costed_from:
            where = f" ({Path(c['file']).parent})" if c["file"] else ""
            by_note.setdefault(c["note"] + where, []).append(f"{c['model']} tp{c['tp']}")
        return [f"costed from: {', '.join(models)}: {note}" for note, models in by_note.items()]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["end_to_end_s"] = self.end_to_end_s
        out["gap_to_lower_bound"] = self.makespan_s / self.lower_bound_s - 1 if self.lower_bound_s else None
        return out

    def selections(self) -> list[dict[str, tuple[int, int]]]:
        """Each stage as {node: (dp, tp)}: what replay and the runtime execute."""
        return [{m.node: (m.dp, m.tp) for m in s.models} for s in self.stages]
