"""Tensor parallelism for the fast-path families (Llama, Qwen2, Qwen3, Mistral): Megatron's split.

A model is cut across ``world`` ranks by plain sharded weights and two all-reduces per
decoder layer, as gpt-fast's ``tp.py`` does, with vLLM's rules (``linear.py``):

* **column-parallel** (q/k/v, gate/up): each rank keeps a contiguous slice of the output
  features (rows of the weight, and the bias);
* **row-parallel** (o, down): each rank keeps the matching slice of the input features
  (columns of the weight); its output is a partial sum, all-reduced across the ranks. A
  bias is added by rank 0 alone (the others' is zeroed, so the sum holds it once);
* **grouped-query attention**: query heads split evenly; key/value heads split where the
  world divides them, and where it exceeds them (``world % kv_heads == 0``) each KV head is
  held by ``world / kv_heads`` ranks, the ones whose query heads read it
  (vLLM's ``QKVParallelLinear``). Each rank's paged cache holds its own heads, under the
  same block tables on every rank;
* the embedding, the norms and the LM head are replicated;
* **peft LoRA** shards as vLLM shards it: ``lora_B`` by output on column-parallel layers,
  ``lora_A`` by input on row-parallel ones; the other factor is replicated and its
  gradient, a partial sum on each rank, is all-reduced before the optimizer step
  (:meth:`TensorParallel.sync_grads`);
* **autograd** (LoRA training through the executor): Megatron's pair of conjugate
  operators, :meth:`TensorParallel.enter` before the column-parallel projections
  (identity forward, all-reduce of the input's gradient backward) and
  :meth:`TensorParallel.reduce` after the row-parallel ones (all-reduce forward, identity
  backward). Under inference they are a plain in-place all-reduce and nothing.

Why not torch's DTensor ``parallelize_module``: the executor calls the model's own
modules (peft wraps them) and its own attention on a paged cache; DTensor would turn
every activation into a DTensor through peft's layers, the native CPU kernels, the Triton
kernels and CUDA-graph capture, none of which take one, to express two all-reduces per
layer. Sliced weights and an explicit reduce keep every kernel on plain tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from raycolo.errors import ConfigError
from raycolo.tp_rules import tp_split_error

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def check_tp(config, world: int, field_name: str = "tensor_parallel_size") -> None:
    """A ``ConfigError`` naming ``field_name`` where ``world`` ranks cannot split a model of
    this transformers ``config`` (:func:`raycolo.tp_rules.tp_split_error`)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    error = tp_split_error(world, heads, kv, config.intermediate_size)
    if error:
        raise ConfigError(f"{field_name}: {error}")


class _Enter(torch.autograd.Function):
    """Identity forward; the input's gradient all-reduced backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.tp.all_reduce(grad)
        return grad, None


class _Reduce(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        out = x.contiguous().clone()
        tp.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass
class TensorParallel:
    """One rank's place in a tensor-parallel group: ``group`` is a torch.distributed
    process group of the ``world`` ranks (NCCL between GPUs, gloo on the CPU)."""

    rank: int
    world: int
    group: object = None
    replicated: list = field(default_factory=list)     # LoRA factors every rank holds whole

    def all_reduce(self, x: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return _Enter.apply(x, self)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            return _Reduce.apply(x, self)
        x = x.contiguous()
        self.all_reduce(x)
        return x

    def sync_grads(self) -> None:
        """Sum the partial gradients of the replicated LoRA factors across the ranks."""
        for p in self.replicated:
            if p.grad is not None:
                self.all_reduce(p.grad)

    # -- which slice a rank holds --------------------------------------------------------
    def head_rows(self, heads: int, head_dim: int) -> torch.Tensor:
        per = heads // self.world
        return torch.arange(self.rank * per * head_dim, (self.rank + 1) * per * head_dim)

    def kv_rows(self, kv_heads: int, head_dim: int) -> torch.Tensor:
        if kv_heads % self.world == 0:
            return self.head_rows(kv_heads, head_dim)
        head = self.rank // (self.world // kv_heads)          # replicated: the ranks reading it
        return torch.arange(head * head_dim, (head + 1) * head_dim)

    def even(self, n: int) -> torch.Tensor:
        per = n // self.world
        return torch.arange(self.rank * per, (self.rank + 1) * per)


def _lora_parts(module, part: str) -> list:
    inner = getattr(module, part, None)
    return list(inner.values()) if inner is not None else []


def _slice_param(p: torch.nn.Parameter, index: torch.Tensor, dim: int) -> None:
    """Keep ``index`` (a contiguous range) along ``dim`` of ``p`` (the Parameter object
    stays: optimizers and peft's references remain valid), and record it as ``p.tp_slice``
    = (dim, start, stop): what :mod:`.shard_load` reads of the checkpoint. A parameter
    already that long is left as it is (cut before, or made at the cut size by a module
    created after the cut), so cutting twice is cutting once."""
    start, stop = int(index[0]), int(index[-1]) + 1
    assert stop - start == len(index), "a rank's slice is a contiguous range"
    if p.shape[dim] != stop - start:
        p.data = p.data.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)
    p.tp_slice = (dim, start, stop)


def _column(module, rows: torch.Tensor, tp: TensorParallel) -> None:
    base = getattr(module, "base_layer", module)
    _slice_param(base.weight, rows, 0)
    if base.bias is not None:
        _slice_param(base.bias, rows, 0)
    base.out_features = len(rows)
    for lora in _lora_parts(module, "lora_B"):
        _slice_param(lora.weight, rows, 0)
        lora.out_features = len(rows)
    tp.replicated += [lora.weight for lora in _lora_parts(module, "lora_A")]
    if hasattr(module, "out_features"):
        module.out_features = len(rows)


def _row(module, cols: torch.Tensor, tp: TensorParallel) -> None:
    base = getattr(module, "base_layer", module)
    _slice_param(base.weight, cols, 1)
    if base.bias is not None and tp.rank != 0:
        with torch.no_grad():
            base.bias.zero_()
    base.in_features = len(cols)
    for lora in _lora_parts(module, "lora_A"):
        _slice_param(lora.weight, cols, 1)
        lora.in_features = len(cols)
    tp.replicated += [lora.weight for lora in _lora_parts(module, "lora_B")]
    if hasattr(module, "in_features"):
        module.in_features = len(cols)


def shard_layers(layers: Sequence[torch.nn.Module], config, tp: TensorParallel) -> None:
    """Cut every decoder layer's projections to ``tp.rank``'s slice, in place (layers
    already cut stay as they are)."""
    check_tp(config, tp.world)
    if tp.world == 1:
        return
    attn0 = layers[0].self_attn
    d = attn0.head_dim
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    q_rows, kv_rows = tp.head_rows(heads, d), tp.kv_rows(kv, d)
    inter = tp.even(config.intermediate_size)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        _column(attn.q_proj, q_rows, tp)
        _column(attn.k_proj, kv_rows, tp)
        _column(attn.v_proj, kv_rows, tp)
        _row(attn.o_proj, q_rows, tp)
        _column(mlp.gate_proj, inter, tp)
        _column(mlp.up_proj, inter, tp)
        _row(mlp.down_proj, inter, tp)


def local_heads(attn, head_dim: int) -> tuple[int, int]:
    """(query heads, key/value heads) this rank's q/k projections produce."""
    q = getattr(attn.q_proj, "base_layer", attn.q_proj).weight.shape[0]
    k = getattr(attn.k_proj, "base_layer", attn.k_proj).weight.shape[0]
    return q // head_dim, k // head_dim


def gather_lora_state(states: Sequence[dict], config, world: int) -> dict:
    """One whole adapter (peft's saved keys) from every rank's :meth:`lora_state`, in rank
    order: ``lora_B`` of column-parallel layers and ``lora_A`` of row-parallel ones joined
    along the split dimension (a replicated KV head's slice taken once), the replicated
    factors from rank 0."""
    if world == 1:
        return dict(states[0])
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    out = {}
    for key, value in states[0].items():
        module = key.split(".lora_")[0].rsplit(".", 1)[-1]
        column = module in COLUMN and ".lora_B" in key
        row = module in ROW and ".lora_A" in key
        if not (column or row):
            out[key] = value
            continue
        parts = [s[key] for s in states]
        if column and module in ("k_proj", "v_proj") and kv % world:
            parts = parts[::world // kv]                 # each KV head once
        out[key] = torch.cat(parts, dim=0 if column else 1)
    return out
