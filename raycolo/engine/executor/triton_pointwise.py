"""The executor's pointwise steps as Triton kernels on the GPU, each one pass over memory.

At batch 1 a decode step of an 8B model reads 16 GB of weights in about 4 ms, but its
pointwise work is hundreds of tiny kernels: transformers' RMSNorm is seven (upcast,
square, mean, rsqrt, scale, downcast, weight), its rotary embedding about ten, and the
cache write four. Replayed from a CUDA graph each still costs a few microseconds, which
at 32 layers is milliseconds. These kernels do the same arithmetic in one launch each,
rounding where transformers rounds, so that bf16 results match its modules:

* :func:`add_rms_norm`: ``residual += x`` (rounded to the dtype), then the RMSNorm of the
  sum (``weight * (r * rsqrt(mean(r**2) + eps)).to(dtype)``, as ``LlamaRMSNorm``);
* :func:`rope_and_write`: the rotary embedding of ``q`` in place and of ``k``
  (``q * cos + rotate_half(q) * sin``, each product rounded, as ``apply_rotary_pos_emb``),
  and ``k``/``v`` written into their slots of the paged cache (kv_cache.py's layouts);
* :func:`silu_mul`: ``silu(gate) * up`` (the gated MLP's middle), rounded as torch rounds.

The same arguments and results as the native CPU kernels (native.py); the CPU runs these
under Triton's interpreter in the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def _add_rms_norm_kernel(R, X, W, Out, dim, eps, HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < dim
    r = tl.load(R + row * dim + i, mask=ok, other=0.0)
    if HAS_X:
        r = (r.to(tl.float32) + tl.load(X + row * dim + i, mask=ok, other=0.0).to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * dim + i, r, mask=ok)
    h = r.to(tl.float32)
    var = tl.sum(h * h, 0) / dim
    n = (h * (1.0 / tl.sqrt(var + eps))).to(R.dtype.element_ty)
    w = tl.load(W + i, mask=ok, other=0.0)
    tl.store(Out + row * dim + i, (w.to(tl.float32) * n.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(residual: torch.Tensor, x, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place (skipped when ``x`` is None), then the RMSNorm of each row
    of ``residual``; contiguous (rows, dim) tensors of one dtype, ``weight`` (dim,)."""
    rows, dim = residual.shape
    if not residual.is_contiguous() or (x is not None and (x.shape != residual.shape or not x.is_contiguous())):
        raise ValueError("add_rms_norm: residual and x must be contiguous (rows, dim)")
    out = torch.empty_like(residual)
    if rows:
        _add_rms_norm_kernel[(rows,)](residual, residual if x is None else x, weight.contiguous(), out, dim,
                                      float(eps), HAS_X=x is not None, BLOCK=_pow2(dim))
    return out


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DT: tl.constexpr):
    """Both halves of ``x * cos + rotate_half(x) * sin``, each product and the sum rounded
    to ``DT`` as transformers' bf16/fp16 ops round them."""
    a1 = (x1 * c1).to(DT).to(tl.float32)
    b1 = (-x2 * s1).to(DT).to(tl.float32)
    a2 = (x2 * c2).to(DT).to(tl.float32)
    b2 = (x1 * s2).to(DT).to(tl.float32)
    return (a1 + b1).to(DT), (a2 + b2).to(DT)


@triton.jit
def _rope_write_kernel(Q, K, V, Cos, Sin, Slots, KC, VC, q_row, k_row, v_row, HEADS: tl.constexpr,
                       KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    j = tl.arange(0, HALF)
    ok = j < D // 2
    c1 = tl.load(Cos + tok * D + j, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + tok * D + D // 2 + j, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + tok * D + j, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + tok * D + D // 2 + j, mask=ok, other=0.0).to(tl.float32)
    if head < HEADS:
        base = Q + tok * q_row + head * D
        x1 = tl.load(base + j, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + D // 2 + j, mask=ok, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, Q.dtype.element_ty)
        tl.store(base + j, o1, mask=ok)
        tl.store(base + D // 2 + j, o2, mask=ok)
    else:
        h = head - HEADS
        base = K + tok * k_row + h * D
        x1 = tl.load(base + j, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + D // 2 + j, mask=ok, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, K.dtype.element_ty)
        slot = tl.load(Slots + tok)
        blk, off = slot // BS, slot % BS
        kbase = KC + (blk * KVH + h) * (D * BS) + off            # keys: (blocks, kvh, D, BS)
        tl.store(kbase + j * BS, o1.to(KC.dtype.element_ty), mask=ok)
        tl.store(kbase + (D // 2 + j) * BS, o2.to(KC.dtype.element_ty), mask=ok)
        vbase = VC + ((blk * KVH + h) * BS + off) * D             # values: (blocks, kvh, BS, D)
        vrow = V + tok * v_row + h * D
        tl.store(vbase + j, tl.load(vrow + j, mask=ok, other=0.0), mask=ok)
        tl.store(vbase + D // 2 + j, tl.load(vrow + D // 2 + j, mask=ok, other=0.0), mask=ok)


def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Rotate ``q`` (tokens, heads, d) in place; rotate ``k`` (tokens, kv_heads, d) and store
    it and ``v`` at ``slots`` of one layer's paged cache. ``cos``/``sin``: (tokens, d),
    contiguous; ``q``, ``k`` and ``v`` hold each token's heads contiguously, their tokens
    any row stride apart (column slices of a fused q/k/v product)."""
    from raycolo.engine.executor.native import heads_contiguous

    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    block_size = value_cache.shape[2]
    if d % 2 or not all(heads_contiguous(t) for t in (q, k, v)) or not cos.is_contiguous() \
            or not sin.is_contiguous() or cos.shape != (tokens, d):
        raise ValueError("rope_and_write: q, k, v with each token's heads contiguous; cos and sin "
                         "(tokens, d) contiguous; d even")
    if tokens:
        _rope_write_kernel[(tokens, heads + kv_heads)](q, k, v, cos, sin, slots, key_cache, value_cache,
                                                       q.stride(0), k.stride(0), v.stride(0),
                                                       HEADS=heads, KVH=kv_heads, D=d, HALF=_pow2(d // 2),
                                                       BS=block_size)


@triton.jit
def _silu_mul_kernel(G, U, Out, cols, g_row, u_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < cols
    g = tl.load(G + row * g_row + i, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
    u = tl.load(U + row * u_row + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * cols + i, (s * u).to(Out.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass, for (rows, cols) ``gate`` and ``up`` whose rows are
    contiguous (any row stride: the two column halves of a fused gate/up product). The
    result is contiguous: ``gate`` itself, overwritten, where ``gate`` is contiguous, else a
    new tensor."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("silu_mul: gate and up must be (rows, cols) of one shape, rows contiguous")
    rows, cols = gate.shape
    out = gate if gate.is_contiguous() else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if rows and cols:
        _silu_mul_kernel[(rows, triton.cdiv(cols, SILU_BLOCK))](gate, up, out, cols, gate.stride(0), up.stride(0),
                                                                BLOCK=SILU_BLOCK)
    return out
