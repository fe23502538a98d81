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
* only plain ``nn.Linear`` parts fuse (a peft LoRA layer keeps its own forward); if a
  part's module is replaced later (an adapter injected), :meth:`current` says so and the
  executor calls the modules;
* moving the model (``model.to``, as an engine's sleep and wake do) gives each part its own
  storage again; :meth:`ensure_fused` lays them out again (once, at wake-up), and
  :meth:`release` lets the old storage go at sleep.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from raycolo.engine.executor.packed import PackedLinear, packed_or_plain

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class FusedProjection:
    """The linear parts ``names`` of ``owner`` (one input each) as one product."""

    def __init__(self, owner: torch.nn.Module, names: Sequence[str], pack: bool = True):
        self.owner, self.names, self.pack = owner, tuple(names), pack
        self.parts = [getattr(owner, n) for n in self.names]
        self.sizes = [p.out_features for p in self.parts]
        self.linear: Optional[torch.nn.Module] = None
        self._ptr = 0
        self.ensure_fused()

    @staticmethod
    def fusable(owner: torch.nn.Module, names: Sequence[str]) -> bool:
        parts = [getattr(owner, n, None) for n in names]
        if not all(type(p) is torch.nn.Linear for p in parts):
            return False
        w = parts[0].weight
        return all(p.in_features == parts[0].in_features and p.weight.dtype == w.dtype
                   and p.weight.device == w.device for p in parts)

    def current(self) -> bool:
        """The owner still holds these parts, and they still live in the fused weight."""
        for name, part in zip(self.names, self.parts):
            if getattr(self.owner, name) is not part:
                return False
        return self.linear is not None and self.parts[0].weight.data_ptr() == self._ptr

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
            tensors = [getattr(p, attr) for p in self.parts]
            if all(t is None for t in tensors):
                continue
            if any(t is None or not t.is_contiguous() for t in tensors):
                return False
            storage = tensors[0].untyped_storage().data_ptr()
            offset = tensors[0].storage_offset()
            for t in tensors:
                if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
                    return False
                offset += t.numel()
        return True

    def ensure_fused(self) -> None:
        """Lay the parts out as rows of one weight (copying only if they are not already),
        and build the product over it."""
        with torch.no_grad():
            if not self._laid_out():
                self._lay_out()
            w0 = self.parts[0].weight
            total, cols = sum(self.sizes), w0.shape[1]
            weight = w0.detach().as_strided((total, cols), (cols, 1), w0.storage_offset())
            b0 = self.parts[0].bias
            bias = None if b0 is None else b0.detach().as_strided((total,), (1,), b0.storage_offset())
            linear = torch.nn.Linear(cols, total, bias=bias is not None, device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            linear.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            self.linear = packed_or_plain(linear) if self.pack else linear
        self._ptr = w0.data_ptr()

    def _lay_out(self) -> None:
        parts = self.parts
        weight = torch.cat([p.weight.detach() for p in parts])
        has_bias = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias.detach() if p.bias is not None
                          else torch.zeros(p.out_features, dtype=weight.dtype, device=weight.device)
                          for p in parts]) if has_bias else None
        start = 0
        for p, size in zip(parts, self.sizes):
            p.weight.data = weight[start:start + size]
            if bias is not None:
                if p.bias is None:   # a zero bias where the fused product adds one
                    p.bias = torch.nn.Parameter(bias[start:start + size], requires_grad=False)
                else:
                    p.bias.data = bias[start:start + size]
            start += size

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' outputs, as column slices of one (rows, sum of sizes) product."""
        return self.linear(x).split(self.sizes, dim=-1)


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
            x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of ``modules`` on ``x``: one fused product in inference where ``fused``
    still stands for them, else each module on its own (autograd, LoRA)."""
    if fused is not None and not torch.is_grad_enabled():
        if fused.current():
            return fused(x)
        if all(getattr(fused.owner, n) is p for n, p in zip(fused.names, fused.parts)):
            fused.ensure_fused()          # the same modules, moved (model.to): lay out again
            return fused(x)
    return tuple(m(x) for m in modules)
