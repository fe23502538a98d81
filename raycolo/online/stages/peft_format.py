"""LoRA adapters in peft's own on-disk format, assembled from the stages that trained them.

Each stage holds the adapter weights of its own layers (:meth:`StageModel.lora_state`,
keys as peft saves them). :func:`export_adapter` joins them into one directory with
``adapter_config.json`` and ``adapter_model.safetensors``: what
``peft.PeftModel.from_pretrained(base, DIR)`` loads, and what vLLM loads as a LoRA
adapter (``LoRARequest(name, id, DIR)``).

The other way round, adapters as users have them (``lora.init_from``, and the adapters
loaded while serving with ``POST /v1/load_lora_adapter``): :func:`check_adapter` says
whether a peft directory fits the deployment's model and LoRA, naming what differs, and
:func:`convert_adapter` writes a loaded one in the deployment's own shape (its rank, its
scaling, every module it adapts) so that each stage serves it as it serves a saved
version (a request pins the directory).
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

from raycolo.online.stages.stage_model import ADAPTER_WEIGHTS_FILE, LoraSettings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = ADAPTER_WEIGHTS_FILE


def lora_config_dict(lora: LoraSettings, base_model: str = "") -> dict:
    from peft import LoraConfig

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=base_model or None)
    return config.to_dict()


def export_adapter(stage_states: Iterable[Mapping[str, torch.Tensor]], lora: LoraSettings,
                   directory, base_model: str = "") -> Path:
    """Write the joined adapter to ``directory`` (created; files replaced atomically)."""
    from safetensors.torch import save_file

    merged: dict[str, torch.Tensor] = {}
    for state in stage_states:
        overlap = set(merged) & set(state)
        if overlap:
            raise ValueError(f"adapter: two stages hold {sorted(overlap)[0]}")
        merged.update({k: v.detach().to("cpu").contiguous() for k, v in state.items()})
    if not merged:
        raise ValueError("adapter: no LoRA weights to export")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = lora_config_dict(lora, base_model)
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    tmp_weights = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(merged, str(tmp_weights), metadata={"format": "pt"})
    os.replace(tmp_weights, directory / WEIGHTS_FILE)
    tmp_config = directory / f".{CONFIG_FILE}.tmp"
    tmp_config.write_text(json.dumps(config, indent=2, default=str))
    os.replace(tmp_config, directory / CONFIG_FILE)
    return directory


# -- adapters as users have them: checked against the deployment, and made servable ---------
LORA_PREFIX = "base_model.model."            # peft's saved keys: <prefix><module>.lora_A.weight


class AdapterError(ValueError):
    """An adapter directory that cannot be used; the message says why, after the path
    (``f"{path}: {exc}"``). ``missing``: there is nothing at the path."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class AdapterFile:
    """A peft LoRA adapter directory as read from disk (the weights' shapes only)."""

    directory: Path
    config: dict
    shapes: dict                  # saved key -> shape
    rank: int
    alpha: float
    rslora: bool

    @property
    def scaling(self) -> float:
        """peft's factor on B·A: ``lora_alpha / r`` (``/ sqrt(r)`` with use_rslora)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def modules(self) -> dict[str, dict[str, tuple]]:
        """module path -> {"A": shape, "B": shape}."""
        out: dict[str, dict[str, tuple]] = {}
        for key, shape in self.shapes.items():
            module, part = _lora_key(key)
            out.setdefault(module, {})[part] = shape
        return out


def _lora_key(key: str) -> tuple[str, str]:
    for part in ("A", "B"):
        tail = f".lora_{part}.weight"
        if key.startswith(LORA_PREFIX) and key.endswith(tail):
            return key[len(LORA_PREFIX):-len(tail)], part
    raise AdapterError(f"holds a weight raycolo cannot serve: {key} (only the lora_A and lora_B weights "
                       "of linear layers: no DoRA, biases, embeddings or modules_to_save)")


def read_adapter(directory) -> AdapterFile:
    """Read a peft LoRA adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``; the weights' shapes, not their values), or raise
    :class:`AdapterError` saying what is wrong with it."""
    try:
        return _read_adapter(Path(directory))
    except OSError as exc:            # not readable by this process
        raise AdapterError(f"cannot be read: {exc.strerror or exc}") from None


def _read_adapter(d: Path) -> AdapterFile:
    from safetensors import safe_open

    try:
        there = d.exists()
    except (OSError, ValueError) as exc:      # a name too long, a NUL byte...
        raise AdapterError(f"is not a usable path: {exc}") from None
    if not there:
        raise AdapterError("does not exist", missing=True)
    if not d.is_dir():
        raise AdapterError(f"is not a directory (a peft adapter is a directory with {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE})")
    if not (d / CONFIG_FILE).is_file():
        raise AdapterError(f"is not a peft adapter directory: it has no {CONFIG_FILE}")
    if not (d / WEIGHTS_FILE).is_file():
        hint = " (it has adapter_model.bin: save with safe_serialization=True)" \
            if (d / "adapter_model.bin").exists() else ""
        raise AdapterError(f"is not a peft adapter directory: it has no {WEIGHTS_FILE}{hint}")
    try:
        config = json.loads((d / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"its {CONFIG_FILE} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise AdapterError(f"is not a LoRA adapter: its {CONFIG_FILE} has peft_type {kind!r}, not 'LORA'")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"its {CONFIG_FILE} has r {rank!r}, not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise AdapterError(f"its {CONFIG_FILE} has lora_alpha {alpha!r}, not a positive number")
    if config.get("use_dora"):
        raise AdapterError("is a DoRA adapter (use_dora); raycolo serves plain LoRA adapters")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError("has per-module ranks or alphas (rank_pattern, alpha_pattern), which are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"has LoRA biases (bias: {config.get('bias')!r}), which are not supported (only bias 'none')")
    try:
        with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:          # safetensors raises its own error types for a bad file
        raise AdapterError(f"its {WEIGHTS_FILE} cannot be read as safetensors: {exc}") from None
    if not shapes:
        raise AdapterError(f"its {WEIGHTS_FILE} holds no weights")
    info = AdapterFile(d, config, shapes, rank, float(alpha), bool(config.get("use_rslora")))
    info.modules()                    # every key is a LoRA A or B weight
    return info


def _meta_model(model_config):
    """The model's module tree without memory (on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def model_linears(model_config) -> dict[str, tuple[int, int]]:
    """Every linear layer of the model: module path -> (in features, out features)."""
    return {name: (m.in_features, m.out_features) for name, m in _meta_model(model_config).named_modules()
            if isinstance(m, torch.nn.Linear)}


def lora_shapes(model_config, lora: LoraSettings) -> dict[str, tuple]:
    """Every weight of the adapter a deployment's stages hold: peft's saved key -> shape
    (the same wrapping as :func:`raycolo.online.stages.stage_model.add_lora`, on the meta device)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():   # transformers' deprecation notes about what peft calls
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(_meta_model(model_config), config)
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}


def check_adapter(directory, model_config, lora: LoraSettings, exact: bool,
                  expected: Optional[Mapping[str, tuple]] = None,
                  linears: Optional[Mapping[str, tuple[int, int]]] = None) -> AdapterFile:
    """Whether the adapter at ``directory`` fits a deployment of ``model_config`` whose
    stages hold LoRA ``lora``; raises :class:`AdapterError` naming what differs.

    ``exact`` (``lora.init_from``: the stages train on from its weights): its rank,
    lora_alpha and target modules must be the deployment's. Otherwise (an adapter loaded
    to serve): its rank may be smaller (served zero-padded) and it may adapt fewer
    modules, but only modules the deployment's LoRA adapts. Either way each weight must fit
    its module of the model (an adapter of another base model does not)."""
    info = read_adapter(directory)
    expected = lora_shapes(model_config, lora) if expected is None else expected
    linears = model_linears(model_config) if linears is None else linears
    adapted = {k[len(LORA_PREFIX):].rsplit(".lora_", 1)[0] for k in expected}
    targets = sorted(lora.target_modules)
    found = sorted({m.rsplit(".", 1)[-1] for m in info.modules()})
    if exact:
        if info.rank != lora.rank:
            raise AdapterError(f"its rank (r) is {info.rank}, lora.rank is {lora.rank}")
        if info.alpha != lora.alpha:
            raise AdapterError(f"its lora_alpha is {info.alpha:g}, lora.alpha is {lora.alpha}")
        if info.rslora:
            raise AdapterError("it scales by lora_alpha / sqrt(r) (use_rslora); the deployment's LoRA "
                               "scales by lora.alpha / lora.rank")
        if found != sorted({t.rsplit(".", 1)[-1] for t in targets}):
            raise AdapterError(f"it adapts the modules {found}, lora.target_modules is {targets}")
    elif info.rank > lora.rank:
        raise AdapterError(f"its rank (r) is {info.rank}, larger than this deployment's LoRA rank "
                           f"{lora.rank} (lora.rank): adapters of rank up to {lora.rank} can be loaded")
    for module, parts in sorted(info.modules().items()):
        if module not in linears:
            raise AdapterError(f"it adapts {module}, which the model does not have as a linear layer "
                               "(an adapter of another base model?)")
        if module not in adapted:
            raise AdapterError(f"it adapts {module}, which this deployment's LoRA does not "
                               f"(lora.target_modules: {targets})")
        fan_in, fan_out = linears[module]
        for part, want in (("A", (info.rank, fan_in)), ("B", (fan_out, info.rank))):
            if part not in parts:
                raise AdapterError(f"it has no lora_{part} weight for {module}")
            if tuple(parts[part]) != want:
                raise AdapterError(f"its {module}.lora_{part} has shape {list(parts[part])}; rank {info.rank} on "
                                   f"the model's {module} ({fan_in} -> {fan_out} features) needs {list(want)} "
                                   "(an adapter of another base model?)")
    return info


def convert_adapter(info: AdapterFile, lora: LoraSettings, expected: Mapping[str, tuple], directory,
                    base_model: str = "") -> Path:
    """Write ``info``'s adapter as one of the deployment's shape (rank ``lora.rank``, scaled
    by ``lora.alpha / lora.rank``, every module its LoRA adapts) to ``directory``: the same
    function of the input. A smaller rank is zero-padded (B·A unchanged), the scaling ratio
    goes into B, and modules it does not adapt get zeros (no change to them)."""
    from safetensors.torch import load_file

    try:
        source = load_file(str(info.directory / WEIGHTS_FILE))
    except Exception as exc:          # changed or removed since it was checked
        raise AdapterError(f"its {WEIGHTS_FILE} cannot be read: {exc}") from None
    factor = info.scaling / (lora.alpha / lora.rank)
    state = {}
    for key, shape in expected.items():
        value = torch.zeros(shape, dtype=torch.float32)
        given = source.get(key)
        if given is not None:
            given = given.to(torch.float32)
            if key.endswith(".lora_A.weight"):
                value[:given.shape[0]] = given
            else:
                value[:, :given.shape[1]] = given if factor == 1.0 else given * factor
        state[key] = value
    return export_adapter([state], lora, directory, base_model)


_DIGESTS: dict = {}


def adapter_digest(directory) -> str:
    """A hash of an adapter directory's config and weights (what a run started from)."""
    import hashlib

    d = Path(directory)
    files = [d / CONFIG_FILE, d / WEIGHTS_FILE]
    try:
        stamp = tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except OSError:
        return f"missing:{d}"
    key = (str(d.resolve()), stamp)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]
