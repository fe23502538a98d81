"""raycolo's native CPU kernels: built from C on first use, loaded with ctypes.

* **Paged attention** (``kernels/paged_attention.c``): each query token attends to its
  sequence's keys and values read in place from the paged cache through the block table,
  so a decode step no longer gathers every sequence's K/V into a padded copy (that gather
  and the copy were 37 % of decode time at 256 requests, docs/executor.md).
* **Fused pointwise steps** (``kernels/pointwise.c``, float32): the residual add with the
  RMSNorm after it, the rotary embedding with the K/V cache write, and the gated MLP's ``silu(gate) * up``
  over the strided halves of a fused gate/up product; each replaces a handful of torch
  ops and their temporaries (about 8 % of decode time, docs/executor.md).

* **Build.** ``$CC`` (default ``cc``) compiles with ``-O3 -march=native -ffast-math -fopenmp``
  and links without ``-ffast-math`` (so loading it never changes the process's floating
  point mode: subnormals stay), into
  ``$RAYCOLO_KERNEL_CACHE`` (default ``~/.cache/raycolo/kernels``), one file per source,
  flags, compiler and CPU; built once (about 1 s) and reused by every process. A build
  goes to a temporary name and is renamed into place, so actors starting together never
  load a half-written library.
* **Threads.** The library is linked with ``-fopenmp`` against ``libgomp.so.1``; torch has
  already loaded its own ``libgomp.so.1``, so the kernel runs on torch's OpenMP pool with
  ``torch.get_num_threads()`` threads (no second pool spinning on the same cores).
* **No compiler, or a failed build:** the executor keeps its torch attention path, and
  says so once in the log. ``RAYCOLO_NATIVE_KERNELS=0`` turns the kernels off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("raycolo.engine.executor")

SOURCES = tuple(Path(__file__).with_name("kernels") / name
                for name in ("paged_attention.c", "pointwise.c"))
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked without -ffast-math: GCC 12 links crtfastmath.o into a -ffast-math shared library,
# whose constructor sets flush-to-zero for the whole process on load (subnormal floats
# vanish in torch, numpy and everything else; hypothesis noticed). The compile keeps it.
LINK_FLAGS = ("-shared", "-fopenmp")
FLAGS = COMPILE_FLAGS + LINK_FLAGS
DISABLE_ENV = "RAYCOLO_NATIVE_KERNELS"
CACHE_ENV = "RAYCOLO_KERNEL_CACHE"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ATTENTION_ARGS = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_double, _P, ctypes.c_int]
_FUNCTIONS = {torch.float32: "paged_attention_f32", torch.float64: "paged_attention_f64"}
_SIGNATURES = {
    "paged_attention_f32": (_ATTENTION_ARGS, ctypes.c_int),
    "paged_attention_f64": (_ATTENTION_ARGS, ctypes.c_int),
    "add_rms_norm_f32": ([_P, _P, _P, _I, _I, ctypes.c_double, _P, ctypes.c_int], None),
    "silu_mul_f32": ([_P, _P, _I, _I, _I, _I, _P, ctypes.c_int], None),
    "rope_write_f32": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_int], None),
}

_state: dict = {}   # "lib": the loaded library or None, once tried


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return os.uname().machine


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc"))


def library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES), " ".join(FLAGS),
                                    version, _cpu_signature()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raycolo" / "kernels")
    return root / f"raycolo-kernels-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    objs = [f"{tmp}.{src.stem}.o" for src in SOURCES]
    try:
        cmds = [[compiler, *COMPILE_FLAGS, "-c", "-o", obj, str(src)] for src, obj in zip(SOURCES, objs)]
        for cmd in cmds + [[compiler, *LINK_FLAGS, "-o", tmp, *objs, "-lm"]]:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                errors = [l for l in done.stderr.splitlines() if "error" in l] or done.stderr.strip().splitlines()
                raise RuntimeError(errors[0].strip() if errors else f"{compiler} exited {done.returncode}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, *objs):
            if os.path.exists(path):
                os.unlink(path)


def _load() -> Optional[ctypes.CDLL]:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
    target = library_path(compiler)
    if not target.exists():
        _build(compiler, target)
    lib = ctypes.CDLL(str(target))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def native_library() -> Optional[ctypes.CDLL]:
    """The kernel library, built on first use; None (logged once) where it cannot be."""
    if "lib" not in _state:
        try:
            _state["lib"] = _load()
        except Exception as exc:  # no compiler, a failed build or load: keep the torch path
            _state["lib"] = None
            log.warning("raycolo executor: native CPU attention unavailable (%s); using the "
                        "torch attention path (correct, slower)", exc)
    return _state["lib"]


def native_attention_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _FUNCTIONS and native_library() is not None


def paged_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: torch.Tensor,
                    table_start: torch.Tensor, positions: torch.Tensor, window: Optional[int],
                    scale: float) -> torch.Tensor:
    """Attention of ``q`` (tokens, heads, head_dim) over one layer's paged ``key``
    (num_blocks, kv_heads, head_dim, block_size) and ``value`` (num_blocks, kv_heads,
    block_size, head_dim), the layouts of :class:`PagedKVCache`: token ``i`` sees the keys at positions
    ``[max(0, p - window + 1), p]`` of the sequence whose block table starts at
    ``tables[table_start[i]]``, where ``p = positions[i]``. Returns (tokens, heads, head_dim)."""
    lib = native_library()
    q = rows_of_heads(q)
    tokens, heads, head_dim = q.shape
    blocks, kv_heads, block_size, _ = value.shape
    if key.shape != (blocks, kv_heads, head_dim, block_size):
        raise ValueError(f"paged_attention: key shape {tuple(key.shape)} does not match value shape "
                         f"{tuple(value.shape)}")
    for t in (key, value, tables, table_start, positions):
        if not t.is_contiguous():
            raise ValueError("paged_attention: inputs must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype)
    failed = getattr(lib, _FUNCTIONS[q.dtype])(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), tables.data_ptr(), table_start.data_ptr(),
        positions.data_ptr(), window or 0, tokens, heads, kv_heads, head_dim, block_size,
        q.stride(0), scale, out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("paged_attention: could not allocate the kernel's scratch memory")
    return out


def fused_pointwise_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`add_rms_norm`, :func:`rope_and_write` and :func:`silu_mul` run here
    (float32 on the CPU)."""
    return device.type == "cpu" and dtype == torch.float32 and native_library() is not None


def add_rms_norm(residual: torch.Tensor, x: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place (skipped when ``x`` is None), then the RMSNorm of each
    row of ``residual``: ``weight * residual * rsqrt(mean(residual**2) + eps)``, as
    transformers' ``LlamaRMSNorm`` computes it. Float32, contiguous (rows, dim)."""
    rows, dim = residual.shape
    if x is not None and (x.shape != residual.shape or not x.is_contiguous()):
        raise ValueError("add_rms_norm: x must be contiguous and shaped like residual")
    if not residual.is_contiguous() or not weight.is_contiguous() or weight.shape != (dim,):
        raise ValueError("add_rms_norm: residual and weight must be contiguous, weight (dim,)")
    out = torch.empty_like(residual)
    native_library().add_rms_norm_f32(residual.data_ptr(), None if x is None else x.data_ptr(),
                                      weight.data_ptr(), rows, dim, eps, out.data_ptr(),
                                      torch.get_num_threads())
    return out


def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The rotary embedding (``x * cos + rotate_half(x) * sin``, as transformers'
    ``apply_rotary_pos_emb``) on ``q`` (tokens, heads, d) in place and on ``k`` (tokens,
    kv_heads, d), with the rotated ``k`` and ``v`` stored at flat ``slots`` (int64, ``block
    * block_size + offset``) of one layer's cache (``key_cache`` (blocks, kv_heads, d,
    block_size), ``value_cache`` (blocks, kv_heads, block_size, d), :class:`PagedKVCache`)
    in one pass; ``k`` itself is left as it was. Float32; ``cos``/``sin`` (tokens, d)
    contiguous; ``q``, ``k`` and ``v`` with each token's heads contiguous
    (:func:`heads_contiguous`; tokens may lie apart, as column slices of a fused q/k/v
    product do)."""
    tokens, heads, d = q.shape
    blocks, kv_heads, block_size, _ = value_cache.shape
    if not (heads_contiguous(q) and heads_contiguous(k) and heads_contiguous(v) and cos.is_contiguous()
            and sin.is_contiguous()) or cos.shape != (tokens, d) or sin.shape != (tokens, d) \
            or k.shape != (tokens, kv_heads, d) or v.shape != k.shape or d % 2 \
            or key_cache.shape != (blocks, kv_heads, d, block_size) or not key_cache.is_contiguous() \
            or not value_cache.is_contiguous() or slots.dtype != torch.int64 or slots.shape != (tokens,) \
            or not slots.is_contiguous() or any(t.dtype != torch.float32 for t in (q, k, v, key_cache, value_cache)):
        raise ValueError("rope_and_write: float32 q (tokens, heads, d), k and v (tokens, kv_heads, d) "
                         "with each token's heads contiguous; cos and sin (tokens, d) contiguous; d even; "
                         "int64 slots (tokens,); contiguous caches of the PagedKVCache layouts")
    low, high = torch.aminmax(slots) if tokens else (0, 0)      # (the C kernel trusts them)
    if low < 0 or high >= blocks * block_size:
        raise ValueError(f"rope_and_write: a slot lies outside the cache's {blocks * block_size}")
    native_library().rope_write_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tokens,
                                    heads, kv_heads, d, q.stride(0), k.stride(0), v.stride(0), block_size,
                                    torch.get_num_threads())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for float32 (rows, cols) ``gate`` and ``up`` whose rows are
    contiguous (any row stride: the column halves of a fused gate/up product), in one pass.
    The result is contiguous: ``gate`` itself, overwritten, where ``gate`` is contiguous."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1 \
            or gate.dtype != torch.float32 or up.dtype != torch.float32:
        raise ValueError("silu_mul: gate and up must be float32 (rows, cols) of one shape, rows contiguous")
    rows, cols = gate.shape
    out = gate if gate.is_contiguous() else torch.empty(gate.shape, dtype=gate.dtype)
    native_library().silu_mul_f32(gate.data_ptr(), up.data_ptr(), rows, cols, gate.stride(0), up.stride(0),
                                  out.data_ptr(), torch.get_num_threads())
    return out


def heads_contiguous(x: torch.Tensor) -> bool:
    """``x`` (tokens, heads, d) holds each token's heads contiguously (its tokens may lie
    any whole number of elements apart): what the kernels index by a row stride."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where :func:`heads_contiguous`, else a contiguous copy."""
    return x if heads_contiguous(x) else x.contiguous()
