"""Hostile and malformed input, generated (hypothesis): every surface either accepts the
input or refuses it with one ``error:`` line that names the field or file. Never a
traceback, never a hang.

Surfaces: application-graph YAML, request files, online deployment configs, trace CSVs,
and the flags of the CLI commands that run in-process. Each file surface gets
``FUZZ_EXAMPLES`` generated inputs (tests/support/hostile.py); the CLI flags get a fifth
of that per command, since an accepted flag runs the command. Every run counts what it
tried and how each ended (``FUZZ_COUNTS``, printed at the end of the session by
tests/cli/conftest.py: tried, rejected cleanly, accepted; a crash fails the test that met it).
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support.hostile import (FUZZ, FUZZ_COUNTS, FUZZ_EXAMPLES, HOSTILE_FLAG_VALUES, NUMBERS, ONLINE,
                                   ONLINE_PATHS, PHASES, ROOT, SMALL, TEXT, TINY, TINY_PATHS, VALUES, _clean,
                                   _deep, _mutate, _run_cli, _value_flags, _write_yaml)


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
