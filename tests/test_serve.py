"""The HTTP front (raycolo/actors/serve/app.py) against a real deployment on a local Ray cluster:
Ray Serve, the official ``openai`` client, httpx, Prometheus's parser, schemathesis.

One deployment (2 nodes x 2 stages of tiny-llama-s) serves the module, with an API key,
a small admission limit and a small body limit so that each error path is reachable.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray

from raycolo.actors.local_cluster import NAMESPACE, controller_name

from online_checks import free_port, small_online_config
from tiny_reference import hf_greedy

KEY_ENV, KEY = "RAYCOLO_TEST_API_KEY", "test-key-1234"
MODEL = "tiny-llama-s"
TOKENS_SENT = {"n": 0}          # generated tokens the tests received (checked against the metrics)
SAMPLES_SENT = {"n": 0}         # training samples the tests had acknowledged


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    from raycolo.actors.serve import launch as serve_launch

    out = tmp_path_factory.mktemp("serve")
    config = small_online_config(
        out, nodes=2, stages=2, model=MODEL, lora={"checkpoint_every": 2}, stage={"kv_cache_tokens": 512},
        serve={"port": free_port(), "api_key_env": KEY_ENV, "max_ongoing_requests": 6, "replicas": 2,
               "max_body_bytes": 65536, "app_name": "raycolo-test"})
    os.environ[KEY_ENV] = KEY            # the local cluster's processes inherit it
    metrics_port = free_port()
    started, _ = serve_launch.init_ray(config, metrics_port=metrics_port)
    try:
        url = serve_launch.start(config)
        yield {"url": url, "config": config, "out": out, "metrics_port": metrics_port}
    finally:
        serve_launch.stop(config, started)
        os.environ.pop(KEY_ENV, None)


def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(front) -> httpx.Client:
    return httpx.Client(base_url=front["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def expected_text(prompt_text: str, n: int) -> str:
    from raycolo.engine.models import load_tokenizer
    tok = load_tokenizer(MODEL)
    # a last character cut off by max_tokens is not text (an incremental detokenizer's rule)
    return tok.decode(hf_greedy(MODEL, tok.encode(prompt_text), n)).rstrip("\ufffd")


# -- OpenAI routes, with the official client ---------------------------------------------------
def test_models_lists_the_served_model_and_its_base(front):
    ids = [m.id for m in client(front).models.list().data]
    assert ids[:2] == [MODEL, MODEL + "@base"]
    assert all(i.startswith(MODEL + "@v") for i in ids[2:])     # saved versions, once training ran


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
    TOKENS_SENT["n"] += 12


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
def error_of(response):
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body,param", [
    ('{"model": "tiny-llama-s", "prompt": "x", "max_tokens": "five"}', "max_tokens"),
    ('{"model": "tiny-llama-s", "prompt": "x", "temperature": NaN}', "temperature"),
    ('{"model": "tiny-llama-s", "prompt": "x", "temperature": 1e400}', "temperature"),
    ('{"model": "tiny-llama-s", "prompt": "x", "top_p": -1}', "top_p"),
    ('{"model": "tiny-llama-s", "prompt": "x", "n": 17}', "n"),
    ('{"model": "tiny-llama-s", "prompt": "x", "logit_bias": {"5": 1}}', "logit_bias"),
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


# -- training samples ------------------------------------------------------------------------------
def test_train_samples_are_persisted_before_the_ack_and_trained(front):
    samples = [{"prompt": f"Q{i}: copy abc", "completion": "abc abc"} for i in range(6)]
    samples.append({"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]})
    with http(front) as h:
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
def scrape(port) -> dict[str, float]:
    """Every ray_raycolo sample on the node's Prometheus endpoint: counters and histograms
    summed over labels (each ingress replica counts what it sent), gauges the largest (each
    replica reports the deployment's gauges)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_raycolo"):
                if family.type == "gauge":
                    out[s.name] = max(out.get(s.name, s.value), s.value)
                else:
                    out[s.name] = out.get(s.name, 0.0) + s.value
    return out


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


# -- clients that go away or never read -------------------------------------------------------------
def _stats(h):
    return h.get("/v1/stats").json()


def test_a_client_that_disconnects_mid_stream_is_cancelled_and_its_kv_freed(front):
    """A client that closes its stream after two chunks: its request is cancelled
    ("abort") and its KV released. Tried up to three times: on a fast machine the whole
    completion (500 tokens, about all the 512-token context allows) can be generated
    before the disconnect reaches the deployment, and then there is nothing to cancel
    (the request ends "length"); its KV must be gone either way."""
    with http(front) as h:
        for attempt in range(3):
            before = _stats(h)["cancelled"].get("abort", 0)
            with h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "go away", "max_tokens": 500,
                                                           "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                chunks = 0
                for line in r.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 2:
                        break                               # and the connection closes here
            deadline = time.time() + 60
            while time.time() < deadline:
                stats = _stats(h)
                # the KV is released by an op the stages run after the cancel is counted
                if ((stats["cancelled"].get("abort", 0) > before or time.time() > deadline - 50)
                        and stats["unfinished"] == 0 and sum(st["memory_bytes"] for st in stats["stages"]) == 0):
                    break
                time.sleep(0.2)
            assert stats["unfinished"] == 0
            assert sum(st["memory_bytes"] for st in stats["stages"]) == 0      # its KV reservation is gone
            if stats["cancelled"].get("abort", 0) > before:
                break
        assert stats["cancelled"].get("abort", 0) == before + 1, stats["cancelled"]
        # and the service goes on
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 3,
                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_stream_nobody_reads_does_not_stall_the_others(front):
    """A client opens a stream and reads nothing for 5 s: other requests complete meanwhile,
    /health answers, and once the slow client goes its request is cancelled."""
    import socket as sockets

    host, port = front["url"].removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "slow", "max_tokens": 300, "stream": True, "ignore_eos": True})
    slow = sockets.create_connection((host, int(port)))
    slow.setsockopt(sockets.SOL_SOCKET, sockets.SO_RCVBUF, 1024)
    slow.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    try:
        started = time.time()
        with http(front) as h:
            before = _stats(h)["cancelled"].get("abort", 0)
            while time.time() - started < 5:
                assert h.get("/health").status_code == 200
                r = h.post("/v1/completions", json={"model": MODEL, "prompt": "meanwhile", "max_tokens": 2,
                                                    "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        slow.close()
    with http(front) as h:
        deadline = time.time() + 60
        while time.time() < deadline and _stats(h)["unfinished"]:
            time.sleep(0.2)
        stats = _stats(h)
    assert stats["unfinished"] == 0
    assert stats["cancelled"].get("abort", 0) + stats["completed"] > before


def test_concurrent_streams_reach_their_replica_without_a_message_per_token(front):
    """Six streamed completions at once (the admission limit): each gets exactly the
    model's greedy text. On the node-loop data plane their tokens go from the node straight
    to the HTTP replica's token inbox: the controller's channel to the replica
    (front_events) carries none of their events. On the controller's data plane they come
    over that channel with several events per message (one message per decode iteration
    for the whole batch, not one per token and request). A request the front admitted
    cannot be read through the per-request stream instead."""
    controller = ray.get_actor(controller_name(front["config"].serve.app_name), namespace=NAMESPACE)
    before = ray.get(controller.stats.remote())
    prompts = [f"concurrent {i} " + "x" * i for i in range(6)]
    ids = set()

    async def one(c, prompt):
        # the base model (earlier tests trained the adapter): transformers' greedy text is the reference
        stream = await c.completions.create(model=MODEL + "@base", prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        ids.add(chunks[0].id)
        return "".join(ch.choices[0].text for ch in chunks)

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=front["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    texts = asyncio.run(all_of_them())
    assert texts == [expected_text(p, 8) for p in prompts]
    after = ray.get(controller.stats.remote())
    messages = after["front_messages"] - before["front_messages"]
    events = after["front_events"] - before["front_events"]
    if front["config"].stage.data_plane == "node":
        assert events == 0, (messages, events)
    else:
        assert events >= 6 * 9                      # 8 tokens and the end, each
        assert messages <= events / 2, (messages, events)
    rid = int(sorted(ids)[0].split("-")[1])          # cmpl-<request id>-<suffix>
    with pytest.raises(ray.exceptions.RayTaskError, match="streams to the HTTP replica"):
        ray.get(controller.result.remote(rid))
    TOKENS_SENT["n"] += 6 * 8


# -- security --------------------------------------------------------------------------------------
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def test_everything_the_deployment_started_listens_on_loopback_only(front):
    """Every listening socket of every process this deployment started (Ray's GCS, raylet,
    agents, workers, Serve's proxy, the stage workers) is on a loopback address."""
    import psutil

    me = psutil.Process()
    listening = []
    for proc in [me] + me.children(recursive=True):
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.append((proc.name(), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    ports = {port for _, _, port in listening}
    assert int(front["url"].rsplit(":", 1)[1]) in ports and front["metrics_port"] in ports
    # Two listeners that neither raycolo nor Ray's config can move off the wildcard address
    # (docs/security.md): each Serve replica's inter-deployment gRPC server (Ray Serve
    # binds "[::]:0" in replica.py) and each node's torch.distributed rendezvous store
    # (rank 0 of a Ray Train worker group; torch's TCPStore listens on every address).
    known = {"ray::ServeReplica": 1, "ray::RayTrainWorker": 2}
    wild = [x for x in listening if x[1] not in LOOPBACK]
    assert len(listening) > 5 and all(any(x[0].startswith(k) for k in known) for x in wild), wild
    for prefix, at_most in known.items():
        assert sum(x[0].startswith(prefix) for x in wild) <= at_most * 2, wild


def test_the_api_key_is_in_no_log_metric_or_report(front):
    import ray

    with http(front) as h:
        texts = [h.get("/v1/stats").text, h.get("/v1/train_samples/status").text, h.get("/v1/models").text]
    texts.append(httpx.get(f"http://127.0.0.1:{front['metrics_port']}/metrics", timeout=30).text)
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    logs = [f for f in (session / "logs").rglob("*") if f.is_file()]
    assert len(logs) > 10
    texts.extend(f.read_bytes().decode("utf-8", "replace") for f in logs)
    texts.extend(f.read_text(errors="replace") for f in front["out"].rglob("*.json"))
    assert not [t for t in texts if KEY in t]


# -- the schema, fuzzed --------------------------------------------------------------------------
def test_openapi_schema_holds_under_schemathesis(front):
    """Every route's documented schema against generated requests: no 5xx, only documented
    status codes and content types, responses that match their schemas, invalid data
    rejected. Left out: "schema-valid data is accepted", since limits that depend on the
    model (its context length, prompts beyond it) cannot be written in JSON Schema and are
    400s (as in vLLM)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_url(front["url"] + "/openapi.json")
    headers = {"Authorization": f"Bearer {KEY}"}
    ran = []
    for result in schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(base_url=front["url"], headers=headers,
                                   excluded_checks=[positive_data_acceptance])
            ran.append(op.label)

        check()
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/train_samples",
            "GET /v1/models", "GET /health"} <= set(ran)


# -- faults: the controller dies, the whole deployment restarts ---------------------------------
def _wait_health(h, status: int, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while (r := h.get("/health")).status_code != status:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    return r


def test_streams_whose_node_dies_resume_elsewhere_with_each_token_once(front):
    """SIGKILL stage 0 (the node loop) of the node serving most of four streamed
    completions: its requests resume (re-prefilled from prompt and the tokens the
    controller had), and each client still gets exactly the model's greedy text, each
    token once, although the node had sent the replica tokens whose report died with it
    (without the replica's position check a stream got 41 tokens of 40). The node comes
    back."""
    import signal

    controller = ray.get_actor(controller_name(front["config"].serve.app_name), namespace=NAMESPACE)
    prompts = [f"resume {i} " + "y" * (3 * i) for i in range(4)]
    n = 40
    seen = [0] * len(prompts)

    async def one(c, i):
        stream = await c.completions.create(model=MODEL + "@base", prompt=prompts[i], max_tokens=n, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        text, usage, finish = [], None, None
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
                finish = ch.choices[0].finish_reason or finish
                seen[i] += 1
            usage = ch.usage or usage
        return "".join(text), finish, usage.completion_tokens if usage else None

    async def kill_when_decoding():
        deadline = time.monotonic() + 60
        while min(seen) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        stats = await controller.stats.remote()
        victim = max(range(2), key=lambda m: stats["queues"][m]["batch"] + stats["queues"][m]["decoding"])
        registry = await controller.registry.remote()
        os.kill(registry[f"node-{victim}/stage-0"]["pid"], signal.SIGKILL)   # its loop: reports in flight die with it
        return victim

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=front["url"] + "/v1", api_key=KEY, max_retries=0, timeout=180) as c:
            streams = [asyncio.ensure_future(one(c, i)) for i in range(len(prompts))]
            victim = await kill_when_decoding()
            return victim, await asyncio.gather(*streams)

    victim, results = asyncio.run(all_of_them())
    for prompt, (text, finish, tokens) in zip(prompts, results):
        assert (finish, tokens) == ("length", n)
        assert text == expected_text(prompt, n)
    stats = ray.get(controller.stats.remote())
    assert [r["node"] for r in stats["restarts"]].count(victim) == 1, stats["restarts"]
    deadline = time.monotonic() + 180
    while ray.get(controller.stats.remote())["restarting_nodes"]:       # back before the next test
        assert time.monotonic() < deadline
        time.sleep(0.2)
    TOKENS_SENT["n"] += len(prompts) * n


def test_a_dead_controller_ends_open_streams_with_an_error_and_comes_back(front):
    """The controller dies while a completion streams: the stream ends with an error event
    (not a cut connection), new requests get 503 with Retry-After while it restarts, and
    then it serves again."""
    import ray

    controller = ray.get_actor(controller_name(front["config"].serve.app_name), namespace=NAMESPACE)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http(front) as h, h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))      # it streams
        ray.kill(controller, no_restart=False)
        rest = list(lines)
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert "error" in events[-1] and "controller" in events[-1]["error"]["message"]
    assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]" or "error" in events[-1]
    with http(front) as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        if r.status_code != 200:       # not back yet: a clear, retryable refusal
            assert r.status_code == 503 and r.headers["retry-after"] and error_of(r)["code"] == "unavailable"
        _wait_health(h, 200)
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_acknowledged_samples_are_trained_after_the_deployment_restarts(front):
    """The whole deployment stops and starts again on the same storage: every acknowledged
    sample is still stored, the adapter comes back from its newest checkpoint, and the
    samples no checkpoint held are trained."""
    from raycolo.actors.serve import launch as serve_launch

    with http(front) as h:
        before = h.get("/v1/train_samples/status").json()
    lines = (front["out"] / "samples" / "samples.jsonl").read_text().splitlines()
    serve_launch.stop(front["config"], started_ray=False)       # the app and its stage workers go
    serve_launch.start(front["config"])
    with http(front) as h:
        _wait_health(h, 200)
        after = h.get("/v1/train_samples/status").json()
        assert after["received"] == before["received"] == len(lines) >= 7
        assert after["resumed"]["adapter_version"] >= (before["last_checkpoint"] or {}).get("version", 0)
        deadline = time.monotonic() + 180
        while (after := h.get("/v1/train_samples/status").json())["trained"] < after["received"]:
            assert time.monotonic() < deadline, after
            time.sleep(0.5)
    assert (front["out"] / "samples" / "samples.jsonl").read_text().splitlines() == lines
