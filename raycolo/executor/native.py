"""raycolo's native CPU kernels: built from C on first use, loaded with ctypes.

The one kernel so far is paged attention (``kernels/paged_attention.c``): each query token
attends to its sequence's keys and values read in place from the paged cache through the
block table, so a decode step no longer gathers every sequence's K/V into a padded copy
(that gather and the copy were 37 % of decode time at 256 requests, docs/executor.md).

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

log = logging.getLogger("raycolo.executor")

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked without -ffast-math: GCC 12 links crtfastmath.o into a -ffast-math shared library,
# whose constructor sets flush-to-zero for the whole process on load (subnormal floats
# vanish in torch, numpy and everything else; hypothesis noticed). The compile keeps it.
LINK_FLAGS = ("-shared", "-fopenmp")
FLAGS = COMPILE_FLAGS + LINK_FLAGS
DISABLE_ENV = "RAYCOLO_NATIVE_KERNELS"
CACHE_ENV = "RAYCOLO_KERNEL_CACHE"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_double, _P, ctypes.c_int]
_FUNCTIONS = {torch.float32: "paged_attention_f32", torch.float64: "paged_attention_f64"}

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
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raycolo" / "kernels")
    return root / f"paged_attention-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in ([compiler, *COMPILE_FLAGS, "-c", "-o", obj, str(SOURCE)],
                    [compiler, *LINK_FLAGS, "-o", tmp, obj, "-lm"]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                                   else f"{compiler} exited {done.returncode}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
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
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
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
    """Attention of ``q`` (tokens, heads, head_dim) over one layer's paged ``key``/``value``
    (num_blocks, block_size, kv_heads, head_dim): token ``i`` sees the keys at positions
    ``[max(0, p - window + 1), p]`` of the sequence whose block table starts at
    ``tables[table_start[i]]``, where ``p = positions[i]``. Returns (tokens, heads, head_dim)."""
    lib = native_library()
    q = q.contiguous()
    tokens, heads, head_dim = q.shape
    blocks, block_size, kv_heads, _ = key.shape
    for t in (key, value, tables, table_start, positions):
        if not t.is_contiguous():
            raise ValueError("paged_attention: inputs must be contiguous")
    out = torch.empty_like(q)
    failed = getattr(lib, _FUNCTIONS[q.dtype])(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), tables.data_ptr(), table_start.data_ptr(),
        positions.data_ptr(), window or 0, tokens, heads, kv_heads, head_dim, block_size, scale,
        out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("paged_attention: could not allocate the kernel's scratch memory")
    return out
