"""The options of raycolo's commands that belong to no config file, as models: each
``--flag`` is generated from a field here (raycolo/cli/flags.py), so its type, default,
bounds and help are declared once, and docs/config-reference.md lists them.

The commands' config-file options come from their own models: ``RunConfig`` (``run``,
``run-dag``, ``plan``, ``compare``), ``OnlineConfig``, ``Arrivals``, ``LiveReplay``,
``LemixParams`` and ``ServeSpec``.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from raycolo.bounds import MAX_GPUS, Line, Name, PathText, Strict, Threads
from raycolo.generation.params import Seed
from raycolo.online.profiles import PRESETS
from raycolo.online.tasks import LENGTH_DISTRIBUTIONS
from raycolo.offline.policies import DEFAULT_OFFLINE_POLICY

OnlineModel = Literal[tuple(PRESETS)]                       # type: ignore[valid-type]
LengthsName = Literal[tuple(LENGTH_DISTRIBUTIONS)]          # type: ignore[valid-type]
MAX_TP = 64
WeightsDtype = Literal["auto", "float32", "bfloat16", "float16"]    # profile/validate --dtype (resolve_dtype)
DTYPE_HELP = ("the weights' data type; auto: float32 on the CPU, on CUDA the checkpoint's own 16-bit type "
              "(bfloat16 if it names none)")
MAX_CASE_TOKENS = 1 << 17          # validate --prompt-len/--output-len
MAX_BATCH = 4096                   # validate --batches: each size


class PlanOptions(Strict):
    """``plan``: which planner."""

    policy: Name = Field(default=DEFAULT_OFFLINE_POLICY, description="planning policy (the paper's greedy: samullm)")


class CompareOptions(Strict):
    """``compare``: which planners."""

    policies: Optional[Line] = Field(default=None, description="comma-separated policies (none: all that apply)")


class Sampled(Strict):
    """Where arrivals are drawn: the query lengths and the seed."""

    lengths: LengthsName = Field(default="hh-rlhf", description="query lengths (from the named dataset's fit)")
    seed: Seed = Field(default=0, description="seed for the arrivals and lengths")


class SimulatedCluster(Sampled):
    """``simulate-online`` and ``sweep-online``: the simulated cluster."""

    model: OnlineModel = Field(default="llama-8b", description="model preset")
    nodes: int = Field(default=4, ge=1, le=MAX_GPUS, description="nodes")
    stages: int = Field(default=2, ge=1, le=MAX_GPUS, description="pipeline stages (GPUs) per node")


class SweepOptions(Strict):
    """``sweep-online``: what it sweeps (each list's entries are held to the bounds of
    the field they set: ``Arrivals.rate``, ``OnlineConfig.train_rate``) and where its
    plots go."""

    policies: Line = Field(default="lemix,mix-rr,mix-luf,separate", description="comma-separated online policies")
    rates: Line = Field(default="10,50,100,150", description="comma-separated request rates (rps)")
    train_rates: Line = Field(default="0.1,0.5,0.9", description="comma-separated fractions of training tasks α")
    out: PathText = Field(default="out/sweep-online", description="directory the plots go to")


class Attach(Strict):
    """``online run`` and ``serve``: the Ray cluster to use."""

    address: Optional[Name] = Field(default=None, description="Ray cluster address (none: start a local cluster)")


class LiveOptions(Sampled, Attach):
    """``online run``: where the live deployment runs and what it writes."""

    save_profile: Optional[PathText] = Field(default=None, description="write the fitted node profile (JSON)")


class ProfileOptions(Strict):
    """``profile``: measure a model on the torch engine and fit the cost model."""

    model: PathText = Field(description="tiny catalog model or checkpoint directory")
    tp: int = Field(default=1, ge=1, le=MAX_TP, description="tensor-parallel degree: the other ranks run as processes of this machine")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="where the model runs")
    dtype: WeightsDtype = Field(default="auto", description=DTYPE_HELP)
    out: PathText = Field(default="profiles", description="output directory")
    threads: Threads = Field(default=1, description="CPU threads for torch")
    seed: Seed = Field(default=0, description="seed for the random weights and prompts")
    name: Optional[Line] = Field(default=None, description=(
        "the model name the profile files take; for a checkpoint directory, the catalog model it "
        "costs (plans of that model then use the profile); default: the directory's name"))


class ValidateOptions(Strict):
    """``validate``: predicted against measured run times of the tiny models."""

    profile: PathText = Field(default="cpu", description="profile directory, or 'cpu' for the shipped "
                                                         "tiny-model profiles")
    models: Optional[Line] = Field(default=None, description=(
        "comma-separated tiny models, or with --batches checkpoint directories too (none: the tiny models)"))
    name: Optional[Line] = Field(default=None, description=(
        "for a checkpoint directory in --models: the catalog model its profile is named after "
        "(raycolo profile --name); default: the directory's name"))
    batches: Optional[Line] = Field(default=None, description=(
        "comma-separated batch sizes: instead of the sampled request sets, engine runs of that many "
        "requests of --prompt-len tokens and --output-len greedy tokens each (EOS ignored), "
        "e.g. 1,16,64,256"))
    prompt_len: int = Field(default=512, ge=1, le=MAX_CASE_TOKENS, description="prompt tokens of each --batches request")
    output_len: int = Field(default=128, ge=1, le=MAX_CASE_TOKENS, description="output tokens of each --batches request")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="where the engine runs")
    dtype: WeightsDtype = Field(default="auto", description=DTYPE_HELP)
    requests: int = Field(default=48, ge=1, le=100_000, description="requests per case")
    tp: int = Field(default=1, ge=1, le=MAX_TP, description="tensor-parallel degree of the model cases "
                                                           "(needs each model's <model>.tp<T>.json profile; "
                                                           "the 2-model case runs at tp=1 only)")
    threads: Threads = Field(default=1, description="CPU threads for torch")
    seed: Seed = Field(default=4242, description="seed for the sampled workloads")
    repeats: int = Field(default=3, ge=1, le=20, description=(
        "held-out request sets per case (seeds seed, seed+1, ...): a case's error is over their summed "
        "times, so neither one set's output lengths nor one run's machine noise decides it"))

