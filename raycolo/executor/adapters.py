"""LoRA adapters in peft's own on-disk format, assembled from the stages that trained them.

Each stage holds the adapter weights of its own layers (:meth:`StageModel.lora_state`,
keys as peft saves them). :func:`export_adapter` joins them into one directory with
``adapter_config.json`` and ``adapter_model.safetensors``: what
``peft.PeftModel.from_pretrained(base, DIR)`` loads, and what vLLM loads as a LoRA
adapter (``LoRARequest(name, id, DIR)``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch

from raycolo.executor.stage import ADAPTER_WEIGHTS_FILE, LoraSettings

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
