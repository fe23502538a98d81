"""Weights laid out so that a fused projection's parts multiply as one.

:class:`~raycolo.engine.executor.fused.FusedProjection` keeps q/k/v (or gate/up) as rows
of one weight. Under LoRA each part also has, per adapter, ``A`` (rank x in) and ``B``
(out x rank). Laid out here, the parts' adapters of one group cost two products, as
vLLM's LoRA kernels shrink and expand all slices of a merged projection at once:

* the parts' ``A``s as consecutive rows of one tensor (:func:`share_rows`): one
  ``x @ A^T`` gives every part's shrunk input, ``(rows, sum of ranks)``;
* their ``B``s as the diagonal blocks of one ``(sum of outs, sum of ranks)`` tensor whose
  other entries are zero (:func:`share_block_diagonal`): one product of the shrunk input
  with it gives every part's LoRA output, in the columns of the fused product.

Each part's parameter becomes a view of its block (``.data``): the modules, peft's state
dict, ``copy_`` loads and any optimizer keep working on the same objects, and an
optimizer's in-place step writes straight into the shared tensor, so nothing is cached
and a CUDA graph replaying the products reads the current weights. The zero blocks belong
to no parameter and stay zero. A view of a block is not contiguous (its rows are
``sum of ranks`` apart); exports make copies (``.contiguous()``, ``.clone()``).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from raycolo.engine.executor.row_lora import expand


def consecutive(tensors: Sequence[torch.Tensor]) -> bool:
    """Contiguous tensors that are consecutive pieces of one storage, in order."""
    storage, offset = tensors[0].untyped_storage().data_ptr(), tensors[0].storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


def share_rows(params: Sequence[torch.Tensor]) -> None:
    """Copy ``params`` (same trailing shape) into one tensor by rows, and make each a view
    of its rows (``.data``: the parameters, their modules and any optimizer holding them
    stay the same objects)."""
    whole = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = whole[start:start + p.shape[0]]
        start += p.shape[0]


def rows_view(first: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows from ``first``'s start, in its storage: the whole of tensors laid out
    by :func:`share_rows` (or one fused weight), without a copy."""
    tail = tuple(first.shape[1:])
    return first.detach().as_strided((rows, *tail), tuple(first.stride()), first.storage_offset())


def block_diagonal(tensors: Sequence[torch.Tensor]) -> bool:
    """2-D tensors that are the diagonal blocks, in order, of one row-major matrix of
    ``sum of rows`` x ``sum of columns`` (as :func:`share_block_diagonal` leaves them)."""
    width = sum(t.shape[1] for t in tensors)
    storage, base = tensors[0].untyped_storage().data_ptr(), tensors[0].storage_offset()
    row = col = 0
    for t in tensors:
        if t.dim() != 2 or t.untyped_storage().data_ptr() != storage or t.stride() != (width, 1) \
                or t.storage_offset() != base + row * width + col:
            return False
        row, col = row + t.shape[0], col + t.shape[1]
    return True


def share_block_diagonal(params: Sequence[torch.Tensor]) -> None:
    """Copy 2-D ``params`` into the diagonal blocks of one zero matrix, and make each a view
    of its block (``.data``, as :func:`share_rows`)."""
    first = params[0]
    whole = torch.zeros(sum(p.shape[0] for p in params), sum(p.shape[1] for p in params),
                        dtype=first.dtype, device=first.device)
    row = col = 0
    for p in params:
        block = whole[row:row + p.shape[0], col:col + p.shape[1]]
        block.copy_(p.detach())
        p.data = block
        row, col = row + p.shape[0], col + p.shape[1]


def block_view(first: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The whole matrix whose first diagonal block is ``first``."""
    return first.detach().as_strided((rows, cols), (cols, 1), first.storage_offset())


def add_group_lora(full: torch.Tensor, outs: Sequence[torch.Tensor], x: torch.Tensor, terms) -> bool:
    """Add each part's adapters (``terms[i]``: part ``i``'s ``(A, B, scaling)`` per
    adapter) to the fused product ``full`` (whose column slices are ``outs``): per
    adapter one shrink ``x @ A^T`` for all parts where their ``A``s are laid out as
    consecutive rows, then one expand with the block-diagonal ``B`` where the ``B``s are
    laid out so and share a scaling, else one ``addmm_`` per part. With LoRA on q/k/v: 1
    base product + 2, where peft computes 1 + 6. False, having added nothing, where the
    ``A``s are not laid out so."""
    if not terms or not terms[0] or len({len(t) for t in terms}) != 1:
        return False
    groups = [[t[j] for t in terms] for j in range(len(terms[0]))]
    if not all(consecutive([a for a, _, _ in g]) for g in groups):
        return False
    for g in groups:
        a, b = [t[0] for t in g], [t[1] for t in g]
        ranks = [w.shape[0] for w in a]
        shrunk = F.linear(x.to(a[0].dtype), rows_view(a[0], sum(ranks)))
        if len({s for _, _, s in g}) == 1 and block_diagonal(b):
            expand(full, shrunk, block_view(b[0], full.shape[-1], sum(ranks)), g[0][2])
            continue
        for out, (_, b_part, scaling), piece in zip(outs, g, shrunk.split(ranks, dim=-1)):
            expand(out, piece, b_part, scaling)
    return True
