"""What a stage worker's device is using now: nvidia-ml-py on a GPU, the process on a CPU.

* **GPU** (``torch.device("cuda", i)``): NVML through ``nvidia-ml-py`` (``pynvml``), the
  library ``nvidia-smi`` is built on: memory used and total on the device (every process
  on it, not only torch's allocations) and its utilization over NVML's last sample
  period. The device is found by its UUID, so ``CUDA_VISIBLE_DEVICES`` remapping (as Ray
  sets it) cannot pick the wrong one.
* **CPU**: what stands in is the worker process's resident memory (``psutil``) against
  the machine's, and no utilization (the stage busy fraction is the controller's
  measure of how busy a stage is).

``source`` says which: ``"nvml"`` or ``"process_rss"``. Pure Python, no Ray.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch


def physical_gpus() -> int:
    """The NVIDIA GPUs this machine has, as NVML counts them (whatever
    ``CUDA_VISIBLE_DEVICES`` says); 0 without a driver or nvidia-ml-py. Ray's GPUs on a
    machine without any are logical: nothing computes on them but the CPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:       # noqa: BLE001 - no library, no driver, no device: none
        return 0


LOGICAL_GPUS = 2      # a local cluster on a machine without GPUs (and a joined cluster's count, which Ray ignores)


def local_cluster_gpus(requested: Optional[int], physical: int) -> int:
    """GPUs a local Ray cluster declares: ``requested`` (``--gpus``), else the machine's
    ``physical`` ones, else 2 logical ones (a CPU machine). More than a machine with GPUs
    has is refused: Ray would hand out ids past them, and those replicas compute on the CPU."""
    from raycolo.errors import ConfigError

    if physical and requested and requested > physical:
        raise ConfigError(f"--gpus: {requested}, but this machine has {physical} GPU(s); a local cluster "
                          "declares no more than it has (the GPUs past them would compute on the CPU)")
    return requested or physical or LOGICAL_GPUS


def auto_device(gpu_ids: list, cuda_available: bool, physical: int) -> str:
    """``device: auto`` of an engine Ray gave ``gpu_ids``: CUDA where torch sees them; the CPU
    on logical GPUs (a machine without any). A real GPU torch cannot see is an error, not
    a replica that silently computes on the CPU."""
    from raycolo.errors import ConfigError

    if gpu_ids and cuda_available:
        return "cuda"
    if gpu_ids and physical:
        raise ConfigError(f"engine_kwargs.device: auto: Ray gave this replica GPU {gpu_ids} of a machine with "
                          f"{physical} GPU(s), but torch {torch.__version__} sees no CUDA device "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); install a CUDA "
                          "build of torch, declare no more GPUs than the machine has, or set device: cpu")
    return "cpu"


@lru_cache(maxsize=None)
def _nvml_handle(index: int):
    import pynvml

    pynvml.nvmlInit()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def device_reading(device: Optional[torch.device] = None) -> dict:
    """``{"source", "memory_used_bytes", "memory_total_bytes", "utilization"}``
    (utilization in [0, 1], or None where there is none)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        import pynvml

        handle = _nvml_handle(device.index if device.index is not None else torch.cuda.current_device())
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return {"source": "nvml", "memory_used_bytes": int(memory.used),
                "memory_total_bytes": int(memory.total), "utilization": util.gpu / 100.0}
    import psutil

    return {"source": "process_rss", "memory_used_bytes": int(psutil.Process().memory_info().rss),
            "memory_total_bytes": int(psutil.virtual_memory().total), "utilization": None}
