"""Model catalog: the architecture numbers that FLOPs, weight bytes and KV bytes need.

The catalog lives in ``raycolo/data/models.yaml``. Each entry describes a decoder-only
transformer. Derived quantities (parameter count, bytes, per-token FLOPs) are computed
here so every consumer agrees on them.
"""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raycolo.errors import ConfigError
from raycolo.kv_bytes import kv_bytes_per_token

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


class ModelSpec(BaseModel):
    """Architecture of one decoder-only LLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    intermediate: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    vocab: int = Field(gt=0)
    context_length: int = Field(gt=0)
    dtype: Literal["float32", "float16", "bfloat16", "int8"] = "float16"
    # gated = three MLP matrices (LLaMA/Mistral SwiGLU); plain = two (GPT-NeoX, MPT).
    mlp: Literal["gated", "plain"] = "gated"
    num_experts: int = Field(default=1, gt=0)
    experts_per_token: int = Field(default=1, gt=0)
    tied_embeddings: bool = False
    # Name of the output-length eCDF file (raycolo/data/ecdf/<ecdf>.csv); defaults to the model name.
    ecdf: Optional[str] = None
    # For tiny CPU models: the transformers architecture to build from config.
    hf_architecture: Optional[str] = None
    description: str = ""

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelSpec":
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token cannot exceed num_experts")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def attention_params_per_layer(self) -> int:
        kv_dim = self.kv_heads * self.head_dim
        return self.hidden * self.hidden * 2 + self.hidden * kv_dim * 2  # q, o, k, v

    @property
    def mlp_params_per_expert(self) -> int:
        mats = 3 if self.mlp == "gated" else 2
        return mats * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        per_layer = self.attention_params_per_layer + self.num_experts * self.mlp_params_per_expert
        return self.layers * per_layer + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def matmul_params_per_token(self) -> int:
        """Weights a token multiplies through: active experts only, plus the LM head."""
        per_layer = self.attention_params_per_layer + self.experts_per_token * self.mlp_params_per_expert
        return self.layers * per_layer + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return int(kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes))

    @property
    def ecdf_name(self) -> str:
        return self.ecdf or self.name


def _data_path(*parts: str) -> Path:
    return Path(str(resources.files("raycolo").joinpath("data", *parts)))


@functools.lru_cache(maxsize=None)
def _builtin_catalog() -> dict[str, ModelSpec]:
    return load_catalog(_data_path("models.yaml"))


def load_catalog(path: str | Path) -> dict[str, ModelSpec]:
    """Read a catalog YAML (``models: {name: {layers: ..., ...}}``)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read model catalog: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
        raise ConfigError(f"{path}: expected a top-level 'models' mapping")
    catalog = {}
    for name, fields in raw["models"].items():
        try:
            catalog[name] = ModelSpec(name=name, **(fields or {}))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ConfigError(f"{path}: models.{name}.{loc}: {err['msg']}") from None
    return catalog


def spec_of_checkpoint(directory: str | Path, name: Optional[str] = None) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint directory, read from its ``config.json``
    (named ``name``, else the directory's name): what ``raycolo profile --model DIR`` costs."""
    import json

    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model: {path}: cannot read the checkpoint's config: {exc}") from None
    text = cfg.get("text_config") or cfg          # multimodal checkpoints nest the decoder's
    try:
        dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
        return ModelSpec(
            name=name or Path(directory).resolve().name, layers=text["num_hidden_layers"],
            hidden=text["hidden_size"], intermediate=text["intermediate_size"],
            heads=text["num_attention_heads"],
            kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            vocab=text["vocab_size"], context_length=text.get("max_position_embeddings", 4096),
            dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
            num_experts=text.get("num_local_experts", 1), experts_per_token=text.get("num_experts_per_tok", 1),
            tied_embeddings=bool(text.get("tie_word_embeddings", False)),
            hf_architecture=(cfg.get("architectures") or [None])[0],
            description=f"read from {path}")
    except KeyError as exc:
        raise ConfigError(f"--model: {path}: no {exc.args[0]} (a decoder-only checkpoint's config has it)") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"--model: {path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def model_spec(model: str, name: Optional[str] = None) -> ModelSpec:
    """A catalog model by name, or a checkpoint directory's spec (:func:`spec_of_checkpoint`)."""
    from raycolo.paths import is_dir

    return spec_of_checkpoint(model, name) if is_dir(Path(model)) else get_model(model)


def get_model(name: str) -> ModelSpec:
    catalog = _builtin_catalog()
    if name not in catalog:
        known = ", ".join(sorted(catalog))
        raise ConfigError(f"unknown model '{name}' (known: {known})")
    return catalog[name]

