"""Application graphs (raycolo.offline.dag): YAML loading, validation and graph structure.

Real parsing and validation only, no mocks: dicts go through ``parse_app`` and files
written to ``tmp_path`` go through ``load_app``.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from raycolo.offline.dag import AppSpec, load_app, parse_app
from raycolo.errors import ConfigError, RaycoloError

REPO = Path(__file__).resolve().parents[2]
# Application graphs; examples/online.yaml and serve.yaml are online deployment configs (tests/online/test_online_samples.py, test_serve_run.py).
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml") if p.name not in ("online.yaml", "serve.yaml"))

BASE = {
    "name": "t",
    "requests": {"count": 10, "input_tokens": {"distribution": "uniform", "min": 5, "max": 50}},
    "nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 64}],
    "edges": [{"from": "input", "to": "a"}],
}


def _app(**changes) -> dict:
    data = copy.deepcopy(BASE)
    data.update(copy.deepcopy(changes))
    return data


def _two_nodes(*edges: tuple[str, str]) -> dict:
    return _app(
        nodes=[{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 64},
               {"name": "b", "model": "alpaca-13b", "max_output_tokens": 64}],
        edges=[{"from": s, "to": t} for s, t in edges],
    )


def _config_error(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_app(data, "app.yaml")
    msg = str(info.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    assert msg.startswith("app.yaml: "), msg
    return msg


# --------------------------------------------------------------------------- examples


def test_examples_are_present():
    names = {p.stem for p in EXAMPLES}
    assert {"ensemble", "routing", "chain_summary", "mixed"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_loads_and_validates(path):
    app = load_app(path)
    assert isinstance(app, AppSpec)
    assert app.base_dir == str(path.parent.resolve())
    order = app.topological_order()
    assert sorted(order) == sorted(n.name for n in app.nodes)
    pos = {n: i for i, n in enumerate(order)}
    for edge in app.edges:
        if edge.source in pos and edge.source != edge.target:
            assert pos[edge.source] < pos[edge.target], (edge, order)


def test_ensemble_structure():
    app = load_app(REPO / "examples" / "ensemble.yaml")
    assert list(app.sources) == ["input"]  # the 'requests:' shorthand
    assert len(app.nodes) == 9
    assert all(app.inputs_of(n.name) == ["input"] for n in app.nodes)
    assert len({n.model for n in app.nodes}) == 9
    assert app.sources["input"].count == 1000


def test_routing_structure():
    app = load_app(REPO / "examples" / "routing.yaml")
    assert all(n.combine == "route" for n in app.nodes)
    assert [n.route_weight for n in app.nodes] == [408, 1267, 2068, 456, 2657]
    assert app.sources["input"].count == 6856


def test_chain_summary_structure():
    app = load_app(REPO / "examples" / "chain_summary.yaml")
    assert app.has_self_loop("summarizer")
    assert not app.has_self_loop("evaluator")
    assert app.inputs_of("summarizer") == ["docs"]  # the self-loop is excluded
    assert app.inputs_of("evaluator") == ["summarizer"]
    assert app.node_inputs("summarizer") == []
    assert app.node_inputs("evaluator") == ["summarizer"]
    assert app.topological_order() == ["summarizer", "evaluator"]
    assert app.node("evaluator").repeat == 4


def test_mixed_has_both_sources():
    app = load_app(REPO / "examples" / "mixed.yaml")
    assert set(app.sources) == {"docs", "questions"}
    assert app.sources["docs"].chunks is not None
    assert app.sources["questions"].input_tokens is not None
    assert app.inputs_of("summarizer") == ["docs"]
    assert app.inputs_of("vicuna") == ["questions"]


# --------------------------------------------------------------------------- graph rules


def test_requests_shorthand_becomes_input_source():
    app = parse_app(_app())
    assert list(app.sources) == ["input"]
    assert app.sources["input"].count == 10


def test_self_loop_is_allowed():
    data = _app(edges=[{"from": "input", "to": "a"}, {"from": "a", "to": "a"}])
    app = parse_app(data)
    assert app.has_self_loop("a")
    assert app.inputs_of("a") == ["input"]
    assert app.topological_order() == ["a"]


def test_self_loop_plus_downstream_is_allowed():
    app = parse_app(_two_nodes(("input", "a"), ("a", "a"), ("a", "b")))
    assert app.topological_order() == ["a", "b"]
    assert app.has_self_loop("a") and not app.has_self_loop("b")


def test_topological_order_follows_edges_not_declaration_order():
    data = _two_nodes(("input", "b"), ("b", "a"))
    app = parse_app(data)
    assert app.topological_order() == ["b", "a"]


def test_two_cycle_is_rejected():
    msg = _config_error(_two_nodes(("input", "a"), ("a", "b"), ("b", "a")))
    assert "cycle" in msg
    assert "a" in msg and "b" in msg


def test_two_cycle_with_self_loop_is_rejected():
    msg = _config_error(_two_nodes(("input", "a"), ("a", "a"), ("a", "b"), ("b", "a")))
    assert "cycle" in msg


def test_three_cycle_is_rejected():
    data = _app(
        nodes=[{"name": n, "model": "vicuna-13b-v1.5", "max_output_tokens": 8} for n in "abc"],
        edges=[{"from": s, "to": t} for s, t in
               [("input", "a"), ("a", "b"), ("b", "c"), ("c", "a")]],
    )
    msg = _config_error(data)
    assert "cycle" in msg
    assert all(n in msg for n in "abc")


def test_edge_to_unknown_node():
    msg = _config_error(_app(edges=[{"from": "input", "to": "zz"}]))
    assert "edges[0].to" in msg and "zz" in msg


def test_edge_from_unknown_node():
    msg = _config_error(_app(edges=[{"from": "input", "to": "a"}, {"from": "ghost", "to": "a"}]))
    assert "edges[1].from" in msg and "ghost" in msg


def test_edge_into_a_source():
    msg = _config_error(_app(edges=[{"from": "input", "to": "a"}, {"from": "a", "to": "input"}]))
    assert "edges[1].to" in msg and "source" in msg


def test_node_without_input():
    data = _two_nodes(("input", "a"))
    msg = _config_error(data)
    assert "nodes[b]" in msg and "input" in msg


def test_node_fed_only_by_itself_has_no_input():
    msg = _config_error(_two_nodes(("input", "a"), ("b", "b")))
    assert "nodes[b]" in msg


def test_duplicate_node_names():
    data = _app(nodes=[{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 8}] * 2)
    msg = _config_error(data)
    assert "duplicate" in msg and "'a'" in msg


def test_node_named_like_a_source():
    data = _app(nodes=[{"name": "input", "model": "vicuna-13b-v1.5", "max_output_tokens": 8}],
                edges=[{"from": "input", "to": "input"}])
    msg = _config_error(data)
    assert "'input'" in msg and "source" in msg


def test_unknown_model_names_the_node_model_field():
    data = _app(nodes=[{"name": "judge", "model": "gpt-17", "max_output_tokens": 8}],
                edges=[{"from": "input", "to": "judge"}])
    msg = _config_error(data)
    assert "nodes[judge].model" in msg
    assert "gpt-17" in msg


# --------------------------------------------------------------------------- field validation


@pytest.mark.parametrize("changes, field", [
    ({"bogus": 1}, "bogus"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 0}]},
     "max_output_tokens"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": -5}]},
     "max_output_tokens"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 8, "typo": 1}]},
     "typo"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5"}]}, "max_output_tokens"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 8,
                 "combine": "vote"}]}, "combine"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 8,
                 "repeat": 0}]}, "repeat"),
    ({"nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 8,
                 "route_weight": 0}]}, "route_weight"),
    ({"nodes": []}, "nodes"),
    ({"edges": []}, "edges"),
    ({"edges": [{"from": "input"}]}, "to"),
    ({"requests": {"count": 0, "input_tokens": {"max": 10, "mean": 5}}}, "count"),
    ({"requests": {"count": -3, "input_tokens": {"max": 10, "mean": 5}}}, "count"),
    ({"requests": {"count": 5}}, "input_tokens"),
    ({"requests": {"count": 5, "file": "x.jsonl", "input_tokens": {"max": 10, "mean": 5}}},
     "file"),
    ({"requests": {"input_tokens": {"max": 10, "mean": 5}}}, "count"),
    ({"requests": {"count": 5, "input_tokens": {"max": 10}}}, "mean"),
    ({"requests": {"count": 5, "input_tokens": {"max": 10, "mean": 5, "median": 5}}}, "mean"),
    ({"requests": {"count": 5, "input_tokens": {"min": 20, "max": 10, "mean": 15}}}, "max"),
    ({"requests": {"count": 5, "input_tokens": {"max": 10, "mean": 50}}}, "mean"),
    ({"requests": {"count": 5, "input_tokens": {"distribution": "fixed", "max": 10}}}, "value"),
    ({"requests": {"count": 5, "input_tokens": {"distribution": "zipf", "max": 10}}},
     "distribution"),
    ({"requests": {"count": 5, "input_tokens": {"max": 10, "mean": 5, "bogus": 2}}}, "bogus"),
    ({"requests": {"count": 5, "chunks": {"max": 4, "mean": 2}, "chunk_tokens": 0}},
     "chunk_tokens"),
])
def test_invalid_fields_name_the_field(changes, field):
    msg = _config_error(_app(**changes))
    assert field in msg, msg


def test_requests_and_sources_together_are_rejected():
    data = _app(sources={"other": BASE["requests"]})
    msg = _config_error(data)
    assert "requests" in msg and "sources" in msg


@pytest.mark.parametrize("data", [None, [], "text", 3])
def test_top_level_must_be_a_mapping(data):
    msg = _config_error(data)
    assert "mapping" in msg


def test_config_error_is_a_raycolo_error():
    assert issubclass(ConfigError, RaycoloError)
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- load_app


def test_load_app_reads_yaml_file(tmp_path):
    path = tmp_path / "sub" / "app.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(_app()))
    app = load_app(str(path))
    assert app.base_dir == str(path.parent.resolve())
    assert [n.name for n in app.nodes] == ["a"]


def test_load_app_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_app(path)
    assert str(path) in str(info.value)


def test_load_app_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nnodes: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_app(path)
    msg = str(info.value)
    assert str(path) in msg and "YAML" in msg and "line" in msg
    assert "\n" not in msg


def test_load_app_validation_error_names_file(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump(_app(bogus=1)))
    with pytest.raises(ConfigError) as info:
        load_app(path)
    assert str(path) in str(info.value) and "bogus" in str(info.value)


def test_load_app_cycle_from_file(tmp_path):
    path = tmp_path / "cycle.yaml"
    path.write_text(yaml.safe_dump(_two_nodes(("input", "a"), ("a", "b"), ("b", "a"))))
    with pytest.raises(ConfigError, match="cycle"):
        load_app(path)


# -- sampling settings of a node (raycolo.generation's bounds) ------------------------------
def _sampling_app(**node):
    return {"name": "s", "requests": {"count": 8, "input_tokens": {"distribution": "fixed", "value": 32, "max": 64}},
            "nodes": [{"name": "a", "model": "tiny-llama-s", "max_output_tokens": 16, **node}],
            "edges": [{"from": "input", "to": "a"}]}


def test_nodes_take_sampling_settings_and_default_to_the_ecdf_temperature():
    app = parse_app(_sampling_app(temperature=0, top_p=0.9, seed=7, stop=["\n\n"]), "app.yaml")
    node = app.node("a")
    assert node.greedy and node.sampling_params(16, 3).stop == ("\n\n",)
    assert parse_app(_sampling_app(), "app.yaml").node("a").temperature == 1.0


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", -1), ("temperature", 1e30),
                                          ("top_p", 0), ("top_p", 1.5), ("seed", -1), ("stop", [""]),
                                          ("temperature", "hot")])
def test_bad_sampling_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        parse_app(_sampling_app(**{field: value}), "app.yaml")


def test_a_greedy_node_is_planned_with_the_profiles_greedy_ecdf(tmp_path):
    """Where the profile has <model>.greedy.csv, greedy nodes sample their lengths from
    it and sampled nodes from <model>.csv."""
    from raycolo.offline.costmodel.length_sampler import write_ecdf
    from raycolo.offline.workload import build_workload

    write_ecdf(tmp_path / "tiny-llama-s.csv", [3] * 10, "sampled")
    write_ecdf(tmp_path / "tiny-llama-s.greedy.csv", [11] * 10, "greedy")
    for temperature, length in ((1.0, 3), (0, 11)):
        app = parse_app(_sampling_app(temperature=temperature), "app.yaml")
        w = build_workload(app, seed=0, ecdf_dir=tmp_path)
        assert set(w.nodes["a"].output_len.tolist()) == {length}
