"""Which engine each GPU's engine actor holds, and what giving GPUs a model costs.

The runtime keeps one engine actor per placement (a tuple of GPU ids) alive across
stages. A replica started on exactly the GPUs an actor holds takes it over: a *keep*
when the actor holds that engine already, a *wake* when the actor parked it asleep
earlier, a *swap* (a new engine in the same process) otherwise. A replica on GPUs no
actor holds exactly is a *cold* start: a new actor, and the actors on any of those GPUs
are stopped. A swapped-out or woken-over engine is parked (the least recently used one
released beyond ``max_parked``).

:class:`LoadCosts` carries the runtime's measured seconds for each way, the parking
limit and what the actors hold when planning starts. The planner follows the actors'
engines stage by stage (:func:`start`) and charges each new replica by :func:`switch_kind`;
without :class:`LoadCosts` (``raycolo plan``, ``--replica-start-s``) every load costs the
profile's load time plus one start cost, as before. Pure Python: the runtime's
``EngineActor.swap`` and ``Controller`` do the same for real.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

EngineKey = tuple[str, int]          # (the node's model id, tp): one engine config


@dataclass(frozen=True)
class HeldEngines:
    """The engine actor on ``gpus``: the engine it serves with and those it parked asleep
    (least recently used first)."""

    gpus: tuple[int, ...]
    held: Optional[EngineKey]
    parked: tuple[EngineKey, ...] = ()


Actors = tuple[HeldEngines, ...]     # sorted by GPUs; hashable, so part of a state's key

SWITCH_KINDS = ("cold", "swap", "wake", "keep")


@dataclass(frozen=True)
class LoadCosts:
    """Seconds each way of giving GPUs a model costs beyond nothing: ``cold`` and ``swap``
    are added to the profile's load time (a model is loaded), ``wake`` and ``keep`` are
    all a wake or a keep costs (nothing is loaded). ``node_models`` names each node's
    engine (its checkpoint or catalog model; absent: the catalog model)."""

    cold_s: float
    swap_s: float
    wake_s: float
    keep_s: float
    max_parked: int = 0
    actors: Actors = ()
    node_models: Mapping[str, str] = field(default_factory=dict)

    def seconds(self, kind: str, profile_load_s: float) -> float:
        loaded = kind in ("cold", "swap")
        return (profile_load_s if loaded else 0.0) + getattr(self, f"{kind}_s")

    def cheapest(self, profile_load_s: float) -> float:
        return min(self.seconds(kind, profile_load_s) for kind in SWITCH_KINDS)


def switch_kind(actors: Actors, gpus: tuple[int, ...], key: EngineKey) -> str:
    """How a replica of engine ``key`` on ``gpus`` gets its engine."""
    for a in actors:
        if a.gpus == gpus:
            return "keep" if a.held == key else "wake" if key in a.parked else "swap"
    return "cold"


def park(parked: tuple, engine, max_parked: int, tp: int = 1) -> tuple[tuple, tuple]:
    """The one parking rule (the planner's :func:`start` and ``EngineActor.swap``): the
    engines parked, least recently used first, after ``engine`` is parked, and those
    released to make room, so that at most ``max_parked`` stay; with ``max_parked`` 0,
    ``engine`` itself is released, and so is a tensor-parallel one (``tp`` > 1: its ranks
    hold the process's process group, which the next engine's ranks need). Any hashable
    key names an engine."""
    if max_parked <= 0 or tp > 1:
        return tuple(parked), (engine,)
    drop = max(0, len(parked) + 1 - max_parked)
    return tuple(parked[drop:]) + (engine,), tuple(parked[:drop])


def start(actors: Actors, gpus: tuple[int, ...], key: EngineKey, max_parked: int) -> Actors:
    """The actors after a replica of ``key`` started on ``gpus`` (as ``EngineActor.swap``
    and the controller's cold start do)."""
    kind = switch_kind(actors, gpus, key)
    if kind == "keep":
        return actors
    if kind == "cold":
        kept = [a for a in actors if not set(a.gpus) & set(gpus)]
        return tuple(sorted(kept + [HeldEngines(gpus, key)], key=lambda a: a.gpus))
    out = []
    for a in actors:
        if a.gpus == gpus:
            parked = tuple(k for k in a.parked if k != key)     # a wake takes it out first
            if a.held is not None:
                parked = park(parked, a.held, max_parked, tp=a.held[1])[0]
            a = HeldEngines(gpus, key, parked)
        out.append(a)
    return tuple(out)
