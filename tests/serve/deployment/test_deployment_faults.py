"""The same deployment (tests/serve/deployment/conftest.py) when things go wrong: clients
that go away or never read, many streams at once, listeners on loopback only, the API key
in no log, the OpenAPI schema under schemathesis, a node that dies, the controller that
dies, and the whole deployment restarting.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray

from raycolo.actors.local_cluster import NAMESPACE, controller_name

from tests.support.online_checks import trained_exactly_once
from tests.support.serve_checks import (_stats, _wait_health, expected_text, scrape, http, KEY, LOOPBACK,
                                        MODEL, TOKENS_SENT)


# -- clients that go away or never read -------------------------------------------------------------

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


async def _greedy_stream(c, prompt: str, n: int, seen: list, i=None):
    """Stream ``n`` greedy tokens of the base model for ``prompt`` (EOS ignored), counting
    chunks in ``seen[i]``; returns (text, finish_reason, completion_tokens)."""
    stream = await c.completions.create(model=MODEL + "@base", prompt=prompt, max_tokens=n, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    text, usage, finish = [], None, None
    async for ch in stream:
        if ch.choices:
            text.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
            if i is not None:
                seen[i] += 1
        usage = ch.usage or usage
    return "".join(text), finish, usage.completion_tokens if usage else None


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
        return await _greedy_stream(c, prompts[i], n, seen, i)

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


def test_a_dead_controller_costs_no_stream_and_no_request(front):
    """The controller dies while three completions stream. Its worker groups outlive it
    (the same processes) and register with the restarted controller; the replicas admit
    the open streams again with the tokens they streamed, so each still gets exactly the
    model's greedy text, each token once; a request sent while it restarts is held, not
    refused."""
    controller = ray.get_actor(controller_name(front["config"].serve.app_name), namespace=NAMESPACE)
    pids = {key: w["pid"] for key, w in ray.get(controller.registry.remote()).items()}
    prompts = [f"restart {i} " + "z" * (2 * i) for i in range(3)]
    n = 60
    seen = [0] * len(prompts)

    async def one(c, prompt, i=None):
        return await _greedy_stream(c, prompt, n, seen, i)

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=front["url"] + "/v1", api_key=KEY, max_retries=0, timeout=180) as c:
            streams = [asyncio.ensure_future(one(c, p, i)) for i, p in enumerate(prompts)]
            deadline = time.monotonic() + 60
            while min(seen) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            ray.kill(controller, no_restart=False)
            await asyncio.sleep(0.5)                   # Ray is restarting it now
            async with httpx.AsyncClient(base_url=front["url"], headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=60) as h:     # samples are acknowledged meanwhile
                posted = await h.post("/v1/train_samples", json={"samples": [
                    {"prompt": "while it restarts: copy xy", "completion": "xy xy"}]})
            late = await one(c, "while it restarts")
            return await asyncio.gather(*streams), late, posted

    results, late, posted = asyncio.run(all_of_them())
    assert posted.status_code == 200, posted.text
    for prompt, (text, finish, tokens) in zip(prompts + ["while it restarts"], results + [late]):
        assert (finish, tokens) == ("length", n)
        assert text == expected_text(prompt, n)
    with http(front) as h:
        _wait_health(h, 200)          # the restarted controller, its nodes registered again
    workers = ray.get(controller.registry.remote())
    assert {key: w["pid"] for key, w in workers.items()} == pids and all(w["rejoined"] for w in workers.values())
    (seq,) = posted.json()["ids"]
    deadline = time.monotonic() + 120       # trained by the restarted controller, once
    while ray.get(controller.sample_ledger.remote())["trained"].get(seq, 0) < 1:
        assert time.monotonic() < deadline, "the sample acknowledged during the restart was never trained"
        time.sleep(0.5)
    assert ray.get(controller.sample_ledger.remote())["trained"][seq] == 1
    TOKENS_SENT["n"] += (len(prompts) + 1) * n
    deadline = time.monotonic() + 30       # the late request went to a node without the controller
    while scrape(front["metrics_port"]).get("ray_raycolo_requests_placed_directly_total", 0) < 1:
        assert time.monotonic() < deadline, "no request was placed on a node while the controller was down"
        time.sleep(1)


def test_acknowledged_samples_are_trained_after_the_deployment_restarts(front):
    """The whole deployment stops and starts again on the same storage: every acknowledged
    sample is still stored, the adapter comes back from its newest checkpoint (every
    node's workers restored it), exactly the samples no checkpoint held are trained again,
    each once, and the adapter version counts on from the restored one."""
    from raycolo.actors.serve import launch as serve_launch

    with http(front) as h:       # two acknowledged just before the stop (trained or not by then)
        posted = h.post("/v1/train_samples", json={"samples": [
            {"prompt": f"before the restart {i}: copy ab", "completion": "ab ab"} for i in range(2)]})
        assert posted.status_code == 200, posted.text
        before = h.get("/v1/train_samples/status").json()
    lines = (front["out"] / "samples" / "samples.jsonl").read_text().splitlines()
    serve_launch.stop(front["config"], started_ray=False)       # the app and its stage workers go
    serve_launch.start(front["config"])
    controller = ray.get_actor(controller_name(front["config"].serve.app_name), namespace=NAMESPACE)
    with http(front) as h:
        _wait_health(h, 200)
        after = h.get("/v1/train_samples/status").json()
    assert after["received"] == before["received"] == len(lines) >= 9
    resumed = after["resumed"]
    assert resumed["adapter_version"] >= (before["last_checkpoint"] or {}).get("version", 0) > 0
    restored = {w["restored_version"] for w in ray.get(controller.registry.remote()).values()}
    assert max(v or 0 for v in restored) == resumed["adapter_version"], (restored, resumed)
    # the store's first pass: a sample is held by a node's checkpoint or trained again
    assert ray.get(controller.sample_ledger.remote())["epoch"] == 0
    assert resumed["samples_held"] > 0 and resumed["samples_held"] + resumed["samples_resumed"] == len(lines)
    trained_exactly_once(lambda: ray.get(controller.drain.remote()),
                         lambda: ray.get(controller.sample_ledger.remote()), 180)
    with http(front) as h:
        status = h.get("/v1/train_samples/status").json()
    assert status["trained"] == status["received"] == len(lines)
    # A checkpoint (a new version) comes every lora.checkpoint_every optimizer steps of one
    # node, so the resumed training makes one for certain only when its steps cannot all fall
    # short of that on every node (a fresh clone saw 7 == 7 after fewer steps).
    steps = ray.get(controller.monitor.remote())["optimizer_steps"]    # of this controller: since the restart
    every, nodes = front["config"].lora.checkpoint_every, front["config"].nodes
    assert status["adapter_version"] >= resumed["adapter_version"]
    if steps > nodes * (every - 1):
        assert status["adapter_version"] > resumed["adapter_version"], (steps, status, resumed)
    assert (front["out"] / "samples" / "samples.jsonl").read_text().splitlines() == lines
