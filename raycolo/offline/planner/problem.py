"""A planning problem: a sampled workload, a machine and the cost model for each model."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from raycolo.catalog import ModelSpec
from raycolo.offline.costmodel.latency import IterationLatency, LatencyProfile, default_profile, profile_file
from raycolo.errors import PlanningError
from raycolo.hardware import ClusterSpec
from raycolo.offline.planner.engines import EngineKey, LoadCosts
from raycolo.batching.limits import SchedulerLimits, make_limits
from raycolo.offline.workload import NodeWorkload, Workload
from raycolo.tp_rules import tp_split_error


@dataclass(frozen=True, order=True)
class ExecPlan:
    """A model execution plan: ``dp`` replicas, each over ``tp`` GPUs."""

    dp: int
    tp: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"dp{self.dp}xtp{self.tp}"


class PlanningProblem:
    """Everything a policy needs: workload, cluster, valid plans and cost-model lookups."""

    def __init__(self, workload: Workload, cluster: ClusterSpec,
                 profile_dir: Optional[str | Path] = None, max_num_seqs: int = 256,
                 replica_start_s: float = 0.0, cold_start_s: Optional[float] = None,
                 compute_scale: Optional[Mapping[str, float]] = None,
                 load_costs: Optional[LoadCosts] = None):
        self.workload = workload
        # Added to every load: what starting a replica costs beyond loading the weights,
        # measured by the runtime. ``replica_start_s``: a tp1 replica, which takes over a
        # warm engine actor from the runtime's pool (a swap in a living process);
        # ``cold_start_s``: a tensor-parallel one, which needs a new actor and placement
        # group (a process start and imports). None: the same as ``replica_start_s``.
        self.replica_start_s = replica_start_s
        self.cold_start_s = replica_start_s if cold_start_s is None else cold_start_s
        # The runtime's measured cost of each way of giving GPUs a model and what its
        # engine actors hold (raycolo.offline.planner.engines): the planner then follows the
        # actors' engines and charges each replica by how it gets its engine, instead of
        # the two start costs above.
        self.load_costs = load_costs
        # Per model: how many times the profile's iteration seconds an iteration takes on
        # the cluster the runtime measured (absent: 1, the profile as it is).
        self.compute_scale = dict(compute_scale or {})
        self.cluster = cluster
        self.profile_dir = Path(profile_dir) if profile_dir else None
        self.max_num_seqs = max_num_seqs
        self.nodes = list(workload.nodes)  # topological order
        self.upstream = {n: sorted(set(w.upstream)) for n, w in workload.nodes.items()}
        self.downstream = {n: [m for m in self.nodes if n in self.upstream[m]] for n in self.nodes}
        self.plans = {n: self._valid_plans(w) for n, w in workload.nodes.items()}
        for name, plans in self.plans.items():
            if not plans:
                w = workload.nodes[name]
                raise PlanningError(
                    f"nodes[{name}].model: {w.model.name} fits no plan on this machine "
                    f"({w.model.weight_bytes / 2**30:.1f} GiB of weights plus the KV of one "
                    f"{w.max_sequence}-token sequence, {cluster.num_gpus} GPUs of "
                    f"{cluster.gpu_memory_bytes / 2**30:.0f} GiB, TP up to {cluster.nvlink_group})")

    def node(self, name: str) -> NodeWorkload:
        return self.workload.nodes[name]

    @functools.lru_cache(maxsize=None)
    def profile(self, model_name: str, tp: int) -> LatencyProfile:
        model = self._model(model_name)
        if self.profile_dir is not None:
            path = profile_file(self.profile_dir, model_name, tp)
            if path.exists():
                return LatencyProfile.load(path)
        return default_profile(model, self.cluster, tp)

    def cost_sources(self, pairs) -> list[dict]:
        """Where the costs of each (model, tp) in ``pairs`` come from (costmodel.cost_source)."""
        from raycolo.offline.costmodel.latency import cost_source

        out = []
        for model_name, tp in sorted(set(pairs)):
            path = profile_file(self.profile_dir, model_name, tp) if self.profile_dir is not None else None
            out.append(cost_source(self.profile(model_name, tp), path if path and path.exists() else None))
        return out

    @functools.lru_cache(maxsize=None)
    def latency(self, model_name: str, tp: int, plain_sampling: bool = True) -> IterationLatency:
        """The iteration costs of ``model_name`` at ``tp``; ``plain_sampling`` False for a
        node whose requests go through the full sampler (``NodeWorkload.plain_sampling``)."""
        return IterationLatency(self._model(model_name), self.profile(model_name, tp),
                                max_seqs=self.max_num_seqs,
                                compute_scale=self.compute_scale.get(model_name, 1.0),
                                plain_sampling=plain_sampling)

    def replica_seconds(self, model_name: str, prompt_lens: Sequence[int],
                        output_lens: Sequence[int], tp: int = 1, plain_sampling: bool = True) -> float:
        """Predicted seconds for one replica to generate ``output_lens`` tokens for prompts
        of ``prompt_lens``, all there at its start (loads not counted): what the runtime's
        compute probe compares its measured time with."""
        from raycolo.offline.sim.fast import simulate
        from raycolo.offline.sim.types import ReplicaWorkload

        work = ReplicaWorkload(prompt_len=prompt_lens, remaining=output_lens,
                               ready=np.zeros(len(prompt_lens)))
        return simulate(work, self.limits(model_name, tp), self.latency(model_name, tp, plain_sampling)).end_time

    @functools.lru_cache(maxsize=None)
    def limits(self, model_name: str, tp: int) -> SchedulerLimits:
        return make_limits(self._model(model_name), self.cluster, tp, self.max_num_seqs)

    def load_seconds(self, node: str, plan: ExecPlan) -> float:
        start = self.replica_start_s if plan.tp == 1 else self.cold_start_s
        return self._profile_load_s(node, plan) + start

    def _profile_load_s(self, node: str, plan: ExecPlan) -> float:
        return self.profile(self.node(node).model.name, plan.tp).load_s

    def engine_key(self, node: str, plan: ExecPlan) -> EngineKey:
        """The engine a replica of ``node`` under ``plan`` runs (equal keys: one engine)."""
        models = self.load_costs.node_models if self.load_costs else {}
        return models.get(node, self.node(node).model.name), plan.tp

    def switch_seconds(self, node: str, plan: ExecPlan, kind: str) -> float:
        """A replica's load when it gets its engine by ``kind`` (``load_costs`` needed)."""
        return self.load_costs.seconds(kind, self._profile_load_s(node, plan))

    def min_load_seconds(self, node: str, plan: ExecPlan) -> float:
        """The least any replica of ``node`` under ``plan`` can take to load: what lower
        bounds may assume."""
        if self.load_costs is None:
            return self.load_seconds(node, plan)
        return self.load_costs.cheapest(self._profile_load_s(node, plan))

    def _model(self, name: str) -> ModelSpec:
        for w in self.workload.nodes.values():
            if w.model.name == name:
                return w.model
        raise KeyError(name)

    def _valid_plans(self, w: NodeWorkload) -> list[ExecPlan]:
        """Plans whose weights/tp plus one longest sequence's KV fit on each GPU, with a tp
        that splits the model's heads and MLP (raycolo.tp_rules)."""
        plans = []
        m = w.model
        for tp in self.cluster.tp_degrees():
            if tp_split_error(tp, m.heads, m.kv_heads, m.intermediate):
                continue
            limits = self.limits(w.model.name, tp)
            if limits.blocks_for(w.max_sequence) + limits.watermark_blocks > limits.num_blocks:
                continue
            plans.extend(ExecPlan(dp, tp) for dp in range(1, self.cluster.num_gpus // tp + 1))
        return sorted(plans, key=lambda p: (p.gpus, p.tp))
