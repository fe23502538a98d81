"""The machine a plan targets: GPU count, memory, NVLink groups and speeds."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from raycolo.bounds import Name
from raycolo.errors import ConfigError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str | int | float, field: str = "gpu_memory") -> int:
    """Parse ``80GiB``, ``40GB``, ``512MiB`` or a plain number of bytes."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ConfigError(f"{field}: cannot parse size '{text}' (use e.g. 80GiB)")
        unit = (match.group(2) or "").upper().rstrip("B")
        value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(f"{field}: must be positive, got '{text}'")
    return int(value)


MIN_GPU_MEMORY = 1 << 20        # 1 MiB: below, a size is a typo (a bare number is bytes)
MAX_GPU_MEMORY = 1 << 50        # 1 PiB


def _gpu_memory(text: str) -> str:
    try:
        value = parse_bytes(text)
    except ConfigError:
        raise ValueError("must be a size such as 80GiB or 512MiB (a bare number is bytes)") from None
    if not MIN_GPU_MEMORY <= value <= MAX_GPU_MEMORY:
        raise ValueError("must be between 1 MiB and 1 PiB (a bare number is bytes; e.g. 80GiB)")
    return text


GpuMemory = Annotated[Name, AfterValidator(_gpu_memory)]    # a GPU's memory as written: "80GiB"


class ClusterSpec(BaseModel):
    """One multi-GPU node. Defaults describe the paper's 8×A100-80G with NVLink pairs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_gpus: int = Field(default=8, gt=0)
    gpu_memory_bytes: int = Field(default=80 * 2**30, gt=0)
    nvlink_group: int = Field(default=2, gt=0)
    # A100 SXM dense fp16 tensor-core peak and HBM2e bandwidth.
    peak_flops: float = Field(default=312e12, gt=0)
    memory_bandwidth: float = Field(default=2.0e12, gt=0)
    # vLLM's gpu_memory_utilization: the share of memory the engine may use.
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # Host-to-GPU weight loading rate (safetensors from page cache), bytes/s per GPU.
    load_bandwidth: float = Field(default=2.5e9, gt=0)

    @model_validator(mode="after")
    def _check_groups(self) -> "ClusterSpec":
        if self.num_gpus % self.nvlink_group:
            raise ValueError(
                f"nvlink_group ({self.nvlink_group}) must divide the GPU count ({self.num_gpus})")
        return self

    @property
    def usable_bytes_per_gpu(self) -> int:
        return int(self.gpu_memory_bytes * self.memory_utilization)

    def nvlink_groups(self) -> list[list[int]]:
        g = self.nvlink_group
        return [list(range(i, i + g)) for i in range(0, self.num_gpus, g)]

    def tp_degrees(self) -> list[int]:
        """Tensor-parallel degrees allowed: powers of two within one NVLink group."""
        out, tp = [], 1
        while tp <= self.nvlink_group:
            out.append(tp)
            tp *= 2
        return out


def make_cluster(gpus: int = 8, gpu_memory: str | int = "80GiB", nvlink_group: int = 2) -> ClusterSpec:
    if gpus <= 0:
        raise ConfigError(f"--gpus: must be positive, got {gpus}")
    if nvlink_group <= 0:
        raise ConfigError(f"--nvlink-group: must be positive, got {nvlink_group}")
    if gpus % nvlink_group:
        raise ConfigError(f"--nvlink-group: {nvlink_group} does not divide --gpus {gpus}")
    return ClusterSpec(num_gpus=gpus, gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory"),
                       nvlink_group=nvlink_group)
