"""Helpers the benchmark scripts share (run as ``python bench/X.py``: this folder is on
``sys.path``)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def write_json(path: str, data) -> None:
    """Write a benchmark's machine-readable results (``--json PATH``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))


def int_list(text: str, least: int = 1):
    """A flag's comma-separated integers, sorted, or None where one is not an integer
    >= ``least`` (or there are none)."""
    try:
        values = sorted(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        return None
    return values if values and all(v >= least for v in values) else None


def spread(values) -> float:
    """max - min of repeated runs' figures (0 for one run)."""
    values = list(values)
    return max(values) - min(values) if len(values) > 1 else 0.0


def holds_within_spread(ours, theirs) -> bool:
    """median(ours) >= median(theirs), within the larger of the two runs' spreads: what the
    grid benchmarks count as "at least as good"."""
    ours, theirs = list(ours), list(theirs)
    return statistics.median(ours) >= statistics.median(theirs) - max(spread(ours), spread(theirs))


def pids_titled(prefix: str) -> list[int]:
    """Processes whose title (first command-line word) starts with ``prefix``, e.g. a Ray
    actor's ``ray::EngineActor``: what the fault benchmarks kill."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(prefix)]
