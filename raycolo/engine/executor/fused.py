"""Fused projections: q/k/v as one matmul, and the MLP's gate/up as one, in inference.

A decode step multiplies each layer's input by q, k and v, and its normed residual by
gate and up: five matmuls, two inputs. With grouped-query attention k and v are small
(1024 x 4096 in a Llama-3-8B layer, 8 MB in bf16): at batch 1 such a product is over
before the GPU reaches its copy bandwidth, and each is one more launch (32 layers, 64
launches a step). vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` keep
one weight for each group; so do these, without changing the model:

* :class:`FusedProjection` concatenates the parts' weights (and biases, as Qwen2's q/k/v
  have) by rows into one tensor and points each part's ``weight`` at its rows of it (a
  view: no second copy of the weights, and the model's modules, state dict and autograd
  see the same parameters as before);
* in inference the executor calls :meth:`FusedProjection.__call__` (one ``F.linear``, or on
  the CPU one oneDNN-packed product, packed.py) and takes the parts' outputs as column
  slices of the result: strided rows, which the executor's kernels accept;
* parts are plain ``nn.Linear``s or peft LoRA layers around them: the LoRA layers' frozen
  ``base_layer``s fuse, and each active adapter adds ``scaling * B(A(x))`` to its part's
  columns in place (:func:`lora_terms`, :func:`apply_linear`: what peft's forward computes,
  without its per-call Python, and one base product for the three of q/k/v); the parts'
  adapters are laid out so that each adapter costs one shrink and one expand for the
  whole group (lora_layout.py). Any adapter
  state beyond plain LoRA (merged, DoRA or another variant, dropout while training, a
  bias on B) goes through peft's own forward. If a part's module is replaced later (an
  adapter injected), :meth:`current` says so and the executor calls the modules;
* moving the model (``model.to``, as an engine's sleep and wake do) gives each part its own
  storage again; :meth:`ensure_fused` lays them out again (once, at wake-up), and
  :meth:`release` lets the old storage go at sleep.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from raycolo.engine.executor.packed import PackedLinear, packed_or_plain
from raycolo.engine.executor.lora_layout import (add_group_lora, block_diagonal, consecutive, rows_view,
                                                  share_block_diagonal, share_rows)
from raycolo.engine.executor.row_lora import RowLoRA, expand

FUSE_PROJECTIONS = True      # the executor's default (engine_kwargs.fuse_projections is the engine's)
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class FusedProjection:
    """The linear parts ``names`` of ``owner`` (one input each) as one product."""

    def __init__(self, owner: torch.nn.Module, names: Sequence[str], pack: bool = True):
        self.owner, self.names, self.pack = owner, tuple(names), pack
        self.parts = [getattr(owner, n) for n in self.names]
        self.bases = [_base(p) for p in self.parts]       # the plain linears whose weights fuse
        self.wrapped = [p is not b for p, b in zip(self.parts, self.bases)]
        self.sizes = [b.out_features for b in self.bases]
        self.linear: Optional[torch.nn.Module] = None
        self._ptr = 0
        self.ensure_fused()

    @staticmethod
    def fusable(owner: torch.nn.Module, names: Sequence[str]) -> bool:
        parts = [getattr(owner, n, None) for n in names]
        if not all(type(p) is torch.nn.Linear or (is_lora(p) and type(p.base_layer) is torch.nn.Linear)
                   for p in parts):
            return False
        bases = [_base(p) for p in parts]
        w, biased = bases[0].weight, bases[0].bias is not None
        return all(b.in_features == bases[0].in_features and b.weight.dtype == w.dtype
                   and b.weight.device == w.device and (b.bias is not None) == biased for b in bases)

    def current(self) -> bool:
        """The owner still holds these parts, and they still live in the fused weight."""
        if not self.same_modules():
            return False
        return self.linear is not None and self.bases[0].weight.data_ptr() == self._ptr

    def same_modules(self) -> bool:
        """The owner still holds these parts (and the LoRA layers these bases)."""
        for name, part, base, wrapped in zip(self.names, self.parts, self.bases, self.wrapped):
            if getattr(self.owner, name) is not part or (wrapped and part.base_layer is not base):
                return False
        return True

    @property
    def packed(self) -> bool:
        """Whether the product multiplies with a oneDNN-packed weight (packed.py)."""
        return isinstance(self.linear, PackedLinear)

    def release(self) -> None:
        """Drop the fused module (its packed copy, on the CPU); the parts keep their rows."""
        self.linear = None

    def _laid_out(self) -> bool:
        """The parts' weights (and biases) are consecutive rows of one storage."""
        for attr in ("weight", "bias"):
            tensors = [getattr(b, attr) for b in self.bases]
            if all(t is None for t in tensors):
                continue
            if any(t is None for t in tensors) or not consecutive(tensors):
                return False        # (fusable: all parts have a bias, or none)
        return True

    def ensure_fused(self) -> None:
        """Lay the parts out as rows of one weight (copying only if they are not already),
        and build the product over it."""
        with torch.no_grad():
            if not self._laid_out():
                self._lay_out()
            for a_weights, b_weights in self._adapter_weights():   # per adapter: one shrink, one expand
                if not consecutive(a_weights):
                    share_rows(a_weights)
                if not block_diagonal(b_weights):
                    share_block_diagonal(b_weights)
            w0 = self.bases[0].weight
            total, cols = sum(self.sizes), w0.shape[1]
            weight = rows_view(w0, total)
            b0 = self.bases[0].bias
            bias = None if b0 is None else rows_view(b0, total)
            linear = torch.nn.Linear(cols, total, bias=bias is not None, device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            linear.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            self.linear = packed_or_plain(linear) if self.pack else linear
        self._ptr = w0.data_ptr()

    def _lay_out(self) -> None:
        share_rows([b.weight for b in self.bases])
        if self.bases[0].bias is not None:
            share_rows([b.bias for b in self.bases])

    def _adapter_weights(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per adapter that every part has (all parts LoRA layers), the parts' ``lora_A``
        and ``lora_B`` weights, where they can share one product each (lora_layout.py):
        plain linears without bias, of one input, dtype and device."""
        if not all(self.wrapped):
            return []
        groups = []
        for name in self.parts[0].lora_A:
            mods = [(p.lora_A[name] if name in p.lora_A else None, p.lora_B[name] if name in p.lora_B else None)
                    for p in self.parts]
            if all(type(m) is torch.nn.Linear and m.bias is None for pair in mods for m in pair):
                a, b = [m.weight for m, _ in mods], [m.weight for _, m in mods]
                w = a[0]
                if all(t.dtype == w.dtype and t.device == w.device for t in a + b) \
                        and all(t.shape[1] == w.shape[1] for t in a):
                    groups.append((a, b))
        return groups

    def __call__(self, x: torch.Tensor, rows: Optional[RowLoRA] = None) -> Optional[tuple[torch.Tensor, ...]]:
        """The parts' outputs, as column slices of one (rows, sum of sizes) product with each
        LoRA part's adapters added (each row its own, given ``rows``); None where an adapter
        needs peft's own forward."""
        terms = None if rows is not None else [lora_terms(p, x) if w else () for p, w in zip(self.parts, self.wrapped)]
        if terms is not None and any(t is None for t in terms):
            return None
        full = self.linear(x)
        outs = full.split(self.sizes, dim=-1)
        if rows is not None:
            for out, part, wrapped in zip(outs, self.parts, self.wrapped):
                if wrapped:
                    rows.add(out, x, part)
        elif not add_group_lora(full, outs, x, terms):
            for out, part_terms in zip(outs, terms):
                _add_lora(out, x, part_terms)
        return outs


def is_lora(module) -> bool:
    """A peft LoRA ``Linear`` (``base_layer`` plus ``lora_A``/``lora_B`` per adapter)."""
    return type(module).__module__.startswith("peft.tuners.lora") and hasattr(module, "lora_A") \
        and hasattr(module, "base_layer")


def _base(module):
    return module.base_layer if is_lora(module) else module


def lora_terms(module, x: torch.Tensor) -> Optional[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """``(A, B, scaling)`` of each adapter a peft LoRA ``Linear`` would add to its base
    output for ``x`` (peft's ``Linear.forward``: ``base(x) + B(A(dropout(x))) * scaling``
    per active adapter; none while adapters are disabled), or None where that forward does
    more: merged adapters, DoRA or another variant, dropout while training, a bias on B,
    a 3-D input. Adapters of another dtype than ``x`` (peft keeps a bf16 model's adapters
    in float32 by default) are computed as peft does: ``x`` cast to A's dtype, the LoRA
    product in it, added to the output in the output's dtype (:func:`_add_lora`)."""
    if module.merged or x.dim() != 2:
        return None
    if module.disable_adapters:
        return []
    terms = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        a, b, drop = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
        if name in getattr(module, "lora_variant", {}) or type(a) is not torch.nn.Linear \
                or type(b) is not torch.nn.Linear or b.bias is not None or a.bias is not None \
                or (a.weight.dtype != x.dtype and not _casts_input(module, a.weight, b.weight)) \
                or (drop.training and getattr(drop, "p", 0.0) > 0):
            return None
        terms.append((a.weight, b.weight, float(module.scaling[name])))
    return terms


def _casts_input(module, a: torch.Tensor, b: torch.Tensor) -> bool:
    """peft's forward casts the input to A's dtype (``cast_input_dtype_enabled``, on by
    default), and A and B share it."""
    return getattr(module, "cast_input_dtype_enabled", True) and a.dtype == b.dtype and a.is_floating_point()


def _add_lora(out: torch.Tensor, x: torch.Tensor, terms) -> None:
    for a, b, scaling in terms:
        expand(out, F.linear(x.to(a.dtype), a), b, scaling)


def apply_linear(module, x: torch.Tensor, rows: Optional[RowLoRA] = None) -> torch.Tensor:
    """``module(x)``; in inference, a plain-LoRA peft layer as its base product plus
    ``scaling * B(A(x))`` added in place (what its forward computes, without its per-call
    Python); given ``rows``, each row's own adapter (:class:`RowLoRA`)."""
    if rows is not None and is_lora(module):
        out = module.base_layer(x)
        rows.add(out, x, module)
        return out
    if not torch.is_grad_enabled() and is_lora(module):
        terms = lora_terms(module, x)
        if terms is not None:
            out = module.base_layer(x)
            _add_lora(out, x, terms)
            return out
    return module(x)


class LayerFusion:
    """A decoder layer's fused q/k/v and gate/up (each None where its parts do not fuse)."""

    def __init__(self, layer: torch.nn.Module, pack: bool = True, mlp: bool = True):
        attn = layer.self_attn
        self.qkv = FusedProjection(attn, QKV, pack) if FusedProjection.fusable(attn, QKV) else None
        self.gate_up = (FusedProjection(layer.mlp, GATE_UP, pack)
                        if mlp and FusedProjection.fusable(layer.mlp, GATE_UP) else None)

    def projections(self) -> list[FusedProjection]:
        return [f for f in (self.qkv, self.gate_up) if f is not None]

    def fused_names(self) -> set[tuple[str, str]]:
        """(owner, name) of every fused part: ``("self_attn", "q_proj")``, ..."""
        out = set()
        if self.qkv is not None:
            out |= {("self_attn", n) for n in QKV}
        if self.gate_up is not None:
            out |= {("mlp", n) for n in GATE_UP}
        return out


def fuse_layers(layers: Sequence[torch.nn.Module], pack: bool = True,
                mlp: Sequence[bool] = ()) -> list[LayerFusion]:
    """One :class:`LayerFusion` per layer; ``mlp[i]`` False leaves layer i's gate/up apart."""
    return [LayerFusion(layer, pack, mlp[i] if i < len(mlp) else True) for i, layer in enumerate(layers)]


def project(fused: Optional[FusedProjection], modules: Sequence[torch.nn.Module],
            x: torch.Tensor, rows: Optional[RowLoRA] = None) -> tuple[torch.Tensor, ...]:
    """The outputs of ``modules`` on ``x``: one fused product in inference where ``fused``
    still stands for them, else each module on its own (autograd, LoRA). ``rows``: each
    row's own adapter (:class:`RowLoRA`; inference only)."""
    if fused is not None and not torch.is_grad_enabled():
        if not fused.current() and fused.same_modules():
            fused.ensure_fused()          # the same modules, moved (model.to): lay out again
        if fused.current():
            outs = fused(x, rows)
            if outs is not None:
                return outs
    return tuple(apply_linear(m, x, rows) for m in modules)
