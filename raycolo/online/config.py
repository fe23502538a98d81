"""The online deployment config (``examples/online.yaml``), in Ray Serve LLM's shapes where they fit.

Every default is declared here once; the CLI and the docs read them from these models.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from raycolo.batching.blocks import DEFAULT_BLOCK_SIZE, blocks_for
from raycolo.bounds import MAX_TOKENS, Fraction, Name, PathText, Strict, Threads, describe
from raycolo.errors import ConfigError
from raycolo.paths import check_input, is_dir
from raycolo.online.lemix_params import LemixParams
from raycolo.online.profiles import GIB, NodeProfile
# the HTTP front's section, where it was before (raycolo.online.serve_spec)
from raycolo.online.serve_spec import Ingress, ServeSpec  # noqa: F401
from raycolo.online.stages.lora_settings import BATCHED_VERSIONS
from raycolo.yamlio import load_yaml
from raycolo.engine.base import ModelLoadingConfig
from raycolo.kv_bytes import AttentionShape


class LoraSpec(Strict):
    rank: int = Field(default=8, gt=0, le=1024, description="Rank r of the LoRA adapters.")
    alpha: int = Field(default=16, gt=0, le=1 << 16, description=(
        "LoRA's alpha (peft's lora_alpha): the adapters' update is scaled by alpha / rank."))
    target_modules: list[Name] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                       min_length=1, max_length=256, description=(
        "Names of the model's modules that get LoRA adapters (peft's target_modules); the default is "
        "the attention projections."))
    lr: float = Field(default=1e-3, gt=0, le=1.0, description=(
        "Learning rate of the AdamW optimizer that trains the LoRA adapters."))
    micro_batch: int = Field(default=4, gt=0, le=1024, description=(
        "Samples per training task (C)."))
    checkpoint_every: int = Field(default=8, gt=0, le=1 << 30, description=(
        "Optimizer steps between adapter checkpoints."))
    max_len: int = Field(default=256, gt=1, le=1 << 16, description=(
        "Most tokens of one training sample; a longer sample is cut to it."))
    queued_tasks: int = Field(default=2, gt=0, le=1024, description=(
        "For samples that arrive over HTTP: the most training tasks outstanding per node."))
    flush_after_s: float = Field(default=10.0, gt=0, le=86400, description=(
        "For samples that arrive over HTTP: the longest a partial micro-batch waits before it becomes "
        "a training task, in seconds."))
    dpo_beta: float = Field(default=0.1, gt=0, le=100, description=(
        "DPO's beta, used for preference pairs (prompt, chosen, rejected)."))
    init_from: Optional[PathText] = Field(default=None, description=(
        "A LoRA adapter directory in peft's format (adapter_config.json, adapter_model.safetensors) "
        "to start from: every node's stages load their layers' part of it and train on from it. Its rank, "
        "lora_alpha and target modules must be this section's, and its weights must fit the model "
        "(checked at startup). A relative path is taken from the current directory. With resume, a "
        "restored checkpoint of this run wins over it (the run's key includes the adapter's contents)."))

    @field_validator("init_from")
    @classmethod
    def _absolute(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("must be an adapter directory (or left out)")
        try:
            return str(Path(v).expanduser().resolve())     # the stage workers' cwd is not this one
        except (RuntimeError, OSError, ValueError) as exc:   # ~unknown-user, a NUL byte...
            raise ValueError(f"not a usable path: {exc}") from None


class StageSpec(Strict):
    """What each stage worker gets."""

    cpus_per_worker: float = Field(default=0.5, gt=0, le=1024, description=(
        "CPUs each stage worker asks Ray for; a local cluster raycolo starts gets nodes x stages x this, "
        "plus two."))
    cpu_threads: Optional[Threads] = Field(default=1, description=(
        "Torch intra-op threads in each stage worker (none: OMP_NUM_THREADS when set, else one per CPU "
        "the process may run on)."))
    omp_wait_policy: Optional[Literal["PASSIVE", "ACTIVE"]] = Field(default="PASSIVE", description=(
        "OpenMP's OMP_WAIT_POLICY for the stage workers (none: OpenMP's own). Their cores are shared with "
        "the controller, the HTTP front and Serve's proxy, and an ACTIVE thread spins on its core between "
        "ops: at 100 concurrent requests on 2 cores PASSIVE gave 1.6-1.9x the output tokens/s "
        "(docs/online-live.md). OpenMP reads it when torch loads, so raycolo sets it in the environment of "
        "the Ray cluster it starts (cluster_env); on a cluster you start, give it to `ray start` (a runtime "
        "environment per worker would make every stage worker a cold process start, slowing each group "
        "(re)start)."))
    backend: Literal["gloo", "nccl"] = Field(default="gloo", description=(
        "torch.distributed backend of a node's stage workers' group. With nccl their tensors and headers "
        "still go over a gloo group, through host memory: NCCL pairs sends by order, not tag (docs/online-live.md)."))
    device: Literal["cpu", "cuda"] = Field(default="cpu", description=(
        "Device the stage workers run the model on."))
    cuda_graphs: bool = Field(default=True, description=(
        "With device cuda: stage workers replay decode steps as CUDA graphs, LoRA active (one set of graphs "
        "per adapter state); false runs every step eagerly."))
    batched_versions: bool = Field(default=BATCHED_VERSIONS, description=(
        "A step whose requests run on different adapter versions (latest, @base, @v<k>) runs as one pass with "
        "each row's own LoRA where the stage runs it eagerly (no CUDA graphs); false runs one pass per version."))
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, gt=0, le=1 << 16, description=(
        "Tokens per block of a stage's paged KV cache."))
    kv_cache_tokens: int = Field(default=16384, gt=0, le=1 << 30, description=(
        "KV cache capacity of each stage, in tokens (it gets this / block_size blocks, rounded up); it "
        "also caps the context a request may use."))
    memory_bytes: float = Field(default=2 * GIB, gt=0, le=1 << 50, description=(
        "The stage's memory budget in bytes (1 PiB at most). The prior node profile the scheduler plans "
        "with takes the larger of this and twice the stage's weights."))
    max_failures: int = Field(default=1, ge=0, le=1 << 20, description=(
        "Worker-group restarts per node (Ray Train's max_failures for each node's run)."))
    gpus_per_worker: float = Field(default=1.0, gt=0, le=1, description=(
        "GPUs each stage worker asks Ray for: below 1 several stages share one GPU (0.5: two), each with "
        "its own slice of layers and KV cache; their point-to-point traffic goes through host memory "
        "over gloo (NCCL refuses two ranks on one device)."))

    @field_validator("gpus_per_worker")
    @classmethod
    def _shared_gpus_use_gloo(cls, value: float, info: ValidationInfo) -> float:
        if value < 1 and info.data.get("backend") == "nccl":
            raise ValueError("below 1, stages share a GPU, which NCCL refuses (two ranks on one device); "
                             "use stage.backend: gloo")
        return value
    start_grace_s: float = Field(default=20.0, ge=0, le=3600, description=(
        "A controller Ray restarted (its Ray node died) starts on the GPUs the cluster has left: once one "
        "node's stage workers registered it serves after this many seconds, and the other nodes join when "
        "GPUs for them come back."))
    rejoin_s: float = Field(default=30.0, ge=0, le=3600, description=(
        "A node whose worker group is lost and not back within this many seconds has the samples it "
        "trained since its last checkpoint trained on the other nodes."))
    data_plane: Literal["node", "controller"] = Field(default="node", description=(
        "Where a node's scheduler runs. \"node\": in its first stage's process, next to the stages "
        "(raycolo/online/scheduling/node_loop.py): ops go stage to stage over the stages' own process group and the "
        "controller keeps a mirror fed the node's reports, with no actor call per op. \"controller\": in "
        "the controller actor, every op one actor call (the runtime before 2026-11-27; kept to compare, "
        "bench/live_tbt.py)."))
    report_every_s: float = Field(default=0.005, ge=0, le=1.0, description=(
        "With data_plane node: the least time in seconds between two reports of a node to the controller "
        "(its requests' tokens reach their streams with them; 0: one per loop turn)."))
    switch_interval_s: float = Field(default=0.0002, gt=0, le=0.1, description=(
        "sys.setswitchinterval in each stage worker: how long a thread holding the GIL keeps it while "
        "another waits (Python's default: 5 ms), so the worker's other threads (Ray's, the node loop's "
        "reports, commands and answers) hand it back to the stage's compute within this. At 5 ms a "
        "1-stage node's decode iteration took 4.7-6.9 ms against 1.1-1.9 ms of model time, at 0.2 ms "
        "2.1 ms (bench/live_tbt.py, 2 cores)."))


class OnlineConfig(Strict):
    model_loading_config: ModelLoadingConfig = Field(default_factory=ModelLoadingConfig, description=(
        "The model every node serves and fine-tunes."))
    nodes: int = Field(default=2, gt=0, le=64, description=(
        "Nodes: copies of the model, each split into a pipeline of stage workers, that serve and train "
        "side by side."))
    stages: int = Field(default=2, gt=0, le=64, description=(
        "Pipeline stages per node: the model's decoder layers are cut into this many contiguous slices, "
        "one stage worker each."))
    policy: Name = Field(default="lemix", description=(
        "The online scheduling policy that places inference and training tasks on nodes (a registered "
        "online policy name, e.g. lemix, mix-rr, mix-luf, separate)."))
    train_rate: Fraction = Field(default=0.5, description=(
        "The share of tasks that are training tasks (α); SEPARATE sizes its training and serving node "
        "groups from it."))
    lemix: LemixParams = Field(default_factory=LemixParams, description=(
        "LeMix's scheduling parameters."))
    lora: LoraSpec = Field(default_factory=LoraSpec, description=(
        "The LoRA adapters trained online and how samples become training tasks."))
    stage: StageSpec = Field(default_factory=StageSpec, description=(
        "What each stage worker gets."))
    max_tokens: int = Field(default=64, gt=0, le=MAX_TOKENS, description=(
        "A completion's default token limit, for requests that do not set one."))
    sample_store: PathText = Field(default="out/online/samples", description=(
        "Directory where training samples received are journaled, so they survive restarts and can be "
        "trained after a resume."))
    storage_path: PathText = Field(default="out/online/checkpoints", description=(
        "Directory of the nodes' Ray Train runs (their adapter checkpoints), the saved adapter versions "
        "and the records of the nodes' placement groups."))
    resume: bool = Field(default=True, description=(
        "Take up where an earlier deployment on the same storage_path and sample_store stopped: each node "
        "restores its newest adapter checkpoint and trains the stored samples no checkpoint holds "
        "(false: start from the base model, ignoring earlier checkpoints)."))
    profile: Optional[PathText] = Field(default=None, description=(
        "A saved node profile (JSON) to start from (none: a prior profile built from the model's shapes "
        "at prior_gflops)."))
    prior_gflops: float = Field(default=20.0, gt=0, le=1e9, description=(
        "The compute rate in GFLOP/s the prior node profile assumes."))
    serve: ServeSpec = Field(default_factory=ServeSpec, description=(
        "The HTTP front."))

    def served_model_name(self) -> str:
        return self.serve.served_model_name or self.model_loading_config.model_id

    def cluster_env(self) -> dict:
        """Environment variables for the processes of a Ray cluster raycolo starts for
        this deployment (stage.omp_wait_policy)."""
        policy = self.stage.omp_wait_policy
        return {"OMP_WAIT_POLICY": policy} if policy else {}

    def local_cpus(self) -> int:
        """CPUs of a local Ray cluster raycolo starts for this deployment: the stage
        workers' (``nodes x stages x stage.cpus_per_worker``) and two for the controller,
        the driver and the HTTP side."""
        return max(2, int(self.nodes * self.stages * self.stage.cpus_per_worker) + 2)

    def gpus_per_node(self) -> float:
        """The GPUs one node's stage workers take (``stages x stage.gpus_per_worker``)."""
        return self.stages * self.stage.gpus_per_worker

    def gpus_needed(self) -> int:
        """Whole GPUs the deployment needs (a local cluster declares this many)."""
        return math.ceil(self.nodes * self.gpus_per_node() - 1e-9)

    def check_paths(self) -> None:
        """``sample_store`` and ``storage_path`` must be directories this process can
        create and write, and ``lora.init_from`` an adapter that fits (:meth:`check_init_from`):
        found here, before a cluster starts, as one error naming the field. (A cluster of
        several hosts needs them on storage every host shares.)"""
        self.check_model()
        self.check_init_from()
        import tempfile

        for field in ("sample_store", "storage_path"):
            path = Path(getattr(self, field))
            try:
                path.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=path, prefix=".raycolo-probe-"):
                    pass
            except OSError as exc:
                raise ConfigError(f"{field}: cannot write {path}: {exc.strerror or exc}") from None

    def check_model(self) -> None:
        """The stage workers run raycolo's model executor, which has the Llama, Qwen2, Qwen3
        and Mistral families (a GPT-2-style checkpoint runs offline, on the fallback path, but
        not in the pipeline): a checkpoint of another family is one error naming the field."""
        path = Path(self.model_loading_config.model_id)
        if not path.is_dir():
            return

        from raycolo.engine.executor.model import FAST_PATH_FAMILIES

        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            raise ConfigError(f"model_loading_config.model_id: {path} has no readable config.json") from None
        if model_type not in FAST_PATH_FAMILIES:
            raise ConfigError(f"model_loading_config.model_id: {path} is a '{model_type}' model; online serving "
                              f"runs the {', '.join(sorted(FAST_PATH_FAMILIES))} families (offline 'raycolo run' "
                              "runs others through transformers)")

    def check_init_from(self) -> None:
        """``lora.init_from`` must be a peft LoRA adapter of this section's rank, alpha and
        target modules whose weights fit the model: found here, before a cluster starts, as
        one error naming the field and what differs."""
        if self.lora.init_from is None:
            return
        from raycolo.online.stages.peft_format import AdapterError, check_adapter
        from raycolo.online.stages.stage_model import LoraSettings

        lora = LoraSettings(self.lora.rank, self.lora.alpha, tuple(self.lora.target_modules))
        try:
            check_adapter(self.lora.init_from, model_hf_config(self.model_loading_config.model_id), lora,
                          exact=True)
        except AdapterError as exc:
            raise ConfigError(f"lora.init_from: {self.lora.init_from}: {exc}") from None

    def adapter_fingerprint(self) -> str:
        """The restore key: what an adapter checkpoint must match to be restored: the model,
        its split into stages, the LoRA shape and the adapter it started from (``init_from``,
        by its contents): a checkpoint of another shape or start belongs to another run."""
        import hashlib

        m, lora = self.model_loading_config, self.lora
        key = f"{m.model_id}|{m.seed}|{m.dtype}|{self.stages}|{lora.rank}|{lora.alpha}|{sorted(lora.target_modules)}"
        if lora.init_from is not None:
            from raycolo.online.stages.peft_format import adapter_digest

            key += f"|init_from={adapter_digest(lora.init_from)}"
        return hashlib.sha256(key.encode()).hexdigest()[:10]

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from raycolo.online.policies import online_policy_names

        if name not in online_policy_names():
            raise ValueError(f"unknown online policy '{name}' (known: {', '.join(online_policy_names())})")
        return name


def model_hf_config(model_id: str):
    """The transformers config of a catalog tiny model or a checkpoint directory."""
    path = Path(model_id)
    if is_dir(path):
        if not (path / "config.json").exists():
            raise ConfigError(f"model_loading_config.model_id: {path} has no config.json")
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(path)
    from raycolo.engine.models import hf_config_for

    return hf_config_for(_tiny_spec(model_id))


def _tiny_spec(model_id: str):
    """The catalog's spec of tiny model ``model_id`` (one error naming the field otherwise)."""
    from raycolo.catalog import get_model

    try:
        spec = get_model(model_id)
    except ConfigError as exc:
        raise ConfigError(f"model_loading_config.model_id: {exc}") from None
    if spec.hf_architecture is None:
        raise ConfigError(f"model_loading_config.model_id: '{model_id}' is not a tiny catalog model; "
                          "give a checkpoint directory")
    return spec


def model_fields(model_id: str) -> dict:
    """The model's shape as its ``config.json`` states it (a checkpoint directory) or as the
    catalog gives it (a tiny model), read without transformers (whose import takes a
    second): what the layer bounds and the prior profile need, and all the controller
    needs when it (re)starts. :func:`model_hf_config` is the full transformers config."""
    path = Path(model_id)
    if is_dir(path):
        try:
            return json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"model_loading_config.model_id: {path} has no config.json") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model_loading_config.model_id: {path / 'config.json'}: {exc}") from None
    spec = _tiny_spec(model_id)
    return {"vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "max_position_embeddings": spec.context_length}


def layer_bounds(layers: int, stages: int) -> list[int]:
    """Cut points of ``layers`` decoder layers into ``stages`` contiguous slices, as equal as
    possible (earlier stages take the remainder)."""
    if stages > layers:
        raise ConfigError(f"stages: {stages} stages for a model of {layers} decoder layers")
    base, extra = divmod(layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def parse_online_config(values: dict, source: str = "config") -> OnlineConfig:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: must be a mapping of settings")
    try:
        return OnlineConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe(exc, whole='config')}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def load_online_config(path) -> OnlineConfig:
    path = check_input(path, "config file")
    values = load_yaml(path) or {}
    if isinstance(values, dict) and "online" in values and isinstance(values["online"], dict):
        values = values["online"]   # a Serve config that carries raycolo's online config
    return parse_online_config(values, str(path))


def stage_build(config: "OnlineConfig") -> dict:
    """What every stage process of a deployment builds its model from
    (:func:`raycolo.online.stages.stage_process.build_stage`)."""
    cfg = config
    return {"model_id": cfg.model_loading_config.model_id, "seed": cfg.model_loading_config.seed,
            "dtype": cfg.model_loading_config.dtype, "device": cfg.stage.device,
            "lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
                     "target_modules": tuple(cfg.lora.target_modules), "lr": cfg.lora.lr,
                     "seed": cfg.model_loading_config.seed},
            "num_blocks": blocks_for(cfg.stage.kv_cache_tokens, cfg.stage.block_size),
            "block_size": cfg.stage.block_size, "pinned_versions": cfg.serve.pinned_versions,
            "cuda_graphs": cfg.stage.cuda_graphs, "batched_versions": cfg.stage.batched_versions}


def live_profile(config: "OnlineConfig", model_config) -> NodeProfile:
    """The node profile a live deployment starts from: ``config.profile`` (a saved one) or
    the prior from the model's shapes at ``prior_gflops``; either with the stages' KV pool
    (``stage.kv_cache_tokens`` in blocks of ``stage.block_size``), which bounds inference."""
    if config.profile:
        profile = NodeProfile.model_validate_json(Path(config.profile).read_text())
    else:
        dtype_bytes = {"float64": 8, "float32": 4}.get(config.model_loading_config.dtype, 2)
        profile = prior_profile(model_config, config.stages, config.stage, config.lemix, config.prior_gflops,
                                dtype_bytes, f"live-{config.model_loading_config.model_id}")
    return NodeProfile.model_validate({**profile.model_dump(), "block_size": config.stage.block_size,
                                       "kv_blocks": blocks_for(config.stage.kv_cache_tokens, config.stage.block_size)})


def prior_profile(model_config, stages: int, spec: StageSpec, lemix: LemixParams, gflops: float,
                  dtype_bytes: int, name: str) -> NodeProfile:
    """A node profile for a live model before anything is measured: FLOPs of the stage's
    weights at ``gflops``, η's through LeMix's C·ℓ² model at the reference length,
    memory from the model's shapes. Observed ops refit η_F and η_B (ProfileLearner)."""
    from raycolo.online.profiles import ACTIVATION_BYTES_PER_HIDDEN, REFERENCE_LENGTH

    shape = AttentionShape.of(model_config)
    layers, hidden, heads, kv_heads, head_dim = shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    fields = model_config if isinstance(model_config, dict) else vars(model_config)   # model_fields, or transformers'
    inter = fields.get("intermediate_size") or 4 * hidden
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    vocab = fields["vocab_size"]
    stage_params = per_layer * layers / stages + vocab * hidden / stages
    rate = gflops * 1e9
    forward_ref = 2 * stage_params * REFERENCE_LENGTH / rate
    eta_f = forward_ref / REFERENCE_LENGTH ** 2
    layers_per_stage = layers / stages
    return NodeProfile(
        name=name, stages=stages, eta_f=eta_f, eta_b=2 * eta_f,
        decode_floor_s=2 * stage_params / rate,
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes, layers=layers_per_stage),
        activation_bytes_per_token=ACTIVATION_BYTES_PER_HIDDEN * hidden * layers_per_stage,
        weight_bytes_per_stage=stage_params * dtype_bytes,
        gpu_memory_bytes=max(spec.memory_bytes, stage_params * dtype_bytes * 2),
        forward_latency_s=forward_ref * stages, backward_latency_s=2 * forward_ref * stages,
        reference_length=REFERENCE_LENGTH)
