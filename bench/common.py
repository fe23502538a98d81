"""Helpers the benchmark scripts share (run as ``python bench/X.py``: this folder is on
``sys.path``)."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str, data) -> None:
    """Write a benchmark's machine-readable results (``--json PATH``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))


def pids_titled(prefix: str) -> list[int]:
    """Processes whose title (first command-line word) starts with ``prefix``, e.g. a Ray
    actor's ``ray::EngineActor``: what the fault benchmarks kill."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(prefix)]
