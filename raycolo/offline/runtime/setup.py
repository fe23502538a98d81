"""Everything a run needs that can be checked before Ray starts.

:func:`prepare` loads the application and its input, builds the request set the planner
and the runtime share, renders the source text, measures prompt lengths with each
model's tokenizer and opens the output directory. Any mistake surfaces here as a
:class:`ConfigError` naming the field, before a single actor exists.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError

from raycolo.bounds import MAX_GPUS, Name, PathText, Requests, Seconds, Strict, Threads, describe
from raycolo.generation.params import Seed
from raycolo.offline.dag import AppSpec, SourceSpec, load_app
from raycolo.engine.models import ModelDtype
from raycolo.errors import ConfigError
from raycolo.hardware import GpuMemory
from raycolo.hardware import ClusterSpec, make_cluster
from raycolo.offline.policies import DEFAULT_OFFLINE_POLICY
from raycolo.offline.runtime.communicator import Communicator
from raycolo.offline.runtime.store import OutputStore, fingerprint
from raycolo.offline.runtime.texts import SourceTexts, build_source_texts
from raycolo.offline.workload import Workload, build_workload


class RunConfig(Strict):
    """Options of ``jobs/run_dag.py`` and ``raycolo run``: each field is a flag of the same
    name with dashes, its default, bounds and help generated from here (raycolo/cli/flags.py)."""

    dag: PathText = Field(description="the application graph (YAML) to run")
    output: PathText = Field(description="output directory; rerunning into it resumes")
    input: Optional[PathText] = Field(default=None, description="requests (jsonl or parquet) replacing the "
                                      "DAG's single source")
    policy: Name = Field(default=DEFAULT_OFFLINE_POLICY, description="planning policy (the paper's greedy: samullm)")
    profile: Optional[PathText] = Field(default=None, description="latency profiles and eCDFs, a directory or "
                                        "'cpu' (shipped tiny-model profiles)")
    seed: Seed = Field(default=0, description="seed for sampling")
    requests: Optional[Requests] = Field(default=None, description="override every source's count")
    gpus: Optional[int] = Field(default=None, ge=1, le=MAX_GPUS, description=(
        "GPUs to plan for (none: the cluster's; a local cluster started by raycolo run declares the machine's own "
        "GPUs, by NVML, else 2 logical ones, and refuses more than the machine has)"))
    gpu_memory: GpuMemory = Field(default="80GiB", description="memory per GPU for planning")
    nvlink_group: Optional[int] = Field(default=None, ge=1, le=MAX_GPUS,
                                        description="GPUs per NVLink group (none: min(2, gpus))")
    max_num_seqs: int = Field(default=64, ge=1, le=1 << 16, description="engine batch limit")
    backend: Literal["torch", "vllm"] = Field(default="torch", description="engine backend")
    dtype: ModelDtype = Field(default="float32", description="model dtype")
    # the planner counts in 16-token blocks either way; vLLM's CPU attention needs a multiple of 32
    block_size: Optional[int] = Field(default=None, ge=1, le=4096, description="engine KV block size (none: 16)")
    threads: Optional[Threads] = Field(default=None, description="torch CPU threads per replica")
    replica_start_s: Optional[Seconds] = Field(default=None, description="seconds a replica takes to start, "
                                               "for planning (none: measured once)")
    parked_engines: int = Field(default=1, ge=0, le=64, description=(
        "engines each warm engine actor keeps asleep to wake for a later stage instead of loading again "
        "(0: every swap releases the old engine)"))
    slice_s: float = Field(default=0.2, gt=0, le=3600, description="engine time per controller round trip")
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="PACK", description="placement group strategy")
    max_restarts: int = Field(default=3, ge=0, le=100, description="restarts per replica before failing")
    node_loss_s: float = Field(default=5.0, gt=0, le=3600, description=(
        "seconds with fewer GPUs than the run had before it plans what is left on the GPUs that remain"))
    address: Optional[Name] = Field(default=None, description="Ray cluster to join (none: local / RAY_ADDRESS)")
    progress: bool = Field(default=True, description="show a progress bar (--no-progress: none)")
    gantt: bool = Field(default=True, description="write the run's Gantt chart (gantt.png) to the output directory")


def parse_run_config(values: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(describe(exc, flag=True)) from None


@dataclass
class PreparedRun:
    config: RunConfig
    app: AppSpec
    workload: Workload
    texts: SourceTexts
    communicator: Communicator
    store: OutputStore
    profile_dir: Optional[Path]

    def cluster(self, gpus: int) -> ClusterSpec:
        group = self.config.nvlink_group or min(2, gpus)
        if gpus % group:
            raise ConfigError(f"--nvlink-group: {group} does not divide the {gpus} GPUs")
        return make_cluster(gpus, self.config.gpu_memory, group)

    def threads(self, gpus: int) -> int:
        """torch CPU threads per replica: ``--threads``, else the cores shared by the GPUs."""
        return self.config.threads or max(1, (os.cpu_count() or 1) // gpus)

    def engine_config(self, problem, node: str, plan) -> dict:
        """The engine config of a replica of ``node`` under ``plan`` (a :class:`PlanningProblem`
        gives the KV limits the planner assumed). The torch engine takes the planner's KV
        capacity as its budget (it allocates per request); vLLM preallocates its cache, so
        it sizes it from the memory it finds."""
        spec, config = self.app.node(node), self.config
        limits = problem.limits(spec.model, plan.tp)
        kv = {} if config.backend == "vllm" else {
            "kv_cache_tokens": max(1, limits.num_blocks) * limits.block_size}
        return {"backend": config.backend,
                "model_loading_config": {"model_id": spec.checkpoint or spec.model, "seed": 0,
                                         "dtype": config.dtype},
                "engine_kwargs": {"max_num_seqs": config.max_num_seqs,
                                  "max_num_batched_tokens": limits.max_num_batched_tokens,
                                  "block_size": config.block_size or limits.block_size,
                                  **kv,
                                  "watermark": limits.watermark,
                                  # every rank in its own bundle of the replica's group
                                  "tensor_parallel_size": plan.tp,
                                  "device": "auto", "cpu_threads": self.threads(problem.cluster.num_gpus)}}


def _with_input(app: AppSpec, input_path: str) -> AppSpec:
    """The application reading its single source from ``input_path`` instead."""
    if len(app.sources) != 1:
        raise ConfigError(f"--input: the application has {len(app.sources)} sources "
                          f"({', '.join(app.sources)}); give each a 'file' in the DAG instead")
    path = Path(input_path).resolve()
    (name, spec), = app.sources.items()
    source = SourceSpec(file=str(path), chunk_tokens=spec.chunk_tokens)
    return app.model_copy(update={"sources": {name: source}})


def prepare(config: RunConfig) -> PreparedRun:
    from raycolo.offline.costmodel.latency import resolve_profile_dir
    from raycolo.offline.policies import get_policy

    get_policy(config.policy)  # an unknown policy is a config error, found before Ray starts
    app = load_app(config.dag)
    if config.input is not None:
        app = _with_input(app, config.input)
    profile_dir = resolve_profile_dir(config.profile) if config.profile else None
    workload = build_workload(app, seed=config.seed, requests=config.requests,
                              ecdf_dir=profile_dir / "ecdf" if profile_dir else None)
    # only now: it imports torch and transformers (~2 s), which the checks above need not wait for
    from raycolo.engine.models import checkpoint_context, load_tokenizer

    tokenizers = {}
    for node in app.nodes:
        try:
            tokenizers[node.name] = load_tokenizer(node.checkpoint or node.model)
        except ConfigError as exc:
            raise ConfigError(f"nodes[{node.name}]: {exc}") from None
    first_consumer = next(n for n in app.topological_order()
                          if any(s in app.sources for s in app.inputs_of(n)))
    texts = build_source_texts(app, workload, tokenizers[first_consumer])
    # a checkpoint's own context bounds its node's prompts, where it is shorter than the catalog model's
    contexts = {node.name: checkpoint_context(node.checkpoint) for node in app.nodes}
    communicator = Communicator(app, workload, texts, tokenizers, config.seed,
                                {k: v for k, v in contexts.items() if v is not None})
    for node, lengths in communicator.planned_input_lengths().items():
        workload.nodes[node].input_len = lengths
    job = fingerprint(  # file paths left out: a job's working directory moves between submissions
        app.model_dump(exclude={"base_dir": True, "sources": {"__all__": {"file"}}}), config.seed, config.requests,
                      [texts.parts[item] for item in sorted(texts.parts)])
    store = OutputStore(config.output, job, {"dag": os.path.abspath(config.dag), "input": config.input,
                                             "seed": config.seed, "app": app.name})
    restored = []
    for key, record in store.done.items():
        node, index = record["node"], int(record["index"])
        if node not in workload.nodes or index >= len(workload.nodes[node]):
            raise ConfigError(f"--output: {store.journal_path} names request {key}, which this "
                              "job does not have; use a new directory")
        restored.append((node, index, record["text"]))
    rank = {name: i for i, name in enumerate(app.topological_order())}
    communicator.restore(sorted(restored, key=lambda r: (rank[r[0]], r[1])))
    return PreparedRun(config, app, workload, texts, communicator, store, profile_dir)
