"""The warm pool's start, which is also the run's measurement of its cluster.

Before planning, :func:`start_pool` starts one engine actor per GPU (each in a one-GPU
placement group, the way a stage starts a replica) and measures, on this cluster and
under its load, the two things the shipped profiles cannot know:

* **Switch costs** (:class:`SwitchCosts`): a cold start (a new actor: placement group,
  process, imports, a model), a *swap* (another model in a pooled actor) and a *keep*
  (the same model again).
* **Compute speed** (:class:`ComputeScales`): in rounds, every actor swaps to one of the
  application's models and runs a short batch of that model's own requests (their
  prompt lengths from the workload), all actors at once, as replicas of a stage run. The
  measured time over the time the profile predicts for the same batch (the planner's
  simulator, with the output lengths the engine produced) is that model's *compute
  scale*; the plan multiplies every iteration by it. Profiles are measured on one
  machine, alone; a cluster of another speed, or replicas sharing CPU cores (logical
  GPUs), would otherwise be predicted too fast or too slow.

Each estimate is a low median of its samples, so one slow sample (a busy machine) does not
set the plan. The report gives every sample and how each estimate was obtained.
"""
from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import ray

from raycolo.engine.replica_messages import EngineRequest, ReplicaInfo
from raycolo.actors.offline.engine_actor import EngineActor, placement
from raycolo.actors.offline.gpu_nodes import GpuNodes
from raycolo.offline.planner.engines import SWITCH_KINDS, HeldEngines, LoadCosts
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.runtime.setup import PreparedRun

PROBE_MODEL = "tiny-llama-s"
PROBE_REQUESTS = 32       # requests of a compute probe (fewer if the node has fewer)
PROBE_MAX_TOKENS = 64     # tokens each probe request may generate at most; both halved
PROBE_BUDGET_S = 0.4      # (tokens down to 8 first) until the profile predicts the probe within this


@dataclass
class SwitchCosts:
    """Seconds each way of giving a GPU a model cost, as measured on this cluster:
    ``cold`` a new engine actor (placement group, process start, imports, the probe
    model), ``swap`` another model in a pooled actor, ``wake`` a model the actor parked
    asleep, ``keep`` the same model again.
    :meth:`estimate` is the low median of the samples."""

    cold: list[float] = field(default_factory=list)
    swap: list[float] = field(default_factory=list)
    wake: list[float] = field(default_factory=list)
    keep: list[float] = field(default_factory=list)
    how: str = "measured"

    def estimate(self, kind: str) -> Optional[float]:
        samples = getattr(self, kind)
        return statistics.median_low(samples) if samples else None

    def as_dict(self) -> dict:
        return {"how": self.how, **{k: {"estimate_s": self.estimate(k), "samples_s": getattr(self, k)}
                                    for k in SWITCH_KINDS}}


@dataclass
class ComputeScales:
    """Per model, the measured seconds of probe batches over the profile's prediction for
    the same batches. :meth:`scales` gives each probed model the low median of its ratios;
    a model that was not probed gets the low median over all samples (the cluster's speed
    against the profiles' machine), or none at all (the profile as it is)."""

    samples: dict[str, list[dict]] = field(default_factory=dict)
    how: str = "measured"

    def add(self, model: str, gpu: int, requests: int, measured_s: float, predicted_s: float) -> None:
        self.samples.setdefault(model, []).append(
            {"gpu": gpu, "requests": requests, "measured_s": measured_s, "predicted_s": predicted_s,
             "ratio": measured_s / predicted_s})

    def scales(self, models) -> dict[str, float]:
        ratios = {m: [s["ratio"] for s in self.samples.get(m, [])] for m in models}
        every = [r for rs in ratios.values() for r in rs]
        if not every:
            return {}
        overall = statistics.median_low(every)
        return {m: statistics.median_low(rs) if rs else overall for m, rs in ratios.items()}

    def as_dict(self, models) -> dict:
        scales = self.scales(models)
        return {"how": self.how, "models": {m: {"scale": scales.get(m), "samples": self.samples.get(m, [])}
                                            for m in models}}


@dataclass
class _Probe:
    """One model's part in the pool start: the engine config a tp1 replica of ``node``
    runs, and the requests of its compute probe."""

    model: str
    node: str
    config: dict
    requests: list[dict]
    prompt_lens: list[int]


def _probes(run: PreparedRun, problem: PlanningProblem) -> list[_Probe]:
    """One probe per model of the application, with its first node's first requests."""
    from raycolo.catalog import get_model
    from raycolo.rng import seeded_rng
    from raycolo.generation import SamplingParams
    from raycolo.generation.params import ECDF_TEMPERATURE

    probes, seen = [], set()
    for node in run.app.topological_order():
        w = run.workload.nodes.get(node)
        if w is None or w.model.name in seen:
            continue
        seen.add(w.model.name)
        limits = problem.limits(w.model.name, 1)
        if limits.blocks_for(w.max_sequence) + limits.watermark_blocks > limits.num_blocks:
            continue    # fits only with tp > 1, which the pool's one-GPU actors lack: the
            # model's compute scale is then the other models' (ComputeScales.scales)
        k, tokens = min(PROBE_REQUESTS, len(w)), min(w.max_output, PROBE_MAX_TOKENS)
        while problem.replica_seconds(w.model.name, w.input_len[:k], [tokens] * k, plain_sampling=False) \
                > PROBE_BUDGET_S:
            if tokens > 8:
                tokens //= 2
            elif k > 4:
                k //= 2
            else:
                break
        lens = [int(n) for n in w.input_len[:k]]
        rng = seeded_rng(run.config.seed, "pool-probe", node)
        vocab = get_model(w.model.name).vocab
        requests = [EngineRequest(f"probe-{i}", rng.integers(3, vocab, n).tolist(),
                                  SamplingParams(max_tokens=tokens, temperature=ECDF_TEMPERATURE, seed=i))
                    for i, n in enumerate(lens)]
        probes.append(_Probe(w.model.name, node, run.engine_config(problem, node, ExecPlan(1, 1)),
                             requests, lens))
    return probes


def _variant(config: dict, k: int) -> dict:
    """The same engine config with other random weights (seed + ``k``): a real load, the
    same compute."""
    if k == 0:
        return config
    loading = config["model_loading_config"]
    return {**config, "model_loading_config": {**loading, "seed": loading.get("seed", 0) + k}}


def start_pool(run: PreparedRun, problem: PlanningProblem, gpus: int, swaps: int = 2,
               retries: int = 1, nodes: GpuNodes = GpuNodes()) -> tuple[list, SwitchCosts, ComputeScales]:
    """Start one warm engine actor per GPU and measure the cluster (the module's doc):
    the cold starts; then rounds in which every actor swaps to a model of the app (actor
    ``i`` takes model ``i + round``; at least ``swaps`` rounds, a seeded copy of a model
    where the app has too few) and, on the torch backend, runs that model's probe batch,
    all actors at once; then (where actors park engines) one wake on each, back to the
    previous round's model, and one keep. Returns the pooled actors for the
    controller (GPU ``i`` gets actor ``i``, on the node ``nodes`` gives it), the :class:`SwitchCosts` and the
    :class:`ComputeScales`. An actor that dies meanwhile gives no more samples and is not
    pooled; if all die the start runs again ``retries`` times."""
    from ray.util.placement_group import placement_group

    from raycolo.actors.offline.replica_records import Pooled
    from raycolo.actors.offline.replicas import stop_actor

    measure_compute = run.config.backend == "torch"
    if measure_compute:
        probes = _probes(run, problem)
    else:   # swaps of the cold start's model only: loading the app's models costs more here
        probes = [_Probe(PROBE_MODEL, "", _variant(_cold_config(run), 1), [], [])]
    started = time.perf_counter()
    token = uuid.uuid4().hex[:8]
    groups = [placement_group([{"GPU": 1}], bundle_label_selector=nodes.selector((i,))) for i in range(gpus)]
    cold = _cold_config(run)
    actors = [EngineActor.options(name=f"raycolo-pool-{i}~{token}", max_restarts=0, **placement(cold, pg)
                                  ).remote(cold, f"raycolo-pool-{i}", run.config.parked_engines)
              for i, pg in enumerate(groups)]
    costs, scales, alive, died = SwitchCosts(), ComputeScales(), {}, []
    for i, _ in _each(alive, died, {a.info.remote(): (i, a) for i, a in enumerate(actors)}):
        costs.cold.append(time.perf_counter() - started)

    current: dict[int, dict] = {}
    previous: dict[int, dict] = {}
    for r in range(max(len(probes), swaps)):
        picks = {i: probes[(i + r) % len(probes)] for i in alive}
        previous = dict(current)
        current = {i: _variant(picks[i].config, r // len(probes)) for i in alive}
        _switch_all(alive, died, current, costs)
        if measure_compute:
            calls = {alive[i].time_batch.remote(picks[i].requests): i for i in alive}
            for i, out in _each(alive, died, calls):
                p = picks[i]
                outputs = [out.output_lens[q.key] for q in p.requests]
                predicted = problem.replica_seconds(p.model, p.prompt_lens, outputs, plain_sampling=False)
                scales.add(p.model, i, len(outputs), out.seconds, predicted)
    if run.config.parked_engines:   # back to the previous round's model: parked, so a wake
        current = {i: previous[i] for i in alive}
        _switch_all(alive, died, current, costs)
    held = _switch_all(alive, died, current, costs)   # the same again: a keep
    if not measure_compute:
        scales.how = f"not measured ({run.config.backend} backend): the profiles as they are"

    for i, pg in enumerate(groups):
        if i not in alive:
            stop_actor(actors[i], pg)
    if not alive:
        if retries > 0:
            return start_pool(run, problem, gpus, swaps, retries - 1, nodes)
        raise RuntimeError(f"every pool actor died while starting: {died[-1]}")
    pooled = [Pooled((i,), groups[i], actor, held[i].engine_key, tuple(held[i].parked_keys))
              for i, actor in alive.items()]
    return pooled, costs, scales


def load_costs(run: PreparedRun, problem: PlanningProblem, pooled: list, costs: SwitchCosts) -> LoadCosts:
    """What the planner charges each way of giving GPUs a model (the low medians measured;
    a wake or keep never measured costs a swap or nothing) and what each pooled actor
    holds, in the planner's terms: an engine config of the app's node ``n`` at tp1 is
    ``(model id of n, 1)``; any other (a probe's seeded copy) is ``("", 0)``, which no
    replica asks for but which takes a parking place as it does in the actor."""
    from raycolo.actors.offline.engine_actor import engine_config_key

    node_models = {n.name: n.checkpoint or n.model for n in run.app.nodes if n.name in run.workload.nodes}
    known = {engine_config_key(run.engine_config(problem, n, ExecPlan(1, 1))): (m, 1)
             for n, m in node_models.items()}
    other = ("", 0)
    actors = tuple(sorted((HeldEngines(p.gpus, known.get(p.engine_key, other),
                                       tuple(known.get(k, other) for k in p.parked_keys))
                           for p in pooled), key=lambda a: a.gpus))
    swap = costs.estimate("swap")
    wake, keep = costs.estimate("wake"), costs.estimate("keep")
    return LoadCosts(cold_s=costs.estimate("cold"), swap_s=swap, wake_s=swap if wake is None else wake,
                     keep_s=0.0 if keep is None else keep, max_parked=run.config.parked_engines,
                     actors=actors, node_models=node_models)


def _switch_all(alive: dict, died: list, configs: dict, costs: SwitchCosts) -> dict[int, ReplicaInfo]:
    """Every living actor ``i`` takes ``configs[i]``; each switch's time goes to ``costs``
    under the kind the actor reports. Returns each actor's ``info`` after its switch."""
    calls = {actor.swap.remote(configs[i], f"raycolo-pool-{i}"): i for i, actor in alive.items()}
    infos = {}
    for i, info in _each(alive, died, calls):
        getattr(costs, info.switch).append(info.load_s)
        infos[i] = info
    return infos


def _each(alive: dict, died: list, calls: dict):
    """Yield ``(i, result)`` for each call in ``calls`` ({ref: i or (i, actor)}) as it
    finishes; an actor whose call fails is dropped from ``alive`` (and its error kept)."""
    pending = dict(calls)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        key = pending.pop(done[0])
        i, actor = key if isinstance(key, tuple) else (key, None)
        try:
            result = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:   # killed (or out of memory): no sample
            died.append(exc)
            alive.pop(i, None)
            continue
        if actor is not None:
            alive[i] = actor
        yield i, result


def _cold_config(run: PreparedRun) -> dict:
    """The app's largest tiny model (building its random weights is part of the start),
    or the smallest tiny model when the app runs checkpoints (their load is profiled)."""
    from raycolo.catalog import get_model
    from raycolo.engine.models import MAX_RANDOM_PARAMS

    tiny = [get_model(n.model) for n in run.app.nodes if n.checkpoint is None]
    tiny = [m for m in tiny if m.hf_architecture and m.num_params <= MAX_RANDOM_PARAMS]
    model = max(tiny, key=lambda m: m.num_params).name if tiny else PROBE_MODEL
    return {"model_loading_config": {"model_id": model, "seed": 0},
            "engine_kwargs": {"cpu_threads": 1, "device": "auto"}}
