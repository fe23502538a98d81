"""Hostile input generated from the schemas: every field of every model (application
graphs, online configs, request and trace rows) set to each hostile value, and every value
flag of every command (in-process, and those that start Ray or torch, judged before any
of that) given each hostile value: one ``error:`` line naming the field or flag, or accepted.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.hostile import (FUZZ_COUNTS, FUZZ_EXAMPLES, ONLINE, ROOT, SKIP_FLAGS, SMALL, TINY, _clean,
                                   _run_cli, _value_flags)


# -- generated from the schemas: every field of every model, each set to each hostile value -------
DEEP = "__DEEP__"                  # stands for 5,000 levels of nesting, written as text
SCHEMA_HOSTILE = [10 ** 30, -1, 0, 1e308, float("nan"), float("inf"), float("-inf"), True, "", "x" * 10_000,
                  [1], {"a": 1}, DEEP]
# no field of any model may take these: every number is finite, bounded and strictly typed
NEVER = (10 ** 30, 1e308, True, DEEP)


def _never(case, flags: set) -> bool:
    """Some value of ``case`` no field may take (``True`` only where the field is not a
    flag: ``flags`` holds the boolean fields' names)."""
    for path, v in dict(case).items():          # a path set twice holds its last value
        if v is True and path[-1] in flags:
            continue
        if isinstance(v, float) and not math.isfinite(v) or any(v is n or (type(v) is type(n) and v == n)
                                                                for n in NEVER):
            return True
    return False


@functools.lru_cache(maxsize=None)
def boolean_fields_of(model) -> frozenset:
    return frozenset(boolean_fields(model.model_json_schema()))


def boolean_fields(schema: dict) -> set:
    out = set()
    for node in [schema, *schema.get("$defs", {}).values()]:
        for name, field in node.get("properties", {}).items():
            if "boolean" in {field.get("type"), *(o.get("type") for o in field.get("anyOf", []))}:
                out.add(name)
    return out


def _schema_check(surface: str, model, case, fn) -> None:
    accepted = _clean(surface, fn)
    assert not (accepted and _never(case, boolean_fields_of(model))), (surface, case)


def schema_paths(schema: dict, node=None, prefix=()) -> list[tuple]:
    """Every field path of a pydantic model's JSON schema, through nested models, lists
    (item 0) and mappings (``additionalProperties``: each key the base data has, here
    ``"*"``, filled in by :func:`_fill`)."""
    defs = schema.get("$defs", {})
    node = schema if node is None else node
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    out = []
    for option in node.get("anyOf", []):
        out += schema_paths(schema, option, prefix)
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        out += schema_paths(schema, node["items"], prefix + (0,))
    if isinstance(node.get("additionalProperties"), dict):
        out += schema_paths(schema, node["additionalProperties"], prefix + ("*",))
    for name, field in node.get("properties", {}).items():
        out.append(prefix + (name,))
        out += schema_paths(schema, field, prefix + (name,))
    return sorted(set(out), key=str)


def _fill(path: tuple, base) -> list:
    """``path`` with each ``"*"`` the first key ``base`` has there."""
    out, node = [], base
    for part in path:
        if part == "*":
            part = next(iter(node)) if isinstance(node, dict) and node else "x"
        out.append(part)
        node = node[part] if isinstance(node, (dict, list)) and part in (node if isinstance(node, dict)
                                                                          else range(len(node))) else None
    return out


def _set(data, path: list, value):
    """Set ``value`` at ``path``; nothing where an earlier mutation of the same case
    changed what lies on the path (a list where a mapping was, or the reverse)."""
    node = data
    for part in path[:-1]:
        if isinstance(node, list):
            node = node[part] if isinstance(part, int) and part < len(node) else None
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            return
    last = path[-1]
    if isinstance(node, list):
        if isinstance(last, int) and last < len(node):
            node[last] = value
    elif isinstance(node, dict):
        node[last] = value


def schema_cases(model, base: dict, count: int, seed: int = 0) -> list[list[tuple]]:
    """``count`` mutations of ``base`` (lists of (path, value)): every field path with
    every hostile value once, then pairs of them drawn with ``seed`` up to ``count``."""
    import random
    singles = [(tuple(_fill(p, base)), v) for p in schema_paths(model.model_json_schema()) for v in SCHEMA_HOSTILE]
    cases = [[s] for s in singles]
    rng = random.Random(seed)
    while len(cases) < count:
        cases.append(rng.sample(singles, 2))
    return cases[:max(count, len(singles))]


def _mutated_text(base: dict, case, dump) -> str:
    data = json.loads(json.dumps(base))
    for path, value in case:
        _set(data, list(path), value)
    text = dump(data)
    deep = "[" * 5000 + "]" * 5000
    return text.replace(json.dumps(DEEP), deep).replace(repr(DEEP), deep).replace(DEEP, deep)


def _yaml(data) -> str:
    return yaml.safe_dump(data, allow_unicode=True, width=1 << 20)


APP_BASE = {**{k: v for k, v in TINY.items() if k != "requests"}, "sources": {"input": TINY["requests"]}}


def test_application_graph_schema(tmp_path):
    from raycolo.offline.dag import AppSpec, load_app
    from raycolo.offline.workload import build_workload

    f = tmp_path / "app.yaml"
    for case in schema_cases(AppSpec, APP_BASE, FUZZ_EXAMPLES):
        f.write_text(_mutated_text(APP_BASE, case, _yaml), encoding="utf-8")
        _schema_check("schema: application graph", AppSpec, case, lambda: build_workload(load_app(f), requests=4))


def test_online_config_schema(tmp_path):
    from raycolo.online.config import OnlineConfig, layer_bounds, load_online_config, model_hf_config

    f = tmp_path / "online.yaml"

    def load():
        config = load_online_config(str(f))
        layer_bounds(model_hf_config(config.model_loading_config.model_id).num_hidden_layers, config.stages)
    for case in schema_cases(OnlineConfig, ONLINE, FUZZ_EXAMPLES):
        f.write_text(_mutated_text(ONLINE, case, _yaml), encoding="utf-8")
        _schema_check("schema: online config", OnlineConfig, case, load)


def test_request_row_schema(tmp_path):
    from raycolo.offline.workload import RequestRow, _read_request_file

    base = {"prompt": "hello there", "input_tokens": 5, "chunks": 1}
    f = tmp_path / "requests.jsonl"
    dump = lambda d: "\n".join([json.dumps(base), json.dumps(d), json.dumps(base)]) + "\n"   # noqa: E731
    for case in schema_cases(RequestRow, base, FUZZ_EXAMPLES):
        f.write_text(_mutated_text(base, case, dump), encoding="utf-8")
        _schema_check("schema: request file row", RequestRow, case, lambda: _read_request_file(f, None))


def test_trace_row_schema(tmp_path):
    from raycolo.online.tasks import TraceRow, load_trace

    base = {"timestamp": 0.5, "length": 12, "kind": "inference", "batch": 1, "decode_tokens": 4, "max_tokens": 8}
    columns = list(base)
    f = tmp_path / "trace.csv"

    def dump(d):
        cell = lambda v: json.dumps(v) if isinstance(v, (list, dict)) else str(v)   # noqa: E731
        rows = [base, d, base]
        return ",".join(columns) + "\n" + "".join(",".join(f'"{cell(r[c])}"' for c in columns) + "\n" for r in rows)
    for case in schema_cases(TraceRow, base, FUZZ_EXAMPLES):
        f.write_text(_mutated_text(base, case, dump), encoding="utf-8")
        _schema_check("schema: trace CSV row", TraceRow, case, lambda: load_trace(f, seed=0))


# -- every value flag of every in-process command, each hostile value in turn ---------------------
FLAG_HOSTILE = ["1" + "0" * 30, "-1", "0", "1e308", "nan", "inf", "-inf", "true", "", "x" * 10_000]
PATH_FLAGS = {"--gantt", "--plot", "--out", "--output", "--save-profile", "--trace"}


def _path_values(tmp: Path) -> list[str]:
    (tmp / "existing.png").write_bytes(b"keep")
    (tmp / "adir").mkdir(exist_ok=True)
    return [str(tmp / "adir"), "/proc/raycolo/x.png", str(tmp / "existing.png"), str(tmp / "nosuffix")]


@pytest.mark.parametrize("command", sorted(SMALL))
def test_every_flag_with_every_hostile_value(command, tmp_path, monkeypatch):
    """Deterministic, not sampled: each value flag set to each of 10^30, -1, 0, 1e308,
    NaN, ±inf, true, "", 10,000 characters; each path flag to a directory, a path under
    /proc, an existing file and a name without a suffix. Exit 2 with one ``error:`` line
    naming the flag, or success; a refused value writes nothing."""
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    app = [str(ROOT / "examples" / "tiny.yaml")] if command in ("plan", "compare") else []
    surface = f"CLI {command}, every flag"
    for flag in _value_flags(command):
        values = _path_values(tmp_path) if flag in PATH_FLAGS else FLAG_HOSTILE
        for value in values:
            base = [x for i, x in enumerate(SMALL[command])
                    if not (x == flag or (i > 0 and SMALL[command][i - 1] == flag))]
            before = sorted(p.name for p in tmp_path.iterdir())
            monkeypatch.chdir(work)
            rc, err = _run_cli([command, *app, *base, flag, value])
            monkeypatch.chdir(tmp_path)
            FUZZ_COUNTS[(surface, "tried")] += 1
            assert "Traceback" not in err, (flag, value[:40], err[-2000:])
            if rc == 0:
                FUZZ_COUNTS[(surface, "accepted")] += 1
                shutil.rmtree(work)               # what the accepted run wrote
                work.mkdir()
                continue
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
                (flag, value[:40], rc, err[-500:][:500])
            # the flag, or for a file the flag names, the file
            assert flag in lines[0] or "argument" in lines[0] or (value and value[:40] in lines[0]), \
                (flag, value[:40], lines[0])
            assert sorted(p.name for p in tmp_path.iterdir()) == before and not any(work.iterdir()), (flag, value)
            assert (tmp_path / "existing.png").read_bytes() == b"keep" if flag in PATH_FLAGS else True
            FUZZ_COUNTS[(surface, "rejected")] += 1


# -- the commands that start Ray or torch: each flag's value is judged before any of that ------
# Each runs into a stop the test chose (a missing file, an unknown model), after the flags and
# the output paths are checked and before a cluster or a model starts: a value the flags
# accept ends there, with that stop's error, instead of starting the work.
MISSING = "no-such-file.yaml"
STOPPED = {("online", "run"): ([MISSING], MISSING),
           ("serve",): ([MISSING], MISSING),
           ("run",): ([MISSING], MISSING),
           ("run-dag",): (["--dag", MISSING, "--output", "out/x"], MISSING),
           ("profile",): (["--model", "no-such-model"], "--model"),
           ("validate",): (["--models", "no-such-model"], "--models")}


def _flags_of(words: tuple) -> list[str]:
    from raycolo.cli.main import build_parser

    parser = build_parser()
    for word in words:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return sorted(opt for a in parser._actions for opt in a.option_strings
                  if opt.startswith("--") and a.nargs != 0 and opt not in SKIP_FLAGS)


@pytest.mark.parametrize("words", sorted(STOPPED), ids=" ".join)
def test_every_flag_of_the_ray_commands_with_every_hostile_value(words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base, stop = STOPPED[words]
    surface = f"CLI {' '.join(words)}, every flag"
    _path_values(tmp_path)                                     # the existing file a path flag must keep
    for flag in _flags_of(words):
        for value in (_path_values(tmp_path) if flag in PATH_FLAGS else FLAG_HOSTILE):
            args = [x for i, x in enumerate(base) if not (x == flag or (i > 0 and base[i - 1] == flag))]
            if flag in ("--model", "--models", "--dag") and flag in base:
                continue                                      # the stop itself
            rc, err = _run_cli([*words, *args, flag, value], seconds=30)
            FUZZ_COUNTS[(surface, "tried")] += 1
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, \
                (flag, value[:40], rc, err[-500:])
            assert (tmp_path / "existing.png").read_bytes() == b"keep"
            if stop in lines[0] and flag not in lines[0]:
                FUZZ_COUNTS[(surface, "accepted")] += 1       # the flags took it; the stop refused the run
                continue
            assert flag in lines[0] or "argument" in lines[0] or (value and value[:40] in lines[0]), \
                (flag, value[:40], lines[0])
            FUZZ_COUNTS[(surface, "rejected")] += 1
