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
