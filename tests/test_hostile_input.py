"""Hostile and malformed input, generated (hypothesis): every surface either accepts the
input or refuses it with one ``error:`` line that names the field or file. Never a
traceback, never a hang.

Surfaces: application-graph YAML, request files, online deployment configs, trace CSVs,
and the flags of the CLI commands that run in-process. Each file surface gets
``FUZZ_EXAMPLES`` generated inputs (default 500; ``make fuzz`` sets
``RAYCOLO_FUZZ_EXAMPLES`` higher); the CLI flags get a fifth of that per command, since
an accepted flag runs the command. Every run counts what it tried and how each ended
(``FUZZ_COUNTS``, printed at the end of the session: tried, rejected cleanly, accepted;
a crash fails the test that met it).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from raycolo.errors import RaycoloError

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="session", autouse=True)
def _report_counts():
    yield
    if FUZZ_COUNTS:
        surfaces = sorted({s for s, _ in FUZZ_COUNTS})
        lines = [f"  {s}: tried {FUZZ_COUNTS[(s, 'tried')]}, rejected cleanly {FUZZ_COUNTS[(s, 'rejected')]}, "
                 f"accepted {FUZZ_COUNTS[(s, 'accepted')]}, crashed 0" for s in surfaces]
        print("\nhostile input:\n" + "\n".join(lines))


# -- application graphs (raycolo plan / compare / run) ------------------------------------------
TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
TINY_PATHS = _paths(TINY)


@FUZZ
@given(path=st.sampled_from(TINY_PATHS), value=VALUES, extra=st.sampled_from([None, "tail"]))
def test_application_graphs(tmp_path_factory, path, value, extra):
    from raycolo.offline.dag import load_app
    from raycolo.offline.workload import build_workload

    f = tmp_path_factory.mktemp("app") / "app.yaml"
    _write_yaml(f, _mutate(TINY, path if extra is None else path + ["tail"], value))
    _clean("application graph YAML", lambda: build_workload(load_app(f), requests=4))


@FUZZ
@given(raw=st.binary(max_size=200))
def test_application_graph_bytes(tmp_path_factory, raw):
    from raycolo.offline.dag import load_app

    f = tmp_path_factory.mktemp("app") / "app.yaml"
    f.write_bytes(raw)
    _clean("application graph bytes", lambda: load_app(f))


@pytest.mark.parametrize("text", [f"name: x\nnodes: {_deep(5000)}\n", f"lora: {_deep(3000)}\n",
                                  "a: &a [*a]\n", "a: " + "{b: " * 3000 + "1" + "}" * 3000 + "\n"])
def test_deep_and_self_referencing_yaml_is_refused_in_one_line(tmp_path, text):
    from raycolo.offline.dag import load_app
    from raycolo.online.config import load_online_config

    f = tmp_path / "deep.yaml"
    f.write_text(text)
    _clean("deep YAML (application graph)", lambda: load_app(f))
    _clean("deep YAML (online config)", lambda: load_online_config(f))


# -- request files ---------------------------------------------------------------------------------
@FUZZ
@given(rows=st.lists(st.one_of(st.dictionaries(st.sampled_from(["prompt", "input_tokens", "output_tokens",
                                                                 "text", "id"]), VALUES, max_size=3),
                               VALUES), min_size=0, max_size=5),
       junk=st.sampled_from(["", "\xff\xfe", "{", "[1, 2]", "null"]))
def test_request_files(tmp_path_factory, rows, junk):
    from raycolo.offline.workload import _read_request_file

    f = tmp_path_factory.mktemp("req") / "requests.jsonl"
    lines = []
    for r in rows:
        try:
            lines.append(json.dumps(r, allow_nan=True))
        except (TypeError, ValueError):
            lines.append(str(r))
    data = ("\n".join(lines) + "\n" + junk).encode("utf-8", "surrogateescape") if junk != "\xff\xfe" \
        else "\n".join(lines).encode() + b"\n\xff\xfe\n"
    f.write_bytes(data)
    _clean("request file", lambda: _read_request_file(f, None))


# -- online configs (raycolo online run / serve) -------------------------------------------------
ONLINE = yaml.safe_load((ROOT / "examples" / "online.yaml").read_text())
ONLINE_PATHS = _paths(ONLINE) + [["lora", "dpo_beta"], ["lemix", "harli_b1"], ["serve", "host"], ["stage", "memory_bytes"]]


@FUZZ
@given(path=st.sampled_from(ONLINE_PATHS), value=VALUES)
def test_online_configs(tmp_path_factory, path, value):
    from raycolo.online.config import layer_bounds, load_online_config, model_hf_config

    f = tmp_path_factory.mktemp("online") / "online.yaml"
    _write_yaml(f, _mutate(ONLINE, path, value))

    def load():
        config = load_online_config(str(f))
        layer_bounds(model_hf_config(config.model_loading_config.model_id).num_hidden_layers, config.stages)
    _clean("online config", load)


# -- trace CSVs (simulate-online --trace, online run --trace) -------------------------------------
CELLS = st.one_of(st.sampled_from(["", "nan", "inf", "-inf", "-1", "0", "1e400", "train", "inference", "x",
                                   "99999999999999999999", "1.5", " 3", "\"", ","]),
                  NUMBERS.map(str), TEXT)


@FUZZ
@given(header=st.lists(st.sampled_from(["timestamp", "length", "kind", "decode_tokens", "batch", "max_tokens",
                                        "extra", ""]), min_size=0, max_size=6),
       rows=st.lists(st.lists(CELLS, min_size=0, max_size=6), min_size=0, max_size=6))
def test_trace_csvs(tmp_path_factory, header, rows):
    from raycolo.online.tasks import load_trace

    f = tmp_path_factory.mktemp("trace") / "trace.csv"
    with f.open("w", encoding="utf-8", errors="surrogateescape") as out:
        out.write(",".join(header) + "\n")
        for row in rows:
            out.write(",".join(row) + "\n")
    _clean("trace CSV", lambda: load_trace(f, seed=0, limit=50))


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


@pytest.mark.parametrize("command", sorted(SMALL))
def test_cli_flags(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                      # output flags write here, never in the repo
    flags = _value_flags(command)
    app = [str(ROOT / "examples" / "tiny.yaml")] if command in ("plan", "compare") else []

    @settings(max_examples=max(20, FUZZ_EXAMPLES // 5), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=PHASES)
    @given(flag=st.sampled_from(flags), value=HOSTILE_FLAG_VALUES)
    def check(flag, value):
        base = [x for i, x in enumerate(SMALL[command])
                if not (x == flag or (i > 0 and SMALL[command][i - 1] == flag))]
        rc, err = _run_cli([command, *app, *base, flag, value])
        FUZZ_COUNTS[(f"CLI {command} flags", "tried")] += 1
        assert "Traceback" not in err, err
        if rc == 0:
            FUZZ_COUNTS[(f"CLI {command} flags", "accepted")] += 1
            return
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (flag, value, rc, err)
        FUZZ_COUNTS[(f"CLI {command} flags", "rejected")] += 1
        named = flag in lines[0] or flag.lstrip("-").replace("-", "_") in lines[0] or \
            any(ch in lines[0] for ch in (value.strip() or "\x01",)) or "argument" in lines[0]
        assert named, (flag, value, lines[0])

    check()


def test_numbers_that_no_surface_may_take_silently():
    """A few values every count flag must refuse, whatever else the fuzz tried."""
    for command, flag, values in (("simulate-online", "--tasks", ()), ("simulate-online", "--rate", ("0",)),
                                  ("sweep-online", "--tasks", ()), ("plan", "--requests", ()),
                                  ("plan", "--gpus", ()), ("plan", "--seed", ())):
        app = [str(ROOT / "examples" / "tiny.yaml")] if command == "plan" else []
        huge = ("99999999999999999999",) if flag != "--rate" else ()
        for value in ("nan", "-1", "1e400", *huge, *values):
            rc, err = _run_cli([command, *app, flag, value])
            assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), (command, flag, value, err)


@pytest.mark.parametrize("column", ["input_tokens", "chunks"])
@pytest.mark.parametrize("value", [10 ** 30, 2 ** 63, 1e300])
def test_a_request_file_with_a_huge_count_is_refused_naming_the_column(tmp_path, column, value):
    """A count past its bound (raycolo/bounds.py) is a clear error, not
    an OverflowError when the counts become an int64 array (hypothesis found 10^30)."""
    from raycolo.errors import ConfigError
    from raycolo.offline.workload import _read_request_file

    f = tmp_path / "requests.jsonl"
    f.write_text(json.dumps({"prompt": "hello", column: value}) + "\n")
    with pytest.raises(ConfigError, match=f"row 1: {column}: must be at most"):
        _read_request_file(f, None)


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
