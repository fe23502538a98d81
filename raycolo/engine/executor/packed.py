"""Frozen linear layers with oneDNN-prepacked weights, for inference on the CPU.

``torch.nn.functional.linear`` on the CPU calls a GEMM that re-lays out the weight on
every call; at the small row counts of decode steps that costs as much as the
arithmetic. oneDNN can pack a weight once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and multiply with it
(``torch.ops.mkldnn._linear_pointwise``): what torch's inductor does for frozen CPU
graphs, and what vLLM's CPU backend does for its linear layers. Measured here (2 threads,
fp32, hidden 768): 1.3-1.5x faster at 64 rows, about 2x at 16 rows
(``bench/engine.py`` and docs/executor.md).

:func:`pack_linears` swaps the executor's frozen projections (attention q/k/v/o, the MLP,
the LM head) for :class:`PackedLinear`, which keeps the original weight, so gradients,
state dicts and peft are unaffected:

* under ``torch.inference_mode`` / ``no_grad`` with a float32 or bfloat16 input it uses the
  packed weight;
* anywhere gradients may flow (a training forward: LoRA's gradient reaches earlier layers
  through these projections) it is a plain ``F.linear`` on the original weight.

A peft LoRA layer keeps working: only its frozen ``base_layer`` is packed; the adapter's
A and B stay plain and train. The packed copy is taken once: whoever rewrites a base
weight in place must call :func:`pack_linears` again (raycolo never does: adapters, not
base weights, change).

oneDNN keeps each product's primitive (its JIT-compiled kernel, made for one row count and
one weight shape) in an LRU cache of 1024 by default. An engine's steps see every row
count from 1 to ``max_num_seqs`` and its prefill chunks' sizes, for four or five packed
shapes: past 1024 the cache evicts what the next step needs, and each miss builds the
primitive again. Measured here (2 threads, float32, hidden 384): 300 row counts x 4 shapes
took 1.24 s a round at 1024 and 0.66 s at 8192; in an engine run of tiny-llama-l the LM
head's product took 528 µs a call at 1024 and 203 µs with room (docs/executor.md). A
cached primitive holds about 75 KB at decode sizes, so :data:`ONEDNN_PRIMITIVE_CACHE`
entries cost at most a few hundred MB. oneDNN reads the capacity once, when the process
creates its first primitive: importing this module sets it (unless the environment already
does), which the executor does before any model runs.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger("raycolo.engine.executor")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACK_BATCH_HINT = 64
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Below this many weights oneDNN's per-call overhead (~10 µs) outweighs the packing gain:
# at 1 thread a 128 x 384 projection took 5.5 µs plain and 16.8 µs packed for one row,
# a 256 x 768 one 55 vs 48 µs for 8 rows (docs/executor.md).
MIN_PACKED_WEIGHTS = 1 << 17
# oneDNN's primitive cache (see above): 4x its default, room for ~800 row counts of 5 shapes.
ONEDNN_PRIMITIVE_CACHE = 4096
ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
os.environ.setdefault(ONEDNN_CACHE_VARIABLE, str(ONEDNN_PRIMITIVE_CACHE))


def packing_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack ``weight`` on this CPU: float32 anywhere it is built in;
    bfloat16 only where the CPU has what its bf16 path needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT: an AVX2-only CPU refuses it with a RuntimeError)."""
    if not (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return weight.dtype != torch.bfloat16 or _bf16_supported()


def _bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


class PackedLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` that multiplies with a oneDNN-packed copy of its weight."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.inner = linear
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self):
        return self.inner.bias

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != self.inner.weight.dtype:
            return F.linear(x, self.inner.weight, self.inner.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.inner.bias, "none", [], "")


def packed_or_plain(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as a :class:`PackedLinear` where packing applies (a plain float32/bfloat16
    CPU ``nn.Linear`` of at least :data:`MIN_PACKED_WEIGHTS` whose packed product agrees
    with the plain one), else ``module`` itself."""
    if type(module) is not torch.nn.Linear or not packing_available(module.weight) \
            or module.weight.numel() < MIN_PACKED_WEIGHTS:
        return module
    try:
        packed = PackedLinear(module)
    except RuntimeError as exc:          # oneDNN refused this CPU or shape: the plain product serves
        log.warning("raycolo executor: not packing a %s linear (%s)", module.weight.dtype, exc)
        return module
    # self-check: the packed product must agree with the plain one
    probe = torch.randn(3, module.in_features, dtype=module.weight.dtype)
    with torch.inference_mode():
        if not torch.allclose(packed(probe), F.linear(probe, module.weight, module.bias), rtol=1e-3, atol=1e-3):
            return module
    return packed


def _pack_one(parent: torch.nn.Module, name: str) -> bool:
    module = getattr(parent, name, None)
    if module is None:
        return False
    if hasattr(module, "base_layer"):            # a peft LoRA layer: pack its frozen base
        parent, name, module = module, "base_layer", module.base_layer
    packed = packed_or_plain(module)
    if packed is module:
        return False
    setattr(parent, name, packed)
    return True


def pack_linears(layers: Iterable[torch.nn.Module], lm_head_parent=None,
                 skip: Sequence[set] = ()) -> int:
    """Pack the attention and MLP projections of ``layers`` and, given the module that
    holds it, the LM head. ``skip[i]``: (owner, name) pairs of layer i left as they are
    (parts of a fused projection, fused.py, which packs its own product). Returns how
    many linears were packed."""
    count = 0
    for i, layer in enumerate(layers):
        left = skip[i] if i < len(skip) else set()
        for owner_name in ("self_attn", "mlp"):
            owner = getattr(layer, owner_name)
            for name in PROJECTIONS:
                if (owner_name, name) not in left:
                    count += _pack_one(owner, name)
    if lm_head_parent is not None:
        count += _pack_one(lm_head_parent, "lm_head")
    return count
