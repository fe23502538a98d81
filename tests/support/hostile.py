"""Hostile values and the helpers of the generated-input tests (tests/cli/test_hostile_input.py,
tests/cli/test_hostile_schemas.py): hypothesis strategies, the settings (``FUZZ_EXAMPLES``
inputs per surface, default 500; ``make fuzz`` sets ``RAYCOLO_FUZZ_EXAMPLES`` higher), the
counts of what was tried (``FUZZ_COUNTS``), and running the CLI in-process.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from collections import Counter
from pathlib import Path

import yaml
from hypothesis import HealthCheck, Phase, settings, strategies as st

from raycolo.errors import RaycoloError


ROOT = Path(__file__).resolve().parents[2]
FUZZ_EXAMPLES = int(os.environ.get("RAYCOLO_FUZZ_EXAMPLES", "500"))
FUZZ_COUNTS: Counter = Counter()
# no shrinking: a failure is reported as generated (shrinking deep YAML takes minutes)
PHASES = [Phase.explicit, Phase.generate]
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck), phases=PHASES)

# -- hostile values ------------------------------------------------------------------------------
NUMBERS = st.one_of(
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2 ** 63, -(2 ** 63), 10 ** 40, 1e308, float("nan"), float("inf")]),
)
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXT, inner, max_size=4)),
                      max_leaves=12)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _clean(surface: str, fn) -> bool:
    """``fn()`` returns (True: accepted), or raises a RaycoloError whose text is one line
    (False); anything else fails."""
    FUZZ_COUNTS[(surface, "tried")] += 1
    try:
        fn()
    except RaycoloError as exc:
        text = str(exc)
        assert text.strip() and len(text.splitlines()) == 1 and "Traceback" not in text, repr(text)
        FUZZ_COUNTS[(surface, "rejected")] += 1
        return False
    FUZZ_COUNTS[(surface, "accepted")] += 1
    return True


def _mutate(base: dict, path: list, value) -> dict:
    """``base`` with the value at ``path`` (keys/indices, created where missing) replaced."""
    data = json.loads(json.dumps(base))
    node = data
    for key in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(key, {}) if not isinstance(node.get(key), (dict, list)) else node[key]
        elif isinstance(node, list) and node:
            node = node[key % len(node)] if isinstance(key, int) else node[0]
        else:
            return data
        if not isinstance(node, (dict, list)):
            return data
    last = path[-1]
    if isinstance(node, dict):
        node[last if not isinstance(last, int) else str(last)] = value
    elif isinstance(node, list) and node:
        node[last % len(node) if isinstance(last, int) else 0] = value
    return data


def _paths(base) -> list[list]:
    """Every key path in ``base`` (to mutate one)."""
    out = []
    if isinstance(base, dict):
        for k, v in base.items():
            out.append([k])
            out.extend([k] + p for p in _paths(v))
    elif isinstance(base, list):
        for i, v in enumerate(base):
            out.append([i])
            out.extend([i] + p for p in _paths(v))
    return out


def _write_yaml(path: Path, data) -> Path:
    try:
        path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    except (yaml.YAMLError, RecursionError, UnicodeEncodeError):
        path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


# -- application graphs (raycolo plan / compare / run) ------------------------------------------
TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
TINY_PATHS = _paths(TINY)
# -- online configs (raycolo online run / serve) -------------------------------------------------
ONLINE = yaml.safe_load((ROOT / "examples" / "online.yaml").read_text())
ONLINE_PATHS = _paths(ONLINE) + [["lora", "dpo_beta"], ["lemix", "harli_b1"], ["serve", "host"], ["stage", "memory_bytes"]]
# -- CLI flags (in-process; an accepted value runs the command, kept small) -----------------------
HOSTILE_FLAG_VALUES = st.one_of(
    st.sampled_from(["nan", "NaN", "inf", "-inf", "-1", "0", "1e400", "1e12", "99999999999999999999", "abc", "",
                     " ", "0x10", "1,2", ",", "1e-300", "-0", "١٢", "--json", "\x00", "../../etc/passwd",
                     _deep(200)]),
    TEXT.filter(lambda s: "\x00" not in s),
)
SMALL = {"plan": ["--requests", "8", "--gpus", "2", "--nvlink-group", "1", "--gpu-memory", "4GiB", "--profile", "cpu"],
         "compare": ["--requests", "8", "--gpus", "2", "--nvlink-group", "1", "--gpu-memory", "4GiB",
                     "--profile", "cpu", "--policies", "samullm,max"],
         "simulate-online": ["--tasks", "20"],
         "sweep-online": ["--tasks", "10", "--rates", "10", "--train-rates", "0.5", "--policies", "mix-rr"]}
SKIP_FLAGS = {"--help"}


def _value_flags(command: str) -> list[str]:
    from raycolo.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sorted(opt for a in sub._actions for opt in a.option_strings
                  if opt.startswith("--") and a.nargs != 0 and opt not in SKIP_FLAGS)


def _run_cli(argv: list[str], seconds: int = 60) -> tuple[int, str]:
    from raycolo.cli.main import main

    def timeout(*_):
        raise TimeoutError(f"raycolo {' '.join(argv)} did not finish in {seconds} s")

    err, out = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, err.getvalue()
