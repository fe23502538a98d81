"""Which kernel reads the paged KV cache, chosen once per executor.

* ``NATIVE``: the C kernel on the CPU (:mod:`.native`), float32/float64.
* ``TRITON``: the Triton kernel (:mod:`.triton_attention`), float16/bfloat16/float32 on a
  CUDA device; on the CPU only when asked for, under Triton's interpreter.
* ``TORCH``: the blocks gathered into padded copies and ``scaled_dot_product_attention``
  under a mask (any device and dtype; the path with autograd).

Both kernels take the same flat block tables (:class:`~.batch.StepBatch` built with
``groups=False``) and read keys and values where they lie. Each comes with its fused
pointwise steps (:class:`FusedPointwise`: add + RMSNorm, rotary with the cache write,
SiLU times up), native C on the CPU, Triton with the Triton kernel.
"""
from __future__ import annotations

import importlib.util
from enum import Enum
from typing import Optional

import torch

from raycolo.engine.executor import native


class AttentionKernel(str, Enum):
    NATIVE = "native"
    TRITON = "triton"
    TORCH = "torch"

    @property
    def in_place(self) -> bool:
        """Reads the cache through flat block tables (no gather, no attention groups)."""
        return self is not AttentionKernel.TORCH


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_kernel(requested: Optional[AttentionKernel], dtype: torch.dtype,
                  device: torch.device) -> AttentionKernel:
    """``requested`` where given; otherwise the in-place kernel this device and dtype have
    (the native one on the CPU, Triton on CUDA), else the torch path."""
    if requested is not None:
        requested = AttentionKernel(requested)
        if requested is AttentionKernel.NATIVE and not native.native_attention_supported(dtype, device):
            raise ValueError(f"attention: the native kernel needs float32/float64 on the CPU "
                             f"and a C compiler (got {dtype} on {device.type})")
        if requested is AttentionKernel.TRITON:
            if not triton_installed():
                raise ValueError("attention: the Triton kernel needs the triton package")
            from raycolo.engine.executor.triton_attention import DTYPES
            if dtype not in DTYPES:     # its dot products do not compile for float64 on a GPU
                raise ValueError(f"attention: the Triton kernel takes {', '.join(str(d)[6:] for d in DTYPES)}, "
                                 f"not {str(dtype)[6:]}")
        return requested
    if native.native_attention_supported(dtype, device):
        return AttentionKernel.NATIVE
    if device.type == "cuda" and triton_installed():
        from raycolo.engine.executor import triton_attention
        if triton_attention.supported(dtype, device):
            return AttentionKernel.TRITON
    return AttentionKernel.TORCH


def paged_attention(kernel: AttentionKernel, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    batch, window: Optional[int], scale: float) -> torch.Tensor:
    """Attention of ``q`` (tokens, heads, head_dim) over one layer's cache through the flat
    tables of ``batch``, with ``kernel`` (``NATIVE`` or ``TRITON``)."""
    args = (q, key, value, batch.tables, batch.table_start, batch.positions, window, scale)
    if kernel is AttentionKernel.TRITON:
        from raycolo.engine.executor import triton_attention
        return triton_attention.paged_attention(*args, tiles=batch.tiles)
    return native.paged_attention(*args)


class FusedPointwise:
    """The fused pointwise steps of :meth:`ModelExecutor._forward_fused` on one backend:
    the native C kernels (float32, CPU) or the Triton ones (the GPU, or the interpreter)."""

    def __init__(self, kernel: AttentionKernel):
        self.kernel = kernel
        if kernel is AttentionKernel.TRITON:     # (the two modules take the same arguments)
            from raycolo.engine.executor import triton_pointwise as ops
        else:
            ops = native
        self._ops = ops
        self.add_rms_norm = ops.add_rms_norm

    def rope_and_write(self, cache, layer: int, slots, q, k, v, cos, sin) -> None:
        """Rotary on ``q`` in place and on ``k``; ``k`` and ``v`` into the layer's cache."""
        self._ops.rope_and_write(q, k, native.rows_of_heads(v), cos, sin, slots, cache.keys[layer],
                                 cache.values[layer])

    def silu_mul(self, gate, up):
        """``silu(gate) * up``, contiguous (in ``gate`` where that is contiguous): ``gate``
        and ``up`` may be the column halves of one fused gate/up product."""
        return self._ops.silu_mul(gate, up)


def fused_pointwise(kernel: AttentionKernel, dtype: torch.dtype, device: torch.device) -> Optional[FusedPointwise]:
    """The fused pointwise steps that go with ``kernel`` here, or None (unfused modules)."""
    if kernel is AttentionKernel.TRITON:
        return FusedPointwise(kernel)
    if kernel is AttentionKernel.NATIVE and native.fused_pointwise_supported(dtype, device):
        return FusedPointwise(kernel)
    return None
