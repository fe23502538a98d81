"""The ingress replica's own HTTP listener (raycolo/actors/serve/listener.py) without Ray: the
shared port, the route prefix, the 503 before Serve has registered the replica, and a
port another program holds. The whole path, with Ray Serve, two replicas and the official
``openai`` client, is tests/serve/deployment/."""
from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from raycolo.actors.serve.listener import ReplicaListener, shared_socket
from raycolo.errors import ConfigError


def app_named(name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/who")
    async def who():
        return {"name": name}

    @app.get("/v1/count")
    async def count():
        async def lines():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(lines(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_listeners_share_one_port_and_the_kernel_spreads_connections():
    async def main():
        port = free_port()
        a = await ReplicaListener.start(app_named("a"), shared_socket("127.0.0.1", port), "/", ready=lambda: True)
        b = await ReplicaListener.start(app_named("b"), shared_socket("127.0.0.1", port), "/", ready=lambda: True)
        try:
            assert a.address == b.address == ("127.0.0.1", port)
            seen = []
            for _ in range(24):        # a new connection each time: a new source port to hash
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                    seen.append((await c.get("/v1/who")).json()["name"])
                    r = await c.get("/v1/count")
                    assert r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
            return seen
        finally:
            a.stop()
            b.stop()
            await asyncio.gather(a.task, b.task)

    seen = asyncio.run(main())
    assert set(seen) == {"a", "b"}, seen


def test_the_route_prefix_and_the_503_before_the_replica_is_registered():
    registered = {"yes": False}

    async def main():
        port = free_port()
        listener = await ReplicaListener.start(app_named("a"), shared_socket("127.0.0.1", port), "/api/",
                                               ready=lambda: registered["yes"])
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                early = await c.get("/api/v1/who")
                registered["yes"] = True
                return early, await c.get("/api/v1/who"), await c.get("/v1/who"), await c.get("/apiv1/who")
        finally:
            listener.stop()
            await listener.task

    early, ok, outside, lookalike = asyncio.run(main())
    assert early.status_code == 503 and early.headers["retry-after"] == "1"
    assert early.json()["error"]["code"] == "unavailable"
    assert ok.status_code == 200 and ok.json() == {"name": "a"}
    for r in (outside, lookalike):
        assert r.status_code == 404 and r.json()["error"]["message"] == f"no route {r.url.path}"


def test_a_port_held_by_a_program_that_does_not_share_it_is_a_config_error():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^serve.port: cannot listen on 127.0.0.1:{port}"):
            shared_socket("127.0.0.1", port)


def test_a_stopping_listener_finishes_its_streams_and_takes_no_new_connection():
    """drain (a replica that Serve stops): the stream in flight ends whole, a new
    connection is refused, and the drain says the requests finished."""
    release = asyncio.Event()
    app = FastAPI()

    @app.get("/v1/slow")
    async def slow():
        async def lines():
            yield "data: 0\n\n"
            await release.wait()
            yield "data: 1\n\n"
        return StreamingResponse(lines(), media_type="text/event-stream")

    async def main():
        port = free_port()
        listener = await ReplicaListener.start(app, shared_socket("127.0.0.1", port), "/", ready=lambda: True)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            async with c.stream("GET", "/v1/slow") as r:
                lines = r.aiter_text()
                first = await lines.__anext__()
                drained = asyncio.create_task(listener.drain(10.0))
                await asyncio.sleep(0.3)             # it stops accepting; the stream stays open
                with pytest.raises(httpx.ConnectError):
                    async with httpx.AsyncClient() as other:
                        await other.get(f"http://127.0.0.1:{port}/v1/slow")
                release.set()
                rest = "".join([t async for t in lines])
        return first + rest, await drained

    text, finished = asyncio.run(main())
    assert text == "data: 0\n\ndata: 1\n\n" and finished
