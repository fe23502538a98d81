"""Workloads (raycolo.offline.workload.build_workload) of the shipped examples: per-node
request arrays, routing, chain expansion. tests/offline/test_workload_lengths.py has output
lengths, seeding and request files.

Everything runs the real sampler on the shipped catalog and eCDFs; no mocks.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from raycolo.offline.dag import load_app, parse_app
from raycolo.offline.workload import build_workload, template_tokens
from tests.support.workload_checks import REPO, _check_lengths

# Application graphs; examples/online.yaml and serve.yaml are online deployment configs (tests/online/test_online_samples.py, test_serve_run.py).
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml") if p.name not in ("online.yaml", "serve.yaml"))
ROUTE_COUNTS = {"llama70b": 408, "mixtral": 1267, "wizardlm": 2068, "codellama": 456,
                "mistral": 2657}


@pytest.fixture(scope="module")
def ensemble():
    return build_workload(load_app(REPO / "examples" / "ensemble.yaml"), seed=0)


@pytest.fixture(scope="module")
def routing():
    return build_workload(load_app(REPO / "examples" / "routing.yaml"), seed=0)


@pytest.fixture(scope="module")
def chain():
    return build_workload(load_app(REPO / "examples" / "chain_summary.yaml"), seed=0)


@pytest.fixture(scope="module")
def mixed():
    return build_workload(load_app(REPO / "examples" / "mixed.yaml"), seed=0)



# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_builds(path):
    workload = build_workload(load_app(path), seed=0, requests=40)
    assert list(workload.nodes) == workload.app.topological_order()
    assert workload.total_requests == sum(len(w) for w in workload.nodes.values())
    _check_lengths(workload)


def test_ensemble_nine_nodes_of_1000(ensemble):
    assert len(ensemble.nodes) == 9
    assert {name: len(w) for name, w in ensemble.nodes.items()} == \
        {n.name: 1000 for n in ensemble.app.nodes}
    assert ensemble.total_requests == 9000
    tokens = ensemble.sources["input"].input_tokens
    assert len(tokens) == 1000
    assert tokens.min() >= 5 and tokens.max() <= 127
    assert abs(tokens.mean() - 21) < 1.5, tokens.mean()
    # Spread, not a constant: the distribution is a skewed lognormal.
    assert len(np.unique(tokens)) > 30
    assert np.median(tokens) < tokens.mean()


def test_ensemble_every_model_sees_every_request(ensemble):
    ids = ensemble.sources["input"].item_ids
    tokens = ensemble.sources["input"].input_tokens
    for name, w in ensemble.nodes.items():
        assert np.array_equal(w.item, ids), name
        # prompt "{input}" adds nothing: the model sees exactly the source's tokens
        assert np.array_equal(w.input_len, tokens), name
        assert w.chain_head.all() and w.terminal.all() and (w.successor == -1).all()
        assert w.deps == []
    _check_lengths(ensemble)


def test_ensemble_models_sample_their_own_outputs(ensemble):
    outs = [w.output_len for w in ensemble.nodes.values()]
    assert not all(np.array_equal(outs[0], o) for o in outs[1:])
    assert any(w.output_len.max() == 256 for w in ensemble.nodes.values())


def test_routing_splits_exactly_by_weight(routing):
    assert {name: len(w) for name, w in routing.nodes.items()} == ROUTE_COUNTS
    assert routing.total_requests == 6856


def test_routing_each_request_goes_to_exactly_one_model(routing):
    all_items = np.concatenate([w.item for w in routing.nodes.values()])
    assert len(all_items) == 6856
    assert len(np.unique(all_items)) == 6856  # disjoint
    assert set(all_items.tolist()) == set(routing.sources["input"].item_ids.tolist())  # covering
    tokens = routing.sources["input"].input_tokens
    assert tokens.min() >= 9 and tokens.max() <= 577
    for name, w in routing.nodes.items():
        # each routed request keeps its own item's input length
        assert np.array_equal(w.input_len, np.minimum(tokens[w.item], w.model.context_length - 1))
    _check_lengths(routing)


def test_routing_assignment_is_random_but_counts_are_not():
    app = load_app(REPO / "examples" / "routing.yaml")
    a = build_workload(app, seed=0)
    b = build_workload(app, seed=1)
    for name in ROUTE_COUNTS:
        assert len(a.nodes[name]) == len(b.nodes[name]) == ROUTE_COUNTS[name]
    assert not np.array_equal(np.sort(a.nodes["mistral"].item), np.sort(b.nodes["mistral"].item))
    # not a contiguous block of item ids
    items = np.sort(a.nodes["llama70b"].item)
    assert items[-1] - items[0] > 2 * len(items)


@pytest.mark.parametrize("requests", [20, 50, 99, 1000])
def test_routing_override_partitions_every_count(requests):
    workload = build_workload(load_app(REPO / "examples" / "routing.yaml"), requests=requests)
    all_items = np.concatenate([w.item for w in workload.nodes.values()])
    assert sorted(all_items.tolist()) == list(range(requests))
    weights = np.array(list(ROUTE_COUNTS.values()), dtype=float)
    exact = weights / weights.sum() * requests
    counts = np.array([len(workload.nodes[n]) for n in ROUTE_COUNTS])
    assert (np.abs(counts - exact) < 1).all(), (counts, exact)


def test_chain_summary_summarizer_forms_chains(chain):
    docs = chain.sources["docs"]
    s = chain.nodes["summarizer"]
    assert len(docs.item_ids) == 100
    assert len(s) == int(docs.chunks.sum())
    assert docs.chunks.max() > 5 and docs.chunks.min() >= 1  # skewed: some long documents
    chunks_of = dict(zip(docs.item_ids.tolist(), docs.chunks.tolist()))
    fixed = template_tokens(chain.app.node("summarizer").prompt)
    room = s.model.context_length - 1

    visited = np.zeros(len(s), dtype=bool)
    heads = np.flatnonzero(s.chain_head)
    assert sorted(s.item[heads].tolist()) == sorted(docs.item_ids.tolist())  # one head per doc
    for head in heads:
        doc = int(s.item[head])
        path = [int(head)]
        while s.successor[path[-1]] != -1:
            nxt = int(s.successor[path[-1]])
            assert 0 <= nxt < len(s)
            assert s.item[nxt] == doc, "successor crosses documents"
            assert not s.chain_head[nxt]
            path.append(nxt)
        assert len(path) == chunks_of[doc]
        assert s.terminal[path[-1]]
        assert not s.terminal[path[:-1]].any()
        assert not visited[path].any()
        visited[path] = True
        # each step's prompt carries the previous step's summary (output)
        for k, (prev, cur) in enumerate(zip(path, path[1:]), start=1):
            body = s.input_len[cur] - fixed - s.output_len[prev]
            if s.input_len[cur] == room:
                continue
            if k < len(path) - 1:
                assert body == docs.chunk_tokens, (doc, k)
            else:  # the last chunk is a partial one
                assert 0.3 * docs.chunk_tokens - 1 <= body <= docs.chunk_tokens, (doc, k, body)
        if len(path) > 1:
            assert s.input_len[path[0]] == min(docs.chunk_tokens + fixed, room)
    assert visited.all(), "requests outside every chain"
    assert s.terminal.sum() == 100


def test_chain_summary_evaluator_four_per_document(chain):
    s, ev = chain.nodes["summarizer"], chain.nodes["evaluator"]
    docs = chain.sources["docs"].item_ids
    assert len(ev) == 400
    assert Counter(ev.item.tolist()) == {int(d): 4 for d in docs}
    assert ev.chain_head.all() and (ev.successor == -1).all()
    assert ev.upstream == ["summarizer"]
    (up, req, upi), = ev.deps
    assert up == "summarizer"
    assert sorted(req.tolist()) == list(range(len(ev)))  # every request has its dependency
    assert s.terminal[upi].all(), "evaluator waits on a non-final chunk"
    assert np.array_equal(s.item[upi], ev.item[req])
    fixed = template_tokens(chain.app.node("evaluator").prompt)
    # the evaluator reads the final summary
    expected = np.minimum(s.output_len[upi] + fixed, ev.model.context_length - 1)
    assert np.array_equal(ev.input_len[req], expected)
    # the 4 repeats are sampled independently
    per_doc = {}
    for i, item in enumerate(ev.item.tolist()):
        per_doc.setdefault(item, []).append(int(ev.output_len[i]))
    assert sum(len(set(v)) > 1 for v in per_doc.values()) > 50
    _check_lengths(chain)


def test_summarizer_chain_deps_gate_first_chunk():
    data = {
        "sources": {"docs": {"count": 6, "chunks": {"distribution": "fixed", "value": 3, "max": 3}}},
        "nodes": [
            {"name": "pre", "model": "vicuna-13b-v1.5", "max_output_tokens": 50},
            {"name": "chain", "model": "vicuna-13b-v1.5", "max_output_tokens": 50},
        ],
        "edges": [{"from": "docs", "to": "pre"}, {"from": "pre", "to": "chain"},
                  {"from": "chain", "to": "chain"}],
    }
    w = build_workload(parse_app(data), seed=0)
    pre, ch = w.nodes["pre"], w.nodes["chain"]
    assert len(pre) == 6
    (up, req, upi), = ch.deps
    assert up == "pre"
    assert ch.chain_head[req].all()
    assert np.array_equal(ch.item[req], pre.item[upi])


def test_mixed_has_both_sources(mixed):
    assert set(mixed.sources) == {"docs", "questions"}
    docs, questions = mixed.sources["docs"], mixed.sources["questions"]
    assert len(docs.item_ids) == 100 and len(questions.item_ids) == 5000
    assert not set(docs.item_ids.tolist()) & set(questions.item_ids.tolist())
    assert set(mixed.nodes["summarizer"].item.tolist()) == set(docs.item_ids.tolist())
    assert len(mixed.nodes["evaluator"]) == 400
    for name in ("vicuna", "oasst", "alpaca", "baize", "koala", "dolly", "mpt", "chatglm", "stablelm"):
        assert np.array_equal(mixed.nodes[name].item, questions.item_ids), name
    assert mixed.total_requests == len(mixed.nodes["summarizer"]) + 400 + 9 * 5000
    _check_lengths(mixed)
