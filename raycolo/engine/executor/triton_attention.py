"""Paged attention on the GPU as a Triton kernel that reads the KV cache in place.

The torch path gathers every sequence's blocks into a padded contiguous copy, builds a
mask and calls ``scaled_dot_product_attention``; at a batch of 64 or 256 on an H200 the
gather and the copies around it took about 40 % of the GPU's time (``torch.profiler``,
issue 46). This kernel takes the same arguments as the native CPU kernel
(:func:`raycolo.engine.executor.native.paged_attention`): the flat block tables, where
each token's table starts, and each token's position. It never gathers, copies or
repeats K/V, and builds no mask: each program walks its sequence's block table and
reads each block of keys and values once, with an online softmax (FlashAttention's
rescaling) in float32.

* **Grouped-query attention.** A program owns one KV head and the ``group`` query heads
  that share it; their rows are the M dimension of its ``tl.dot``, so a K/V block is
  read once for the whole group (SGLang's Triton decode kernel does the same).
* **Query tiles.** A prefill chunk's tokens are cut into tiles of ``TILE_TOKENS``
  consecutive tokens of one sequence; a program covers one tile x one KV head, i.e.
  ``tile * group`` query rows, each with its own causal and sliding-window limit. A
  decode step is tiles of one token.
* **Split-K for decode** (FlashDecoding). When the batch has too few (token, KV head)
  pairs to fill the GPU, each pair's blocks are split across up to :data:`MAX_SPLITS`
  programs whose partial softmax states a second small kernel merges. The number of
  splits depends only on shapes, so a captured CUDA graph keeps it.

On the CPU the same kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``),
which is how the tests check it against a brute-force reference without a GPU.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from raycolo.engine.executor.batch import TILE_TOKENS

MAX_SPLITS = 16         # split-K programs per (token, KV head) in a decode step
DOT_MIN = 16            # tl.dot needs every dimension >= 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DISABLE_ENV = "RAYCOLO_TRITON_ATTENTION"


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@triton.jit
def _attend_kernel(Q, K, V, Tables, TableStart, Positions, TileTok, TileLen, Out,
                   PartO, PartM, PartL, window, scale, q_row,
                   HEADS: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   KV_TILE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                   PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if TILE == 1:
        tok0 = tile
        ntok = 1
    else:
        tok0 = tl.load(TileTok + tile)
        ntok = tl.load(TileLen + tile)
    rows = tl.arange(0, TILE * BLOCK_G)
    t_off = rows // BLOCK_G
    g = rows % BLOCK_G
    valid = (t_off < ntok) & (g < G)
    tok = tok0 + tl.minimum(t_off, ntok - 1)
    pos = tl.load(Positions + tok)                                  # (M,)
    head = kvh * G + tl.minimum(g, G - 1)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, KV_TILE)
    q = tl.load(Q + tok[:, None] * q_row + head[:, None] * D + d[None, :],
                mask=valid[:, None] & (d[None, :] < D), other=0.0)
    tstart = tl.load(TableStart + tok0)
    first = tl.load(Positions + tok0)
    last = tl.load(Positions + tok0 + ntok - 1)
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
    span = last + 1 - lo                                             # keys the tile may see
    per = ((span + KV_TILE - 1) // KV_TILE + SPLITS - 1) // SPLITS * KV_TILE
    k0 = lo + split * per
    k1 = tl.minimum(k0 + per, last + 1)
    m_i = tl.full((TILE * BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((TILE * BLOCK_G,), tl.float32)
    acc = tl.zeros((TILE * BLOCK_G, BLOCK_D), tl.float32)
    head_off = kvh.to(tl.int64) * (D * BS)
    for n0 in range(k0, k1, KV_TILE):
        t = n0 + n                                                   # key positions
        inb = t < k1
        blk = tl.load(Tables + tstart + t // BS, mask=inb, other=0).to(tl.int64)
        base = blk * (KVH * D * BS) + head_off                       # each key's (block, head)
        off = t % BS
        k = tl.load(K + base[None, :] + d[:, None] * BS + off[None, :],
                    mask=(d[:, None] < D) & inb[None, :], other=0.0)             # (D, KV_TILE)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale                 # (M, KV_TILE)
        ok = (t[None, :] <= pos[:, None]) & inb[None, :]
        ok = ok & ((window <= 0) | (t[None, :] > pos[:, None] - window))
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + base[:, None] + off[:, None] * D + d[None, :],
                    mask=inb[:, None] & (d[None, :] < D), other=0.0)             # (KV_TILE, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + tok[:, None] * (HEADS * D) + head[:, None] * D + d[None, :],
                 out.to(Out.dtype.element_ty), mask=valid[:, None] & (d[None, :] < D))
    else:
        part = (tile * KVH + kvh) * SPLITS + split                   # decode: one token a tile
        tl.store(PartO + part * (BLOCK_G * BLOCK_D) + rows[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(PartM + part * BLOCK_G + rows, m_i)
        tl.store(PartL + part * BLOCK_G + rows, l_i)


@triton.jit
def _merge_kernel(PartO, PartM, PartL, Out, HEADS: tl.constexpr, KVH: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    tok = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    sp = tl.arange(0, SPLITS)
    part = (tok * KVH + kvh) * SPLITS + sp                               # (SPLITS,)
    m = tl.load(PartM + part[:, None] * BLOCK_G + g[None, :])            # (SPLITS, G)
    l = tl.load(PartL + part[:, None] * BLOCK_G + g[None, :])
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(m - top[None, :])                                         # 0 for empty splits
    total = tl.sum(w * l, 0)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for i in range(SPLITS):
        o = tl.load(PartO + ((tok * KVH + kvh) * SPLITS + i) * (BLOCK_G * BLOCK_D)
                    + g[:, None] * BLOCK_D + d[None, :])
        wi = tl.exp(tl.load(PartM + ((tok * KVH + kvh) * SPLITS + i) * BLOCK_G + g) - top)
        acc += o * wi[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    head = kvh * G + g
    tl.store(Out + tok * (HEADS * D) + head[:, None] * D + d[None, :], out.to(Out.dtype.element_ty),
             mask=(g[:, None] < G) & (d[None, :] < D))


@functools.lru_cache(maxsize=None)
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(tokens: int, kv_heads: int, table_width: int, block_size: int, head_dim: int,
                  device: torch.device) -> int:
    """Split-K programs per (token, KV head) of a decode step, a power of two: enough to give
    every SM two programs, each covering at least one key tile of the widest table."""
    if device.type != "cuda":
        sms = 8                                       # the interpreter: exercise the merge
    else:
        sms = _processors(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-2 * sms // max(1, tokens * kv_heads))
    most = max(1, table_width * block_size // kv_tile(head_dim))
    n = max(1, min(want, most, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def kv_tile(head_dim: int) -> int:
    """Keys per iteration of a program: several blocks' worth, gathered through the table."""
    return 64 if head_dim <= 128 else 32


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the executor picks the kernel by itself: float16/bfloat16/float32 on a CUDA
    device, unless ``RAYCOLO_TRITON_ATTENTION=0``. (On the CPU it runs only when asked
    for, under Triton's interpreter: ``TRITON_INTERPRET=1`` before triton is imported.)"""
    return (os.environ.get(DISABLE_ENV, "1") != "0" and dtype in DTYPES
            and device.type == "cuda")


def _warps(rows: int) -> int:
    """Warps for a program over ``rows`` query rows: a prefill tile of 16 tokens x 8 query
    heads per K/V head (128 rows, head_dim 128: Llama-3-70B) spills registers at 4 warps (255 registers
    and 424 bytes of stack per thread, triton 3.9 compiling for sm_90) and not at 8."""
    return 8 if rows >= 128 else 4


def paged_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: torch.Tensor,
                    table_start: torch.Tensor, positions: torch.Tensor, window: Optional[int],
                    scale: float, tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Attention of ``q`` (tokens, heads, head_dim) over one layer's paged cache, with the
    arguments and layouts of :func:`raycolo.engine.executor.native.paged_attention`.
    ``tiles``: :func:`~.batch.query_tiles` of the step; None for a decode step (one token per
    sequence), which may then split each sequence's blocks (see the module docstring)."""
    from raycolo.engine.executor.native import rows_of_heads

    q = rows_of_heads(q)              # a column slice of a fused q/k/v product stays in place
    tokens, heads, head_dim = q.shape
    blocks, kv_heads, block_size, _ = value.shape
    if key.shape != (blocks, kv_heads, head_dim, block_size) or heads % kv_heads:
        raise ValueError(f"paged_attention: key {tuple(key.shape)}, value {tuple(value.shape)} and "
                         f"{heads} query heads do not fit together")
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    block_g, block_d = _pow2(group), _pow2(head_dim, DOT_MIN)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(HEADS=heads, KVH=kv_heads, G=group, D=head_dim, BS=block_size, BLOCK_D=block_d,
                  KV_TILE=kv_tile(head_dim), PRECISION=precision)
    if tiles is None:
        block_g = max(block_g, DOT_MIN)                       # one token: the group is all of M
        splits = decode_splits(tokens, kv_heads, tables.numel() // tokens, block_size, head_dim, q.device)
        tile_tok = tile_len = positions                       # unused with TILE=1
        grid = (tokens, kv_heads, splits)
        tile = 1
    else:
        tile_tok, tile_len = tiles
        tile = TILE_TOKENS
        splits, grid = 1, (tile_tok.numel(), kv_heads, 1)
    if splits > 1:
        parts = tokens * kv_heads * splits
        part_o = torch.empty((parts, block_g, block_d), dtype=torch.float32, device=q.device)
        part_m = torch.empty((parts, block_g), dtype=torch.float32, device=q.device)
        part_l = torch.empty((parts, block_g), dtype=torch.float32, device=q.device)
    else:
        part_o = part_m = part_l = out
    _attend_kernel[grid](q, key, value, tables, table_start, positions, tile_tok, tile_len, out,
                         part_o, part_m, part_l, int(window or 0), float(scale), q.stride(0),
                         BLOCK_G=block_g, TILE=tile, SPLITS=splits, num_warps=_warps(tile * block_g), **common)
    if splits > 1:
        _merge_kernel[(tokens, kv_heads)](part_o, part_m, part_l, out, HEADS=heads, KVH=kv_heads,
                                          G=group, D=head_dim, BLOCK_G=block_g, BLOCK_D=block_d,
                                          SPLITS=splits)
    return out
