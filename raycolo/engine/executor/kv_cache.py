"""A preallocated, paged KV cache for a slice of a model's layers.

Per layer, keys live in one tensor of shape ``(num_blocks, kv_heads, head_dim,
block_size)`` and values in one of shape ``(num_blocks, kv_heads, block_size, head_dim)``:
within a block, each head's keys are stored transposed, so that the native attention
kernel computes a block's scores as whole vectors (kernels/paged_attention.c). Token
``t`` of a request is stored in block ``table[t // block_size]`` at offset
``t % block_size``, where ``table`` is the request's block table from
:class:`raycolo.batching.blocks.BlockAllocator`. Nothing is ever
concatenated or grown: a step writes its new keys/values into their slots in place and
attention reads them back through the block tables.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

from raycolo.kv_bytes import kv_bytes_per_token


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor. On the CPU in an anonymous ``mmap`` of its own, so that the OS maps
    zero pages lazily: resident memory grows with the blocks actually written, not with the
    cache's size (blocks are handed out lowest first), and allocating costs no time.
    (numpy's calloc did the same until the executor's heap policy, :mod:`heap`, kept freed
    memory in the heap: calloc then zeroed reused memory, 85 ms for 400 MB here, and made
    all of it resident.) The mapping is unmapped when the tensor is freed. Never-written
    slots read as 0.0, so masked positions can never hold NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = dtype.itemsize
    count = 1
    for n in shape:
        count *= n
    raw = torch.from_numpy(np.frombuffer(mmap.mmap(-1, max(1, count * itemsize)), dtype=np.uint8))
    return raw.view(dtype).view(shape)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        """(Re)create every layer's tensors, all slots zero; what they held is gone."""
        n, kvh, d, bs = self.num_blocks, self.kv_heads, self.head_dim, self.block_size
        self.keys = [_zeros((n, kvh, d, bs), self.dtype, self.device) for _ in range(self.num_layers)]
        self.values = [_zeros((n, kvh, bs, d), self.dtype, self.device) for _ in range(self.num_layers)]

    def drop(self) -> None:
        """Free the tensors (an engine put to sleep); :meth:`allocate` before the next use."""
        self.keys, self.values = [], []

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    @property
    def bytes_per_token(self) -> int:
        return int(kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.dtype.itemsize))

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` of shape (tokens, kv_heads, head_dim) at flat ``slots``
        (``block * block_size + offset``)."""
        block, offset = slots.div(self.block_size, rounding_mode="floor"), slots.remainder(self.block_size)
        self.keys[layer][block, :, :, offset] = k
        self.values[layer][block, :, offset, :] = v

    def read(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each row's blocks, as (rows, kv_heads, blocks * block_size,
        head_dim); positions past a row's context hold stale data and must be masked."""
        rows, blocks = tables.shape
        bs, kvh, d = self.block_size, self.kv_heads, self.head_dim
        shape = (rows, kvh, blocks * bs, d)
        flat = tables.view(-1)  # index_select is several times faster than tensor[tables]
        k = self.keys[layer].index_select(0, flat).view(rows, blocks, kvh, d, bs)
        v = self.values[layer].index_select(0, flat).view(rows, blocks, kvh, bs, d)
        return (k.permute(0, 2, 1, 4, 3).reshape(shape), v.transpose(1, 2).reshape(shape))
