"""Branch and bound over stage sequences, shared by ``optimal`` and ``samullm-search``.

The tree: a node is an :class:`AppState` between stages; its children are the stages
that may start there (by default every valid selection of ready nodes and plans, idle
GPUs allowed), each run to its first finish exactly as the greedy's stages are. So the
best leaf is the optimum of the space the greedy and the heuristics walk.

What keeps the tree small:

* **Incumbent**: the search starts from a complete plan (the caller's best heuristic)
  and only replaces it by a strictly shorter one.
* **Bound** (:class:`Bounds`): elapsed time plus the larger of (a) the critical path,
  every unfinished node's fastest remaining time on its own (load included, or what is
  left of it; a node waiting for inputs, if it has produced nothing yet, at least its
  all-inputs-ready time) and no earlier than its upstream nodes, and (b) the area bound: the least horizon D such that
  every node can finish within D while all of them together use no more than
  GPUs x D GPU-seconds, each node at its fewest GPU-seconds for a duration <= D (the
  lower convex hull of its plans' (seconds, GPU-seconds), so plans mixed over stages
  are covered). (b) is at least the plain work bound, fewest GPU-seconds over all GPUs,
  and much tighter when the cheap plans are too slow. A child is also cut when its
  stage alone ends after the incumbent.
* **Transposition table**: two stage sequences often reach the same state (e.g. model A
  then B finish in either plan order; a finished model's plan no longer matters). The
  future from a state depends only on each unfinished node's progress, loaded plan,
  GPUs and queues, not on how it got there, so states are keyed by a canonical digest of
  exactly that, and a state reached no earlier than before is dominated and cut.

Proof and gap: when the search stops early (time or work limit), every subtree it did
not finish is remembered by a lower bound (its parent's bound, or the child stage's end
if later). ``lower_bound`` is the smallest of those and the incumbent; the search is
``proven`` when nothing was left open. The bounds assume a node's remaining run cannot
get faster or cheaper in GPU-seconds by being split over stages or by waiting for its
inputs, which holds for the simulator's FCFS batching in practice but is not a theorem.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from raycolo.offline.planner.lower_bounds import area_bound, lower_hull, node_standalone_runs
from raycolo.offline.planner.problem import ExecPlan
from raycolo.offline.planner.search import SearchContext
from raycolo.offline.planner.state import AppState

EPS = 1e-9
Selections = list[dict[str, ExecPlan]]
ChildGenerator = Callable[[SearchContext, AppState], Selections]


def _iter_selections(ctx: SearchContext, state: AppState) -> Iterator[dict[str, ExecPlan]]:
    """Every non-empty selection of ready nodes (pipelining allowed) within the GPUs."""
    problem = ctx.problem
    gpus = problem.cluster.num_gpus

    def extend(i: int, chosen: dict[str, ExecPlan], used: int) -> Iterator[dict[str, ExecPlan]]:
        if i == len(problem.nodes):
            if chosen:
                yield dict(chosen)
            return
        node = problem.nodes[i]
        yield from extend(i + 1, chosen, used)
        if state.nodes[node].finished or not all(state.nodes[u].finished or u in chosen
                                                 for u in problem.upstream[node]):
            return
        for plan in problem.plans[node]:
            if used + plan.gpus <= gpus:
                chosen[node] = plan
                yield from extend(i + 1, chosen, used + plan.gpus)
                del chosen[node]

    return extend(0, {}, 0)


def all_selections(ctx: SearchContext, state: AppState) -> Selections:
    """All non-empty selections of ready nodes (pipelining allowed) within the GPUs."""
    return list(_iter_selections(ctx, state))


def count_root_selections(ctx: SearchContext, state: AppState, limit: int) -> int:
    """How many selections :func:`all_selections` yields, counting stops past ``limit``."""
    return sum(1 for _ in itertools.islice(_iter_selections(ctx, state), limit + 1))


def state_key(state: AppState, groups: Optional[list[list[int]]] = None) -> bytes:
    """A digest of everything the future depends on (not the time, not finished nodes).

    With the machine's NVLink ``groups``, GPU ids enter only as which replicas share a
    group, up to a permutation of identical groups: states that differ by relabelling
    GPUs are the same state (symmetry).
    """
    h = hashlib.blake2b(digest_size=16)
    if state.actors:   # what each GPU's actor holds sets future loads: no relabelling then
        h.update(repr(state.actors).encode())
        groups = None
    occupants: dict[int, list] = {}
    for name, st in state.nodes.items():
        h.update(name.encode())
        if st.finished:
            h.update(b"F")
            continue
        h.update(st.done.tobytes())
        h.update(st.generated.tobytes())
        h.update(repr((st.loaded, round(st.load_left, 9), None if groups else st.gpus)).encode())
        for q in st.replicas or ():
            h.update(q.requests.tobytes())
            h.update(repr((q.running, q.waiting)).encode())
        if groups and st.gpus:
            for r, gpus in enumerate(st.gpus):
                for gpu in gpus:
                    occupants.setdefault(gpu, []).append((name, r))
    if groups:
        layout = sorted(tuple(sorted(str(occupants.get(gpu)) for gpu in group)) for group in groups)
        h.update(repr(layout).encode())
    return h.digest()


class Bounds:
    """Lower bounds on the time left from a state, under the evaluator's cost model."""

    def __init__(self, ctx: SearchContext):
        self.ctx = ctx
        self.standalone = node_standalone_runs(ctx.problem, ctx.evaluator)

    def remaining(self, state: AppState) -> float:
        problem, evaluator = self.ctx.problem, self.ctx.evaluator
        path: dict[str, float] = {}
        options: list[list[tuple[float, float]]] = []  # per node: (seconds, GPU-seconds)
        for node in problem.nodes:  # topological order
            st = state.nodes[node]
            if st.finished:
                path[node] = 0.0
                continue
            waiting = any(not state.nodes[u].finished for u in problem.upstream[node])
            fresh = not st.done.any() and not st.generated.any()
            points = []
            for plan in problem.plans[node]:
                if not waiting:
                    continuing = st.loaded == plan and st.replicas is not None
                    run = evaluator.node_run(state, node, plan, continuing, {}, exact=True,
                                             load=problem.min_load_seconds(node, plan))
                elif fresh:
                    run = self.standalone[node, plan]
                else:  # partly done, inputs still coming: no cheap bound
                    points = [(0.0, 0.0)]
                    break
                end = run.end
                if waiting and st.loaded == plan and st.replicas is not None:
                    # already loaded (or loading) while it waits: only what is left of the load
                    end = max(0.0, end - run.load_s) + st.load_left
                points.append((end, end * plan.gpus))
            path[node] = max([min(t for t, _ in points)] + [path[u] for u in problem.upstream[node]])
            options.append(lower_hull(points))
        critical = max(path.values(), default=0.0)
        return max(critical, area_bound(options, problem.cluster.num_gpus, critical))


@dataclass
class TreeOutcome:
    best_time: float
    best: Selections
    proven: bool
    lower_bound_s: float          # no plan in the space finishes sooner (given the bounds)
    explored: int = 0             # stages advanced
    transpositions: int = 0       # states cut as reached no earlier than before
    improved: int = 0             # times the incumbent was replaced
    notes: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """Incumbent over lower bound, minus one (0 when proven)."""
        if self.lower_bound_s <= 0:
            return math.inf
        return max(0.0, self.best_time / self.lower_bound_s - 1)


def branch_and_bound(ctx: SearchContext, best_time: float, best: Selections,
                     stop: Callable[[], bool], children: ChildGenerator = all_selections,
                     bounds: Optional[Bounds] = None, symmetry: bool = True) -> TreeOutcome:
    """Depth-first branch and bound from the initial state, from incumbent ``best``.

    ``stop()`` is polled before each expansion; once it returns true the search unwinds,
    remembering a lower bound for every subtree left open. Deterministic: children are
    explored in a fixed order (highest stage throughput first, then by selection).
    """
    from raycolo.offline.planner.state import initial_state

    bounds = bounds or Bounds(ctx)
    root = initial_state(ctx.problem)
    table: dict[bytes, float] = {}
    groups = ctx.problem.cluster.nvlink_groups() if symmetry else None
    out = TreeOutcome(best_time, list(best), proven=True, lower_bound_s=0.0)
    open_min = math.inf
    stopped = False

    def search(state: AppState, prefix: Selections) -> None:
        nonlocal open_min, stopped
        if state.finished:
            if state.time < out.best_time - EPS:
                out.best_time, out.best = state.time, list(prefix)
                out.improved += 1
            return
        key = state_key(state, groups)
        seen = table.get(key)
        if seen is not None and state.time >= seen - EPS:
            out.transpositions += 1
            return
        table[key] = state.time
        bound = state.time + bounds.remaining(state)
        if bound >= out.best_time - EPS:
            return
        if stopped or stop():
            stopped = True
            open_min = min(open_min, bound)
            return
        evs = []
        for selection in children(ctx, state):
            ev = ctx.evaluate(state, selection, exact=True)
            if ev is not None:
                evs.append(ev)
        evs.sort(key=lambda ev: (-ev.throughput, sorted(ev.selection.items())))
        for ev in evs:
            end = state.time + ev.duration
            if end >= out.best_time - EPS:
                continue
            if stopped or stop():
                stopped = True
                open_min = min(open_min, max(bound, end))
                continue
            out.explored += 1
            search(ctx.evaluator.advance(state, ev), prefix + [ev.selection])

    search(root, [])
    out.proven = not stopped or open_min >= out.best_time - EPS
    out.lower_bound_s = out.best_time if out.proven else min(out.best_time, open_min)
    return out
