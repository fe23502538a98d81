"""What a deployment's LoRA is (rank, alpha, target modules, optimizer) and peft's file
name for its weights: plain data, which the controller reads without importing torch
(its restart's time, docs/online-live.md)."""
from __future__ import annotations

from dataclasses import dataclass

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"   # peft's file name (adapters.py)
# A stage step mixing adapter versions runs as one pass where it can (row_versions.py):
# the default of StageModel and of the online config's stage.batched_versions.
BATCHED_VERSIONS = True


@dataclass(frozen=True)
class LoraSettings:
    """peft LoRA on the decoder layers' projections, and the optimizer of its weights."""

    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float = 1e-3
    seed: int = 0
