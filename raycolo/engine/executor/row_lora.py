"""Several adapter versions in one step: each row (token) with its own LoRA, or none.

An online stage serves requests on the adapter as it trains, on a saved version of it
(pinned), or on the base model, in one batch. Run as one pass per version, a step reads
every weight of the model once per version. Punica and S-LoRA instead run the base model
once for every row and add each row's own adapter product; so does :class:`RowLoRA`, for
each LoRA layer of the step (:func:`raycolo.engine.executor.fused.apply_linear` and the
fused projections call :meth:`RowLoRA.add`):

* the V versions' ``A`` concatenated by rows, ``(sum r, in)``, and their ``B`` by columns,
  ``(out, sum r)``: two matmuls for all versions together;
* between them, each row's ``x A_v^T`` is multiplied by ``scaling_v`` for the row's own
  version ``v`` and by 0 for the others (a base-model row: 0 for all), so the second
  product adds ``scaling_v B_v A_v x`` to each row, and nothing to a base row.

What peft computes row by row (tests compare against one peft pass per version). The
weights are read at each step: the trained adapter's as they are, a saved version's from
the tensors the stage keeps loaded.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

Terms = Sequence[tuple[torch.Tensor, torch.Tensor, float]]    # per version: (A, B, scaling)


class RowLoRA:
    """The adapter of each row of one step: ``versions[t]`` is the index (into each
    module's terms) of row ``t``'s version, or -1 for none; ``terms[id(module)]`` holds
    each version's ``(A, B, scaling)`` for one LoRA layer."""

    def __init__(self, versions: Sequence[int], terms: dict[int, Terms], dtype: torch.dtype,
                 device: torch.device):
        self.count = 1 + max(versions, default=-1)
        if self.count == 0:
            raise ValueError("RowLoRA: no row has an adapter")
        rows = torch.tensor(list(versions))
        self.mask = (rows.unsqueeze(1) == torch.arange(self.count)).to(dtype=dtype, device=device)  # (rows, V)
        self.terms = terms
        self._coef: dict[tuple, torch.Tensor] = {}

    def handles(self, module) -> bool:
        return id(module) in self.terms

    def _coefficients(self, terms: Terms, dtype: torch.dtype) -> torch.Tensor:
        """(rows, sum of ranks), in the adapters' ``dtype``: each row's scaling in its own
        version's rank columns."""
        key = (tuple((a.shape[0], s) for a, _, s in terms), dtype)
        coef = self._coef.get(key)
        if coef is None:
            scale = torch.tensor([s for _, _, s in terms], dtype=dtype, device=self.mask.device)
            ranks = torch.tensor([a.shape[0] for a, _, _ in terms], device=self.mask.device)
            coef = self._coef[key] = (self.mask.to(dtype) * scale).repeat_interleave(ranks, dim=1)
        return coef

    def add(self, out: torch.Tensor, x: torch.Tensor, module) -> None:
        """``out[t] += scaling_v * B_v A_v x[t]`` for each row ``t`` of version ``v`` (in the
        adapters' dtype, as peft computes float32 adapters on a bf16 model)."""
        terms = self.terms.get(id(module))
        if terms is None:
            raise RuntimeError(f"RowLoRA: no per-row adapter weights for {type(module).__name__}")
        if len(terms) != self.count:
            raise RuntimeError(f"RowLoRA: {len(terms)} versions for a layer of a {self.count}-version step")
        a = terms[0][0] if len(terms) == 1 else torch.cat([t[0] for t in terms])
        b = terms[0][1] if len(terms) == 1 else torch.cat([t[1] for t in terms], dim=1)
        shrunk = F.linear(x.to(a.dtype), a).mul_(self._coefficients(terms, a.dtype))
        expand(out, shrunk, b, 1.0)


def expand(out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """``out += scaling * shrunk @ B^T``: one ``addmm_`` where the dtypes agree; else the
    product in B's dtype (peft keeps a bf16 model's adapters in float32), added in place
    in the output's dtype (as peft casts its sum back)."""
    if b.dtype == out.dtype:
        out.addmm_(shrunk, b.t(), alpha=scaling)
    else:
        out.add_(torch.mm(shrunk, b.t()), alpha=scaling)
