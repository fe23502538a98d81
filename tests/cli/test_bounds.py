"""Issue 28's table, row by row, as a user meets it: ``raycolo`` in a subprocess exits 2
with one ``error:`` line naming the field (file and row, or flag), no traceback, and
writes nothing. Plus the bounds module's own rules, checked by hand."""
from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raycolo.bounds import MAX_TOKENS, field_bounds
from raycolo.catalog import _builtin_catalog

ROOT = Path(__file__).resolve().parents[2]
RAYCOLO = [sys.executable, "-m", "raycolo.cli"]
BASE = {"name": "tiny", "requests": {"count": 16, "input_tokens": {"distribution": "uniform", "min": 8, "max": 96}},
        "nodes": [{"name": "small", "model": "tiny-llama-s", "max_output_tokens": 64},
                  {"name": "medium", "model": "tiny-llama-m", "max_output_tokens": 64, "repeat": 1}],
        "edges": [{"from": "input", "to": "small"}, {"from": "small", "to": "medium"}]}


def _app(path, value, where: Path) -> Path:
    data = copy.deepcopy(BASE)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    f = where / "app.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _run(args, cwd: Path) -> tuple[int, str]:
    before = sorted(p.name for p in cwd.iterdir())
    done = subprocess.run(RAYCOLO + [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert sorted(p.name for p in cwd.iterdir()) == before, "wrote something"
    return done.returncode, done.stderr


def _refused(args, cwd: Path, *named: str) -> str:
    rc, err = _run(args, cwd)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (rc, err)
    for part in named:
        assert part in lines[0], (part, lines[0])
    return lines[0]


PLAN = ["plan", None, "--profile", "cpu", "--gpus", "2"]


@pytest.mark.parametrize("path, value, named", [
    (["requests", "count"], 10 ** 30, "count: must be at most 10000000"),
    (["requests", "count"], 10 ** 12, "count: must be at most"),
    (["requests", "count"], True, "count: must be an integer"),
    (["nodes", 0, "max_output_tokens"], 10 ** 30, "max_output_tokens: must be at most"),
    (["nodes", 0, "max_output_tokens"], 10 ** 6, "max_output_tokens: must be within tiny-llama-s's context"),
    (["nodes", 1, "repeat"], 10 ** 30, "repeat: must be at most"),
    (["requests", "input_tokens", "max"], 10 ** 30, "input_tokens.max: must be at most"),
    (["requests", "input_tokens"], {"distribution": "lognormal", "max": 96, "median": 20, "sigma": float("inf")},
     "sigma: must be a finite number"),
    (["requests", "input_tokens"], {"distribution": "lognormal", "max": 96, "median": float("inf")},
     "median: must be a finite number"),
    (["requests", "input_tokens"], {"distribution": "fixed", "max": 10, "value": 50}, "value (50) must lie within"),
    (["requests"], {"count": 4, "chunks": {"distribution": "fixed", "max": 4, "value": 2}, "chunk_tokens": 10 ** 30},
     "chunk_tokens: must be at most"),
    (["requests"], {"count": 4, "chunks": {"distribution": "fixed", "max": 12_000_000_000, "value": 12_000_000_000}},
     "chunks.max: must be at most"),
    (["nodes", 0, "route_weight"], 1e308, "route_weight: must be at most"),
    (["nodes", 0, "name"], "sm\nall", "name: must be one line of printable characters"),
])
def test_application_graph_values_are_refused_at_the_schema(tmp_path, path, value, named):
    f = _app(path, value, tmp_path)
    _refused([a if a is not None else f for a in PLAN], tmp_path, "app.yaml", named)


@pytest.mark.parametrize("line, named", [
    ('{"input_tokens": 1e30}', "row 1: input_tokens: must be at most"),
    ('{"input_tokens": 1234567890123456789012345678901234567890}', "row 1: input_tokens: must be at most"),
    ('{"input_tokens": true}', "row 1: input_tokens: must be an integer"),
    ('{"input_tokens": NaN}', "NaN is not a JSON number"),
    ('{"prompt": "hi", "chunks": 1e30}', "row 1: chunks: must be at most"),
])
def test_request_file_rows_are_refused_naming_file_row_and_column(tmp_path, line, named):
    (tmp_path / "req.jsonl").write_text(line + "\n")
    app = dict(BASE, requests={"file": "req.jsonl"})
    (tmp_path / "app.yaml").write_text(yaml.safe_dump(app))
    _refused(["plan", tmp_path / "app.yaml", "--profile", "cpu", "--gpus", "2"], tmp_path, "req.jsonl", named)


@pytest.mark.parametrize("rows, named", [
    ("0.0,1e30,4,1", "row 1: length: must be at most 1048576"),
    ("0.0,10,1e30,1", "row 1: decode_tokens: must be at most"),
    ("0.0,10,4,1e30", "row 1: batch: must be at most 4096"),
    ("1e300,10,4,1\n0,5,4,1", "row 1: timestamp: must be a number of seconds"),
])
def test_trace_rows_are_refused_naming_file_row_and_column(tmp_path, rows, named):
    (tmp_path / "trace.csv").write_text("timestamp,length,decode_tokens,batch\n" + rows + "\n")
    _refused(["simulate-online", "--trace", tmp_path / "trace.csv"], tmp_path, "trace.csv", named)


@pytest.mark.parametrize("args, named", [
    (["simulate-online", "--tasks", "20", "--slo-ms", "nan"], "--slo-ms: must be a finite number"),
    (["simulate-online", "--tasks", "20", "--slo-multiplier", "nan"], "--slo-multiplier: must be a finite number"),
    (["simulate-online", "--tasks", "20", "--rate", "1e30"], "--rate: must be at most"),
    (["simulate-online", "--tasks", "20", "--train-rate", "inf"], "--train-rate: must be a finite number"),
    (["sweep-online", "--tasks", "10", "--rates", "10,nan", "--train-rates", "0.5"], "--rates: must be a finite"),
    (["simulate-online", "--tasks", "20", "--plot", "/proc/x.png"], "--plot: cannot write in /proc"),
    (["simulate-online", "--tasks", "20", "--plot", "."], "--plot: . is a directory"),
    (["simulate-online", "--tasks", "20", "--plot", "x.txt"], "--plot: '.txt' is not a format"),
    (["plan", ROOT / "examples" / "tiny.yaml", "--profile", "cpu", "--gpus", "2", "--gantt", "/proc/x.png"],
     "--gantt: cannot write in /proc"),
    (["sweep-online", "--tasks", "10", "--rates", "10", "--train-rates", "0.5", "--out", "taken"],
     "--out: taken exists and is not a directory"),
    (["profile", "--model", "tiny-llama-s", "--out", "/proc/p"], "--out: cannot write in /proc"),
    # flags generated from raycolo/cli/options.py: the field's bounds and choices, before any work
    (["profile", "--model", "tiny-llama-s", "--tp", "65"], "--tp: must be at most 64"),
    (["profile", "--model", "tiny-llama-s", "--device", "tpu"], "--device: must be 'cpu' or 'cuda'"),
    (["validate", "--requests", "0"], "--requests: must be at least 1"),
    (["validate", "--threads", "1025"], "--threads: must be at most 1024"),
    (["simulate-online", "--tasks", "20", "--model", "gpt-9"], "--model: must be 'gpt-400m'"),
    (["simulate-online", "--tasks", "20", "--lengths", "imdb"], "--lengths: must be 'hh-rlhf' or 'shp'"),
    (["simulate-online", "--tasks", "20", "--nodes", "1e30"], "--nodes: must be an integer"),
    (["sweep-online", "--tasks", "10", "--rates", "10\n20"], "--rates: must be one line"),
    (["online", "run", ROOT / "examples" / "online.yaml", "--lengths", "imdb"], "--lengths: must be 'hh-rlhf' or 'shp'"),
    (["online", "run", ROOT / "examples" / "online.yaml", "--seed", "-1"], "--seed: must be at least 0"),
    (["serve", ROOT / "examples" / "online.yaml", "--address", "x" * 200], "--address: must have at most 128 characters"),
    (["plan", ROOT / "examples" / "tiny.yaml", "--policy", ""], "--policy: must have at least 1 character"),
    (["plan", ROOT / "examples" / "tiny.yaml", "--gpu-memory", "6"], "--gpu-memory: must be between 1 MiB and 1 PiB"),
    (["run", ROOT / "examples" / "tiny.yaml", "--gpu-memory", "80XB"], "--gpu-memory: must be a size such as 80GiB"),
])
def test_flags_are_refused_before_any_work(tmp_path, args, named):
    (tmp_path / "taken").write_text("a file the user keeps\n")
    _refused(args, tmp_path, named)
    assert (tmp_path / "taken").read_text() == "a file the user keeps\n"


def test_token_bound_covers_every_catalog_context_and_field_bounds_read_the_constraints():
    from raycolo.offline.dag import LengthDistribution, NodeSpec
    from raycolo.online.lemix_params import LemixParams

    assert max(m.context_length for m in _builtin_catalog().values()) <= MAX_TOKENS
    assert field_bounds(NodeSpec, "max_output_tokens") == (1, MAX_TOKENS, False, False)
    assert field_bounds(LemixParams, "slo_ms")[0] == 0 and field_bounds(LemixParams, "slo_ms")[2]   # > 0
    assert field_bounds(LengthDistribution, "sigma") == (0, 10, True, False)


def test_generated_flags_show_the_fields_default_and_bounds():
    rc = subprocess.run(RAYCOLO + ["simulate-online", "--help"], capture_output=True, text=True, timeout=120)
    text = " ".join(rc.stdout.split())
    assert "fraction of training tasks α (default 0.5; [0, 1])" in text
    assert "requests per second (default 50; (0, 1,000,000])" in text
    assert "online policy:" in text and "(default lemix)" in text


def test_the_config_reference_is_generated_from_the_models():
    """docs/config-reference.md quotes every default and bound from the models: regenerate
    it with ``python -m raycolo.cli.flags > docs/config-reference.md`` when a field changes."""
    from raycolo.cli.flags import config_reference

    assert (ROOT / "docs" / "config-reference.md").read_text() == config_reference()


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", p) for n, p in _subparsers(sub))


HAND_WRITTEN = {"--trace", "--dag", "--plot", "--gantt", "--output", "--help"}   # files (raycolo/paths.py), help


def test_every_value_flag_is_generated_from_a_model_field():
    """A flag with a value takes its type, bounds, default and help from a field (of
    RunConfig, OnlineConfig, raycolo/cli/options.py...), so none restates a default
    or a bound; only the file flags are by hand, checked by raycolo/paths.py."""
    from raycolo.cli.main import build_parser

    by_hand = sorted(f"{name} {opt}" for name, sub in _subparsers(build_parser()) for a in sub._actions
                     for opt in a.option_strings[:1] if a.nargs != 0 and opt not in HAND_WRITTEN
                     and not hasattr(a.type, "field"))
    assert by_hand == [], by_hand
