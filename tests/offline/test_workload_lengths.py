"""Workloads (raycolo.offline.workload.build_workload): output-length clipping, seeding and
overrides, and request files (JSONL, Parquet, their errors). The real sampler on the
shipped catalog and eCDFs; no mocks.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from raycolo.catalog import get_model
from raycolo.offline.dag import load_app, parse_app
from raycolo.errors import ConfigError
from raycolo.offline.workload import build_workload
from tests.support.workload_checks import REPO, _check_lengths


# --------------------------------------------------------------------------- output lengths


def _single(model: str, max_output: int, input_tokens: dict, count: int = 300, **node) -> dict:
    return {
        "requests": {"count": count, "input_tokens": input_tokens},
        "nodes": [{"name": "n", "model": model, "max_output_tokens": max_output, **node}],
        "edges": [{"from": "input", "to": "n"}],
    }


def test_output_respects_max_output_tokens():
    app = parse_app(_single("vicuna-13b-v1.5", 16, {"distribution": "uniform", "min": 5, "max": 100}))
    w = build_workload(app, seed=0).nodes["n"]
    assert w.output_len.max() == 16
    assert (w.output_len <= 16).all() and (w.output_len >= 1).all()
    assert (w.output_len == 16).sum() > len(w) // 2  # the cap really binds


def test_output_respects_context_length():
    ctx = get_model("alpaca-13b").context_length
    assert ctx == 2048
    with pytest.raises(ConfigError, match=r"nodes\[n\]\.max_output_tokens: must be within alpaca-13b's context of 2048"):
        parse_app(_single("alpaca-13b", 4096, {"distribution": "uniform", "min": 1500, "max": 3000}))
    app = parse_app(_single("alpaca-13b", 2048,
                            {"distribution": "uniform", "min": 1500, "max": 3000}))
    w = build_workload(app, seed=0).nodes["n"]
    assert (w.input_len <= ctx - 1).all()
    assert (w.input_len == ctx - 1).any()  # prompts over the window are cut
    assert (w.input_len + w.output_len <= ctx).all()
    assert (w.output_len >= 1).all()
    assert w.max_sequence <= ctx


def test_prompt_template_adds_tokens():
    dist = {"distribution": "fixed", "value": 10, "max": 10}
    plain = build_workload(parse_app(_single("vicuna-13b-v1.5", 8, dist, count=5)))
    words = "word " * 30
    templ = build_workload(parse_app(_single("vicuna-13b-v1.5", 8, dist, count=5,
                                             prompt=words + "{input}")))
    assert (plain.nodes["n"].input_len == 10).all()
    extra = templ.nodes["n"].input_len - 10
    assert (extra == extra[0]).all()
    assert 30 <= extra[0] <= 60, extra[0]


def test_concat_combines_upstream_outputs():
    data = {
        "requests": {"count": 50, "input_tokens": {"distribution": "uniform", "min": 5, "max": 40}},
        "nodes": [
            {"name": "x", "model": "vicuna-13b-v1.5", "max_output_tokens": 64},
            {"name": "y", "model": "alpaca-13b", "max_output_tokens": 64},
            {"name": "fuse", "model": "llama-2-13b-chat-hf", "max_output_tokens": 64,
             "combine": "concat"},
        ],
        "edges": [{"from": "input", "to": "x"}, {"from": "input", "to": "y"},
                  {"from": "x", "to": "fuse"}, {"from": "y", "to": "fuse"}],
    }
    w = build_workload(parse_app(data), seed=0)
    x, y, fuse = w.nodes["x"], w.nodes["y"], w.nodes["fuse"]
    assert len(fuse) == 50
    assert np.array_equal(np.sort(fuse.item), np.sort(x.item))
    assert sorted(fuse.upstream) == ["x", "y"]
    got = {}
    for up, req, upi in fuse.deps:
        src = w.nodes[up]
        assert np.array_equal(fuse.item[req], src.item[upi])
        for r, u in zip(req.tolist(), upi.tolist()):
            got[r] = got.get(r, 0) + int(src.output_len[u])
    assert sorted(got) == list(range(50))
    for r, total in got.items():
        assert fuse.input_len[r] == total


# --------------------------------------------------------------------------- seeding and overrides


@pytest.mark.parametrize("name", ["ensemble", "chain_summary", "routing"])
def test_same_seed_same_arrays_different_seed_differs(name):
    app = load_app(REPO / "examples" / f"{name}.yaml")
    a = build_workload(app, seed=7, requests=200)
    b = build_workload(app, seed=7, requests=200)
    c = build_workload(app, seed=8, requests=200)
    for node in a.nodes:
        for field in ("input_len", "output_len", "item", "successor", "chain_head", "terminal"):
            assert np.array_equal(getattr(a.nodes[node], field), getattr(b.nodes[node], field)), \
                (node, field)
        assert len(a.nodes[node].deps) == len(b.nodes[node].deps)
        for (ua, ra, ia), (ub, rb, ib) in zip(a.nodes[node].deps, b.nodes[node].deps):
            assert ua == ub and np.array_equal(ra, rb) and np.array_equal(ia, ib)
    for src in a.sources:
        assert np.array_equal(a.sources[src].input_tokens, b.sources[src].input_tokens)
    differs = any(
        len(a.nodes[n]) != len(c.nodes[n])
        or not np.array_equal(a.nodes[n].output_len, c.nodes[n].output_len)
        for n in a.nodes)
    assert differs
    assert not all(np.array_equal(a.sources[s].input_tokens, c.sources[s].input_tokens)
                   for s in a.sources)


def test_requests_override_changes_counts():
    ens = build_workload(load_app(REPO / "examples" / "ensemble.yaml"), requests=37)
    assert all(len(w) == 37 for w in ens.nodes.values())
    assert len(ens.sources["input"].input_tokens) == 37

    ch = build_workload(load_app(REPO / "examples" / "chain_summary.yaml"), requests=12)
    assert len(ch.sources["docs"].item_ids) == 12
    assert len(ch.nodes["evaluator"]) == 48
    assert len(ch.nodes["summarizer"]) == int(ch.sources["docs"].chunks.sum())

    mix = build_workload(load_app(REPO / "examples" / "mixed.yaml"), requests=20)
    assert len(mix.sources["docs"].item_ids) == 20
    assert len(mix.sources["questions"].item_ids) == 20
    assert len(mix.nodes["vicuna"]) == 20


@pytest.mark.parametrize("requests", [0, -1])
def test_requests_override_must_be_positive(requests):
    with pytest.raises(ConfigError, match="requests"):
        build_workload(load_app(REPO / "examples" / "ensemble.yaml"), requests=requests)


def test_route_sibling_with_no_requests_is_an_error():
    with pytest.raises(ConfigError, match="no requests"):
        build_workload(load_app(REPO / "examples" / "routing.yaml"), requests=2)


# --------------------------------------------------------------------------- request files


def _file_app(tmp_path: Path, filename: str, self_loop: bool = False, **source) -> Path:
    data = {
        "requests": {"file": filename, **source},
        "nodes": [{"name": "n", "model": "vicuna-13b-v1.5", "max_output_tokens": 32}],
        "edges": [{"from": "input", "to": "n"}] + ([{"from": "n", "to": "n"}] if self_loop else []),
    }
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_with_input_tokens(tmp_path):
    _write_jsonl(tmp_path / "reqs.jsonl", [{"input_tokens": t} for t in (5, 17, 300, 1)])
    w = build_workload(load_app(_file_app(tmp_path, "reqs.jsonl")))
    assert w.sources["input"].input_tokens.tolist() == [5, 17, 300, 1]
    assert w.nodes["n"].input_len.tolist() == [5, 17, 300, 1]
    _check_lengths(w)


def test_jsonl_with_prompt_text(tmp_path):
    rows = [{"prompt": "hello"}, {"prompt": " ".join(["word"] * 30)},
            {"prompt": " ".join(["word"] * 300)}]
    (tmp_path / "reqs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = build_workload(load_app(_file_app(tmp_path, "reqs.jsonl")))
    tokens = w.sources["input"].input_tokens
    assert len(tokens) == 3
    assert 1 <= tokens[0] <= 3
    assert 30 <= tokens[1] <= 60
    assert 300 <= tokens[2] <= 600
    assert tokens[0] < tokens[1] < tokens[2]


def test_jsonl_mixed_rows_and_override_limit(tmp_path):
    _write_jsonl(tmp_path / "reqs.jsonl",
                 [{"input_tokens": 9}, {"prompt": "a b c"}, {"input_tokens": 11, "prompt": "x"},
                  {"input_tokens": 12}])
    path = _file_app(tmp_path, "reqs.jsonl")
    w = build_workload(load_app(path))
    assert len(w.nodes["n"]) == 4
    assert w.sources["input"].input_tokens[[0, 2, 3]].tolist() == [9, 11, 12]
    limited = build_workload(load_app(path), requests=2)
    assert limited.sources["input"].input_tokens[0] == 9
    assert len(limited.nodes["n"]) == 2


def test_request_file_path_is_relative_to_the_yaml(tmp_path):
    sub = tmp_path / "cfg"
    sub.mkdir()
    _write_jsonl(sub / "reqs.jsonl", [{"input_tokens": 42}])
    path = _file_app(sub, "reqs.jsonl")
    assert Path.cwd().resolve() != sub.resolve() and not Path("reqs.jsonl").exists()
    w = build_workload(load_app(path))
    assert w.sources["input"].input_tokens.tolist() == [42]


def test_absolute_request_file_path(tmp_path):
    _write_jsonl(tmp_path / "abs.jsonl", [{"input_tokens": 7}, {"input_tokens": 8}])
    sub = tmp_path / "cfg"
    sub.mkdir()
    w = build_workload(load_app(_file_app(sub, str(tmp_path / "abs.jsonl"))))
    assert w.sources["input"].input_tokens.tolist() == [7, 8]


def test_parquet_request_file(tmp_path):
    pd.DataFrame({"input_tokens": [10, 20, 30],
                  "prompt": ["a", "b", "c"]}).to_parquet(tmp_path / "reqs.parquet")
    w = build_workload(load_app(_file_app(tmp_path, "reqs.parquet")))
    assert w.sources["input"].input_tokens.tolist() == [10, 20, 30]
    assert len(w.nodes["n"]) == 3

    pd.DataFrame({"prompt": ["one two three", " ".join(["w"] * 60)]}).to_parquet(
        tmp_path / "prompts.parquet")
    w = build_workload(load_app(_file_app(tmp_path, "prompts.parquet")))
    tokens = w.sources["input"].input_tokens
    assert 3 <= tokens[0] <= 6 and 60 <= tokens[1] <= 120


def test_parquet_chunks_column_creates_chains(tmp_path):
    pd.DataFrame({"input_tokens": [100, 5000, 3000], "chunks": [1, 3, 2]}).to_parquet(
        tmp_path / "docs.parquet")
    w = build_workload(load_app(_file_app(tmp_path, "docs.parquet", self_loop=True,
                                          chunk_tokens=1000)))
    n = w.nodes["n"]
    assert w.sources["input"].chunks.tolist() == [1, 3, 2]
    assert len(n) == 6
    assert n.item.tolist() == [0, 1, 1, 1, 2, 2]
    assert n.successor.tolist() == [-1, 2, 3, -1, 5, -1]
    assert n.chain_head.tolist() == [True, True, False, False, True, False]
    assert n.terminal.tolist() == [True, False, False, True, False, True]
    # the second chunk of document 1 reads the first chunk's summary plus a full chunk
    assert n.input_len[2] == 1000 + n.output_len[1]
    _check_lengths(w)


def test_jsonl_chunks_without_self_loop_do_not_chain(tmp_path):
    _write_jsonl(tmp_path / "docs.jsonl", [{"input_tokens": 50, "chunks": 4}, {"input_tokens": 60}])
    w = build_workload(load_app(_file_app(tmp_path, "docs.jsonl")))
    assert len(w.nodes["n"]) == 2
    chained = build_workload(load_app(_file_app(tmp_path, "docs.jsonl", self_loop=True)))
    assert len(chained.nodes["n"]) == 5
    assert chained.nodes["n"].terminal.sum() == 2


def test_parquet_missing_chunks_default_to_one(tmp_path):
    # pandas stores an int column with a missing value as float64 (NaN for the gap); the
    # reader must treat the gap like a JSON null (one chunk) and 3.0 like 3.
    pd.DataFrame({"input_tokens": [100, 200, 300], "chunks": [1, 3, None]}).to_parquet(
        tmp_path / "docs.parquet")
    w = build_workload(load_app(_file_app(tmp_path, "docs.parquet", self_loop=True)))
    assert w.sources["input"].chunks.tolist() == [1, 3, 1]
    assert len(w.nodes["n"]) == 5


@pytest.mark.parametrize("rows, bad_row", [
    ([{"input_tokens": 5}, {"foo": 1}], 2),
    ([{"input_tokens": 0}], 1),
    ([{"input_tokens": 5}, {"input_tokens": 6}, {"input_tokens": -3}], 3),
    ([{"input_tokens": "12"}], 1),
    ([{"input_tokens": 2.5}], 1),
    ([{"input_tokens": 5}, {"input_tokens": True}], 2),
    ([{"prompt": 17}], 1),
    ([{"input_tokens": 5, "chunks": 0}], 1),
    ([{"input_tokens": 5}, {"input_tokens": 5, "chunks": "two"}], 2),
    ([{"input_tokens": 5}, [1, 2]], 2),
])
def test_bad_jsonl_rows_name_file_and_row(tmp_path, rows, bad_row):
    path = tmp_path / "reqs.jsonl"
    _write_jsonl(path, rows)
    app = load_app(_file_app(tmp_path, "reqs.jsonl", self_loop=True))
    with pytest.raises(ConfigError) as info:
        build_workload(app)
    msg = str(info.value)
    assert str(path) in msg, msg
    assert re.search(rf"(row {bad_row}\b|:{bad_row}:)", msg), msg
    assert "\n" not in msg


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"input_tokens": 5}\n{"input_tokens": 6}\n{not json\n')
    with pytest.raises(ConfigError) as info:
        build_workload(load_app(_file_app(tmp_path, "reqs.jsonl")))
    assert f"{path}:3" in str(info.value)


def test_bad_parquet_rows_name_file_and_row(tmp_path):
    path = tmp_path / "reqs.parquet"
    pd.DataFrame({"input_tokens": [4, -1]}).to_parquet(path)
    with pytest.raises(ConfigError) as info:
        build_workload(load_app(_file_app(tmp_path, "reqs.parquet")))
    assert str(path) in str(info.value) and "row 2" in str(info.value)


@pytest.mark.parametrize("name, content, needle", [
    ("missing.jsonl", None, "not found"),
    ("empty.jsonl", "\n\n", "no requests"),
    ("reqs.csv", "input_tokens\n5\n", ".jsonl or .parquet"),
    ("corrupt.parquet", "not a parquet file", "parquet"),
])
def test_unusable_request_files(tmp_path, name, content, needle):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError) as info:
        build_workload(load_app(_file_app(tmp_path, name)))
    msg = str(info.value)
    assert str(tmp_path / name) in msg and needle in msg, msg


def test_file_source_seeded_outputs(tmp_path):
    _write_jsonl(tmp_path / "reqs.jsonl", [{"input_tokens": 20}] * 100)
    app = load_app(_file_app(tmp_path, "reqs.jsonl"))
    a, b, c = build_workload(app, seed=3), build_workload(app, seed=3), build_workload(app, seed=4)
    assert np.array_equal(a.nodes["n"].output_len, b.nodes["n"].output_len)
    assert not np.array_equal(a.nodes["n"].output_len, c.nodes["n"].output_len)


def test_workload_does_not_mutate_app():
    app = load_app(REPO / "examples" / "ensemble.yaml")
    before = copy.deepcopy(app.model_dump())
    build_workload(app, requests=10)
    assert app.model_dump() == before
