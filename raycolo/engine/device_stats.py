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

from functools import lru_cache
from typing import Optional

import torch


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
