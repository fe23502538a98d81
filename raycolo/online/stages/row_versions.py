"""One pass for a step whose requests run on different adapter versions.

:meth:`StageModel.forward` serves each request on the adapter as it trains (``latest``),
on a saved version (a directory), or on the base model. Where a step mixes them and the
executor runs it eagerly (no CUDA graphs: the CPU, or graphs off), :func:`row_lora`
builds the executor's :class:`~raycolo.engine.executor.row_lora.RowLoRA` for it: every
LoRA layer of the stage gets each version's ``(A, B, scaling)``, from the layer itself
for ``latest`` and from the saved tensors for a pinned version, and every token of the
step its request's version (base-model rows none). The base model then runs once for all
rows (batched LoRA, as Punica and S-LoRA serve many adapters), not once per version.

Where anything is beyond that (adapters merged or switched off, another LoRA variant, a
LoRA layer the executor does not call itself, tensor parallelism, CUDA graphs), it
returns None and the stage keeps its one pass per version.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from raycolo.engine.executor.fused import is_lora, lora_terms
from raycolo.engine.executor.packed import PROJECTIONS
from raycolo.engine.executor.row_lora import RowLoRA

BASE = "base"


def row_lora(model, executor, counts: Sequence[int], variants: Sequence[str], latest: str, adapter: str,
             saved: Callable[[str], Mapping[str, torch.Tensor]]) -> Optional[RowLoRA]:
    """The per-row adapters of a step whose chunk ``i`` has ``counts[i]`` tokens and runs
    on ``variants[i]`` (``latest``, ``"base"`` or a saved version's directory, whose
    weights ``saved(directory)`` gives keyed by parameter name); None where the stage must
    run one pass per version (see the module docstring)."""
    if executor.graphs is not None or executor.tp is not None:
        return None
    if not all(type(layer.mlp).__name__.endswith("MLP") and hasattr(layer.mlp, "act_fn")
               for layer in executor.layers):
        return None
    versions = list(dict.fromkeys(v for v in variants if v != BASE))
    if not versions:
        return None
    probe = torch.empty((0, 1), dtype=executor.dtype, device=executor.device)
    weights = {v: None if v == latest else saved(v) for v in versions}
    terms: dict[int, list] = {}
    for name, module in model.named_modules():
        if not is_lora(module):
            continue
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            return None                      # a LoRA layer the executor does not call itself
        now = lora_terms(module, probe.expand(0, module.in_features))
        if now is None or len(now) != 1 or adapter not in module.lora_A:
            return None                      # merged, switched off, several active, a variant
        a, b, scaling = now[0]
        per_version = []
        for v in versions:
            if weights[v] is None:
                per_version.append((a, b, scaling))
                continue
            try:
                sa = weights[v][f"{name}.lora_A.{adapter}.weight"]
                sb = weights[v][f"{name}.lora_B.{adapter}.weight"]
            except KeyError:
                return None
            per_version.append((sa, sb, scaling))
        terms[id(module)] = per_version
    if not terms:
        return None
    index = {v: i for i, v in enumerate(versions)}
    rows = [index.get(v, -1) for v, n in zip(variants, counts) for _ in range(n)]
    return RowLoRA(rows, terms, executor.dtype, executor.device)
