"""The HTTP front (raycolo/actors/serve/app.py) against a real deployment on a local Ray
cluster (tests/serve/deployment/conftest.py: one deployment for the package, 2 nodes x 2
stages of tiny-llama-s, two ingress replicas, an API key, a small admission limit and a
small body limit so that each error path is reachable): the OpenAI routes with the official
``openai`` client and httpx, errors, 429, training samples, adapter versions, metrics.
"""
from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

from tests.support.serve_checks import (KEY, MODEL, SAMPLES_SENT, TOKENS_SENT, client, error_of, expected_text, http,
                                        scrape)
from tests.support.tiny_reference import hf_greedy


# -- OpenAI routes, with the official client ---------------------------------------------------
def test_models_lists_the_served_model_and_its_base(front):
    c = client(front)
    cards = c.models.list().data
    ids = [m.id for m in cards]
    assert ids[:2] == [MODEL, MODEL + "@base"]
    assert all(i.startswith(MODEL + "@v") for i in ids[2:])     # saved versions, once training ran
    # OpenAI's GET /v1/models/{id}: the listed card, and a 404 naming model for any other id
    assert c.models.retrieve(MODEL + "@base").model_dump() == cards[1].model_dump()
    with pytest.raises(openai.NotFoundError) as exc:
        c.models.retrieve("gpt-4")
    assert exc.value.body["param"] == "model"


def test_the_stage_groups_start_none_of_ray_trains_helpers_they_never_use(front):
    """Ray Train starts a DatasetManager and a PreemptionWatcher around every worker group;
    a stage group takes no Ray Dataset and reads no preemption notice, so raycolo's trainer
    starts neither (raycolo/actors/online/stage_trainer.py). The helpers it does use are
    there: a controller, a placement-group cleaner and a synchronization actor per node."""
    from collections import Counter

    import ray
    from ray.util.state import list_actors

    # this cluster's address: with another Ray cluster on the machine, Ray cannot guess it
    classes = Counter(a.class_name for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                                        limit=10_000, raise_on_missing_output=False))
    nodes, stages = front["config"].nodes, front["config"].stages
    assert classes["RayTrainWorker"] >= nodes * stages, classes
    for helper in ("TrainController", "PlacementGroupCleaner", "SynchronizationActor"):
        assert classes[helper] >= nodes, (helper, classes)
    assert classes["DatasetManager"] == 0 and classes["PreemptionWatcher"] == 0, classes


def test_completion_is_the_models_greedy_text_streamed_or_not(front):
    c = client(front)
    prompt = "The quick brown fox"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt.encode()) + 1 and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.choices[0].text == expected_text(prompt, 6)     # fresh LoRA (B = 0): the base model
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # the prompt's log-probabilities from the node's token inbox (values: tests/serve/checkpoints/)
    e = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                             extra_body={"prompt_logprobs": 1})
    lp, scored = e.choices[0].logprobs, e.choices[0].model_extra["prompt_logprobs"]
    assert e.choices[0].text.endswith(prompt) and len(lp.tokens) == r.usage.prompt_tokens == len(scored)
    assert lp.token_logprobs[0] is None and all(x < 0 for x in lp.token_logprobs[1:]) and scored[0] is None
    assert [next(iter(x.values()))["logprob"] for x in scored[1:]] == lp.token_logprobs[1:]   # its own first
    TOKENS_SENT["n"] += 13


def test_both_replicas_stream_on_the_one_port_each_token_once_in_order(front):
    """serve.ingress replica (the default): the two ingress replicas listen on the one URL
    (SO_REUSEPORT) and the kernel spreads connections over them. Sixteen streams, each on a
    new connection of the official client: every one is the model's greedy text (each token
    once, in order), and both replicas served some (their generated-token counters, tagged
    by replica, in Prometheus)."""
    import psutil

    port = int(front["url"].rsplit(":", 1)[1])
    owners = {p.pid for p in psutil.Process().children(recursive=True)
              for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert len(owners) == 2, owners          # both replicas, nothing else (no Serve proxy)
    prompt = "two replicas"
    want = expected_text(prompt, 5)
    for _ in range(16):
        with client(front) as c:             # a new connection each time
            chunks = list(c.completions.create(model=MODEL + "@base", prompt=prompt, max_tokens=5, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].text for ch in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "length"
    TOKENS_SENT["n"] += 16 * 5
    deadline, served = time.time() + 60, set()
    while time.time() < deadline and len(served) < 2:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{front['metrics_port']}/metrics", timeout=30).text
        served = {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "ray_raycolo_generation_tokens_total" and s.value > 0}
        time.sleep(1)
    assert len(served) == 2, served


def test_chat_uses_the_plain_template_streamed_or_not(front):
    from raycolo.online.serving.text import render_plain

    c = client(front)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = expected_text(render_plain([(m["role"], m["content"]) for m in messages]), 5)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    TOKENS_SENT["n"] += 10


def test_raw_stream_is_server_sent_events_ending_with_done(front):
    with http(front) as h, h.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "temperature": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"
    TOKENS_SENT["n"] += 4


def test_stop_string_ends_the_text_before_it(front):
    c = client(front)
    full = c.completions.create(model=MODEL, prompt="stop test", max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    TOKENS_SENT["n"] += 16
    visible = [ch for ch in full if ch.isprintable() and ch != "\ufffd"]
    if not visible:
        pytest.fail(f"the tiny model's greedy text has no printable character: {full!r}")
    stop = visible[-1]      # its first occurrence ends the text
    r = c.completions.create(model=MODEL, prompt="stop test", max_tokens=16, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.usage.completion_tokens < 16
    TOKENS_SENT["n"] += r.usage.completion_tokens


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ('{"model": "tiny-llama-s", "prompt": "x", "max_tokens": "five"}', "max_tokens"),
    ('{"model": "tiny-llama-s", "prompt": "x", "temperature": NaN}', "temperature"),
    ('{"model": "tiny-llama-s", "prompt": "x", "temperature": 1e400}', "temperature"),
    ('{"model": "tiny-llama-s", "prompt": "x", "top_p": -1}', "top_p"),
    ('{"model": "tiny-llama-s", "prompt": "x", "n": 17}', "n"),
    ('{"model": "tiny-llama-s", "prompt": "x", "logit_bias": {"5": 1e3}}', "logit_bias.5"),
    ('{"model": "tiny-llama-s", "prompt": "x", "logit_bias": {"999999": 1}}', "logit_bias"),    # past the vocab
    ('{"model": "tiny-llama-s", "prompt": "a\\ud800b"}', "prompt"),       # a lone surrogate (was a 500)
    ('{"model": "tiny-llama-s", "prompt": "x", "max_tokens": 99999999999999999999999}', "max_tokens"),
    ('{"model": "tiny-llama-s", "prompt": "x", "stop": ' + json.dumps(["s"] * 5000) + '}', "stop"),
    ('{"prompt": "x"}', "model"),
    ('{"model": "tiny-llama-s", "prompt": "x"', None),
    ('[' * 20000 + ']' * 20000, None),
    (b'{"model": "tiny-llama-s", "prompt": "\xff\xfe not UTF-8"}', None),
])
def test_malformed_requests_get_400_naming_the_parameter(front, body, param):
    with http(front) as h:
        r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "pydantic" not in r.text and "Traceback" not in r.text


def test_unknown_model_long_prompt_big_body_and_missing_key(front):
    c = client(front)
    with pytest.raises(openai.NotFoundError) as exc:
        c.completions.create(model="gpt-4", prompt="x")
    assert exc.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as exc:      # context 512 tokens (the KV cache)
        c.completions.create(model=MODEL, prompt="x" * 600)
    assert exc.value.body["code"] == "context_length_exceeded" and exc.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="x" * 100, max_tokens=500)
    assert exc.value.body["param"] == "max_tokens"
    with http(front) as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 70000})
        assert r.status_code == 413 and error_of(r)["code"] == "body_too_large", r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=front["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(front["url"] + "/v1/models")
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert httpx.get(front["url"] + "/health").status_code == 200      # health needs no key


def test_overload_gets_429_with_retry_after_and_loses_nothing_accepted(front):
    async def one(h, i):
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": f"load {i}", "max_tokens": 16,
                                                  "ignore_eos": True, "temperature": 0})
        return r

    async def burst():
        async with httpx.AsyncClient(base_url=front["url"], headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=300) as h:
            return await asyncio.gather(*[one(h, i) for i in range(20)])

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 6, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and error_of(r)["type"] == "rate_limit_error"
        else:
            body = r.json()
            assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
            TOKENS_SENT["n"] += 16
    # The limit held under the burst (admissions in flight count: they once let 7 through),
    # no stage's KV pool (512 tokens: 32 blocks) was reserved past its size, and the blocks
    # all came back (the controller's mirrors may be a report behind the nodes).
    with http(front) as h:
        deadline = time.time() + 60
        while True:
            stats = h.get("/v1/stats").json()
            queues = stats["queues"]
            if all(q["kv_blocks_reserved"] == 0 for q in queues) or time.time() > deadline:
                break
            time.sleep(0.5)
    assert stats["peak_ongoing"] <= 6, stats["peak_ongoing"]
    assert [(q["kv_blocks"], q["kv_blocks_reserved"]) for q in queues] == [(32, 0), (32, 0)], queues


def test_requests_that_fill_a_stages_kv_pool_wait_for_blocks_and_all_finish(front):
    """Four requests of 251 prompt + 150 tokens: 26 of a stage's 32 blocks each, so no
    node runs two at once. The scheduler starts each prefill only when its blocks are
    free (a stage worker used to take them all and raise "needs 2 KV blocks, 0 free"):
    every one finishes with the model's greedy text."""
    prompts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 6 for i in range(4)]
    prompts = [p[:250] for p in prompts]

    async def burst():
        async with httpx.AsyncClient(base_url=front["url"], headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=300) as h:
            return await asyncio.gather(*[h.post("/v1/completions", json={
                "model": MODEL + "@base", "prompt": p, "max_tokens": 150, "ignore_eos": True,
                "temperature": 0}) for p in prompts])

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 4, [r.text[-1500:] for r in responses if r.status_code != 200]
    for p, r in zip(prompts, responses):
        body = r.json()
        assert body["usage"] == {"prompt_tokens": 251, "completion_tokens": 150, "total_tokens": 401}
        assert body["choices"][0]["text"] == expected_text(p, 150)
    TOKENS_SENT["n"] += 4 * 150


# -- training samples ------------------------------------------------------------------------------
def test_train_samples_are_persisted_before_the_ack_and_trained(front):
    samples = [{"prompt": f"Q{i}: copy abc", "completion": "abc abc"} for i in range(6)]
    samples.append({"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]})
    with http(front) as h:
        resumed = h.get("/v1/train_samples/status").json()["resumed"]
        assert resumed == {"adapter_version": 0, "samples_held": 0, "samples_resumed": 0,
                           "nodes_restored": []}          # a first start on empty storage took up nothing
        r = h.post("/v1/train_samples", json={"samples": samples})
        assert r.status_code == 200, r.text
        ack = r.json()
        SAMPLES_SENT["n"] += len(ack["ids"])
        stored = [json.loads(line) for line in (front["out"] / "samples" / "samples.jsonl").read_text().splitlines()]
        assert ack["persisted"] is True and len(ack["ids"]) == 7
        assert [s["seq"] for s in stored][-7:] == ack["ids"] and ack["sequence"] == len(stored)
        assert stored[-1]["completion"][-1] == 2          # completions end with EOS
        bad = h.post("/v1/train_samples", json={"samples": [{"prompt": "only a prompt"}]})
        assert bad.status_code == 400 and error_of(bad)["param"].startswith("samples")
        deadline = time.time() + 120
        while time.time() < deadline:
            status = h.get("/v1/train_samples/status").json()
            if status["trained"] >= 6:
                break
            time.sleep(1)
        assert status["received"] == len(stored) and status["trained"] >= 6, status
        assert status["pending"] <= 1       # 7 samples, micro-batches of 2
        stats = h.get("/v1/stats").json()
    # the adapter has trained; <model>@base still serves the model without it, token for token
    prompt = "The quick brown fox"
    pinned = client(front).completions.create(model=MODEL + "@base", prompt=prompt, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert pinned.model == MODEL + "@base" and pinned.choices[0].text == expected_text(prompt, 6)
    TOKENS_SENT["n"] += 6
    assert stats["policy"] == "lemix" and len(stats["stages"]) == 4 and stats["completed"] > 0


def test_saved_adapter_versions_are_listed_and_served_as_pinned_models(front):
    """Checkpoints are servable as <model>@v<k>: listed by /v1/models and the training
    status; a pinned completion equals transformers' greedy generate() with that version
    loaded by peft from its saved directory, while training goes on; an unknown version
    is a 404 naming the model."""
    samples = [{"prompt": f"V{i}: spell", "completion": "x y z"} for i in range(8)]
    with http(front) as h:
        r = h.post("/v1/train_samples", json={"samples": samples})
        assert r.status_code == 200, r.text
        SAMPLES_SENT["n"] += len(r.json()["ids"])
        deadline = time.time() + 180
        while time.time() < deadline:
            status = h.get("/v1/train_samples/status").json()
            if len(status["pinned_versions"]) >= 2:
                break
            time.sleep(1)
    versions = status["pinned_versions"]
    assert len(versions) >= 2 and versions == sorted(versions), status
    # samples posted by earlier tests may still be training: a checkpoint can land between
    # the two reads, so read the list between two equal statuses
    with http(front) as h:
        for _ in range(20):
            listed = [m for m in client(front).models.list().data if m.id.startswith(MODEL + "@v")]
            again = h.get("/v1/train_samples/status").json()["pinned_versions"]
            if again == versions:
                break
            versions = again
    assert [m.id for m in listed] == [f"{MODEL}@v{k}" for k in versions]
    assert all(m.adapter == "version" and m.parent == MODEL for m in listed)
    from raycolo.engine.models import load_tokenizer
    tok = load_tokenizer(MODEL)
    prompt = "Pinned adapters"
    texts = {}
    for k in versions[-2:]:
        directory = next(front["out"].glob(f"checkpoints/adapter-*/versions/v{k}"))
        reply = client(front).completions.create(model=f"{MODEL}@v{k}", prompt=prompt, max_tokens=6,
                                                 temperature=0, extra_body={"ignore_eos": True})
        TOKENS_SENT["n"] += 6
        assert reply.model == f"{MODEL}@v{k}"
        texts[k] = reply.choices[0].text
        assert texts[k] == tok.decode(hf_greedy(MODEL, tok.encode(prompt), 6, adapter_dir=directory)).rstrip("\ufffd"), k
    for bad in (f"{MODEL}@v{versions[-1] + 1000}", f"{MODEL}@v-1", f"{MODEL}@v01"):
        with pytest.raises(openai.NotFoundError) as exc:
            client(front).completions.create(model=bad, prompt="x", max_tokens=1)
        assert exc.value.body["param"] == "model" and exc.value.body["code"] == "model_not_found", bad


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_reach_prometheus_and_count_what_was_sent(front):
    want = TOKENS_SENT["n"]
    assert want > 0
    deadline = time.time() + 60
    while time.time() < deadline:
        got = scrape(front["metrics_port"])
        if (got.get("ray_raycolo_generation_tokens_total", 0) >= want and got.get("ray_raycolo_optimizer_steps", 0) >= 3
                and got.get("ray_raycolo_train_samples_received_total", 0) >= SAMPLES_SENT["n"]):
            break
        time.sleep(2)
    assert got.get("ray_raycolo_generation_tokens_total") == want, (got, want)
    assert got["ray_raycolo_train_samples_received_total"] == SAMPLES_SENT["n"] == 15
    assert got["ray_raycolo_admission_rejections_total"] >= 1
    assert got["ray_raycolo_time_to_first_token_seconds_count"] >= 6
    assert got["ray_raycolo_optimizer_steps"] >= 3 and got["ray_raycolo_nodes_alive"] == 2
    assert got["ray_raycolo_nodes_restarting"] == 0
    for name in ("ray_raycolo_request_success_total", "ray_raycolo_num_requests_running",
                 "ray_raycolo_stage_busy_fraction", "ray_raycolo_slo_attainment",
                 "ray_raycolo_e2e_request_latency_seconds_bucket", "ray_raycolo_inter_token_latency_seconds_sum",
                 "ray_raycolo_stage_memory_bytes", "ray_raycolo_adapter_staleness_seconds"):
        assert name in got, name
    # on the CPU the device figure is the stage workers' resident memory: 4 torch processes
    assert got["ray_raycolo_device_memory_used_bytes"] > 4 * 100e6


def test_preference_pairs_over_http_are_stored_trained_and_evaluated(front):
    """{prompt, chosen, rejected} samples are persisted with the rejected answer, trained
    (DPO), and /v1/eval gives their win rate and CLPD; malformed pairs are 400s."""
    pairs = [{"prompt": f"Pick {i}:", "chosen": "yes yes", "rejected": "no no"} for i in range(2)]
    with http(front) as h:
        trained = h.get("/v1/train_samples/status").json()["trained"]
        r = h.post("/v1/train_samples", json={"samples": pairs})
        assert r.status_code == 200, r.text
        stored = [json.loads(line) for line in (front["out"] / "samples" / "samples.jsonl").read_text().splitlines()]
        from raycolo.engine.models import load_tokenizer
        tok = load_tokenizer(MODEL)
        assert [s["seq"] for s in stored[-2:]] == r.json()["ids"]
        assert all(tok.decode(s["rejected"][:-1]) == "no no" and tok.decode(s["completion"][:-1]) == "yes yes"
                   for s in stored[-2:])
        deadline = time.time() + 120
        while time.time() < deadline and h.get("/v1/train_samples/status").json()["trained"] < trained + 2:
            time.sleep(1)
        assert h.get("/v1/train_samples/status").json()["trained"] >= trained + 2
        e = h.post("/v1/eval", json={"samples": pairs})
        assert e.status_code == 200, e.text
        body = e.json()
        assert body["loss"] is None and 0.0 <= body["win_rate"] <= 1.0 and math.isfinite(body["clpd"])
        for bad in ({"prompt": "p", "chosen": "a", "rejected": "a"}, {"prompt": "p", "chosen": "a"},
                    {"prompt": "p", "completion": "a", "rejected": "b"}, {"chosen": "a", "rejected": "b"}):
            r = h.post("/v1/train_samples", json={"samples": [bad]})
            assert r.status_code == 400 and error_of(r)["param"].startswith("samples"), (bad, r.text)
        mixed = h.post("/v1/eval", json={"samples": [pairs[0], {"prompt": "p", "completion": "a"}]})
        assert mixed.status_code == 400 and error_of(mixed)["param"] == "samples"


def test_train_samples_and_eval_take_a_bare_list_or_the_samples_object(front):
    """POST /v1/train_samples and /v1/eval take ``{"samples": [...]}`` or a bare JSON list
    of samples, with the same validation and limits; a 400 names the field as the body
    has it (``samples[3].completion`` or ``[3].completion``); /openapi.json gives both."""
    from raycolo.online.serving.protocol import MAX_TRAIN_SAMPLES

    sample = {"prompt": "Form test:", "completion": "ok"}
    with http(front) as h:
        for body in ([sample, sample], {"samples": [sample, sample]}):
            r = h.post("/v1/train_samples", json=body)
            assert r.status_code == 200 and len(r.json()["ids"]) == 2 and r.json()["persisted"] is True, r.text
            SAMPLES_SENT["n"] += 2
            e = h.post("/v1/eval", json=body)
            assert e.status_code == 200 and e.json()["samples"] == 2 and math.isfinite(e.json()["loss"]), e.text
        bad, half = {"prompt": "p", "completion": 5}, {"prompt": "p"}
        too_long = {"prompt": "x" * front["config"].lora.max_len, "completion": "y"}
        many = [sample] * (MAX_TRAIN_SAMPLES + 1)
        for body, param in (([sample] * 3 + [bad], "[3].completion"),
                            ({"samples": [sample] * 3 + [bad]}, "samples[3].completion"),
                            ([sample, half], "[1]"), ({"samples": [sample, half]}, "samples[1]"),
                            ([sample, too_long], "[1]"), ({"samples": [sample, too_long]}, "samples[1]"),
                            ([], None), ({"samples": []}, "samples"), (many, None), ({"samples": many}, "samples"),
                            ({}, "samples"), ("just text", None), (7, None), ([1], "[0]")):
            for route in ("/v1/train_samples", "/v1/eval"):
                r = h.post(route, json=body)
                assert r.status_code == 400, (route, str(body)[:80], r.text)
                err = error_of(r)
                assert err["param"] == param and err["type"] == "invalid_request_error", (route, str(body)[:80], err)
                assert err["message"].startswith(f"{param}: " if param else "") and "pydantic" not in r.text
        pair = {"prompt": "p", "chosen": "a", "rejected": "b"}
        for body, param in (([sample, pair], None), ({"samples": [sample, pair]}, "samples")):
            r = h.post("/v1/eval", json=body)
            assert r.status_code == 400 and error_of(r)["param"] == param, r.text
        schema = h.get("/openapi.json").json()
    for route in ("/v1/train_samples", "/v1/eval"):
        ref = schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        forms = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["oneOf"]
        assert {f.get("type") or f["$ref"].rsplit("/", 1)[1] for f in forms} == {"array", "TrainSamplesRequest"}
        listed = next(f for f in forms if f.get("type") == "array")
        assert listed["items"]["$ref"].endswith("/TrainSample") and listed["maxItems"] == MAX_TRAIN_SAMPLES
