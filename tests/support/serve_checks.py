"""What the deployment tests (tests/serve/deployment/) share: the API key, the served model,
the counts of what the tests received (checked against the metrics: one object for every
module of the package), clients, the greedy reference text, an OpenAI error's fields, a
Prometheus scrape, the stats and health routes.
"""
from __future__ import annotations

import time

import httpx
import openai

from tests.support.tiny_reference import hf_greedy

KEY_ENV, KEY = "RAYCOLO_TEST_API_KEY", "test-key-1234"
MODEL = "tiny-llama-s"
TOKENS_SENT = {"n": 0}          # generated tokens the tests received (checked against the metrics)
SAMPLES_SENT = {"n": 0}         # training samples the tests had acknowledged


def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(front) -> httpx.Client:
    return httpx.Client(base_url=front["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def expected_text(prompt_text: str, n: int) -> str:
    from raycolo.engine.models import load_tokenizer
    tok = load_tokenizer(MODEL)
    # a last character cut off by max_tokens is not text (an incremental detokenizer's rule)
    return tok.decode(hf_greedy(MODEL, tok.encode(prompt_text), n)).rstrip("\ufffd")

def error_of(response):
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]

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
def _stats(h):
    return h.get("/v1/stats").json()

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")

def _wait_health(h, status: int, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while (r := h.get("/health")).status_code != status:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    return r
