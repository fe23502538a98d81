"""What the checkpoint serving tests (tests/serve/checkpoints/) share: the kinds served,
the completion length, a client, and a streamed answer's events."""
from __future__ import annotations

import json

import httpx
import openai

MAX_NEW = 24
KINDS = ["llama3", "qwen2"]
STREAM_INTERVAL = 5


def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def sse(h: httpx.Client, route: str, body: dict) -> list[dict]:
    """A streamed answer's events (the ``data:`` lines before ``[DONE]``)."""
    with h.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]
