"""Tokens from a node straight to an HTTP replica (raycolo/online/serving/token_wire.py), over
real loopback sockets, without Ray: a node's TokenSender against a replica's inbox, the
secret, hostile bytes, and a request resumed on another node."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time

import pytest

from raycolo.generation.sampler import TokenLogprob
from raycolo.online.scheduling.node_loop import TokenOut
from raycolo.online.serving.token_wire import (FrontKey, InboxToken, Positions, TokenSender, decode_tokens, encode_tokens,
                                        frame, serve_inbox, token_events)

WAIT_S = 10.0


class Replica:
    """A replica's inbox on 127.0.0.1, served by an asyncio loop in a thread."""

    def __init__(self):
        self.got: list[InboxToken] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.inbox, self.server = asyncio.run_coroutine_threadsafe(
            serve_inbox("127.0.0.1", self.got.extend), self.loop).result(WAIT_S)

    def wait_for(self, n: int) -> list[InboxToken]:
        deadline = time.monotonic() + WAIT_S
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.got)

    def close(self):
        async def shutdown():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


@pytest.fixture
def replica():
    r = Replica()
    yield r
    r.close()


def raw(replica, *frames: bytes) -> bool:
    """Write ``frames`` on a fresh connection; True if the replica closed it after."""
    with socket.create_connection((replica.inbox.host, replica.inbox.port), timeout=WAIT_S) as s:
        for f in frames:
            s.sendall(f)
        s.settimeout(WAIT_S)
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True


def test_a_nodes_tokens_reach_the_replica_that_admitted_each_request_with_their_logprobs(replica):
    other = Replica()
    try:
        sender = TokenSender()
        sender.watch(1, FrontKey("a", 10, replica.inbox))
        sender.watch(2, FrontKey("b", 20, other.inbox))
        sender.watch(3, FrontKey("a", 30, None))          # its replica takes tokens from the controller
        lp = TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)])
        sender.send([TokenOut(1, 5, True, None, lp, 0), TokenOut(2, 7, True, None, None, 0),
                     TokenOut(3, 8, True, None, None, 0), TokenOut(4, 8, True, None, None, 0)])
        sender.send([TokenOut(1, 6, True, "stop", None, 1), TokenOut(2, 7, False, "abort", None, 1)])
        sender.send([TokenOut(1, 6, True, None, None, 2)])    # after its end: forgotten, not sent
        assert replica.wait_for(2) == [InboxToken(10, 0, 5, True, None, lp), InboxToken(10, 1, 6, True, "stop", None)]
        assert other.wait_for(2) == [InboxToken(20, 0, 7, True, None, None), InboxToken(20, 1, 7, False, "abort", None)]
        time.sleep(0.1)
        assert len(replica.got) == 2 and sender.fronts == {}     # 3 never watched, 1 and 2 ended
        assert sender.frames == 4                               # one frame per replica per send
        sender.close()
    finally:
        other.close()


def test_the_stream_events_of_a_token_are_one_rule():
    lp = TokenLogprob(4, -0.1, [])
    assert token_events(4, True, None, lp) == [("logprob", lp), ("token", 4)]
    assert token_events(2, True, "stop", None) == [("stop_token", 2), ("done", "stop")]
    assert token_events(3, True, "length", None) == [("token", 3), ("done", "length")]
    assert token_events(3, False, "abort", lp) == [("done", "abort")]


@pytest.mark.parametrize("payload", [
    b"not json", b"{}", b"[[1, 2]]", b"[[1, 0, 5, 1, null, null, null]]",        # kept must be a bool
    b'[["1", 0, 5, true, null, null, null]]', b"[[1, 0, 5, true, 7, null, null]]",
    b"[[1, 0, 5, true, null, [1, \"x\", [], null], null]]", b"[[1, 0, 5, true, null, null, \"x\"]]",
    b"[[1, 0, 5, true, null, null, [null, [1, -1.0]]]]", b"[[1, 0, 5, true, null, null]]",   # a row of before
    b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe",
])
def test_a_frame_that_is_not_tokens_closes_the_connection_and_delivers_nothing(replica, payload):
    with pytest.raises((ValueError, TypeError, RecursionError)):
        decode_tokens(payload)
    assert raw(replica, frame(replica.inbox.secret.encode()), frame(payload))
    assert replica.got == []


def test_a_connection_without_the_secret_or_with_a_huge_frame_is_closed_and_the_inbox_keeps_serving(replica):
    good = encode_tokens([(1, TokenOut(1, 5, True, None, None, 0))])
    assert raw(replica, frame(b"wrong secret"), good)
    assert raw(replica, good)                                         # tokens before the secret
    assert raw(replica, struct.pack(">I", 1 << 30))                   # a 1 GiB frame announced
    assert raw(replica, frame(replica.inbox.secret.encode()), struct.pack(">I", 1 << 30))
    time.sleep(0.1)
    assert replica.got == []
    sender = TokenSender()
    sender.watch(1, FrontKey("a", 1, replica.inbox))
    sender.send([TokenOut(1, 5, True, None, None, 0)])
    assert replica.wait_for(1) == [InboxToken(1, 0, 5, True, None, None)]
    sender.close()


def test_an_unreachable_replica_loses_its_tokens_without_stalling_the_node():
    with socket.socket() as s:              # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from raycolo.online.serving.token_wire import RETRY_AFTER_S, FrontInbox

    sender = TokenSender()
    sender.watch(1, FrontKey("gone", 1, FrontInbox("127.0.0.1", port, "s")))
    start = time.monotonic()
    for i in range(50):
        sender.send([TokenOut(1, 5, True, None, None, i)])
    assert time.monotonic() - start < RETRY_AFTER_S            # one refused connect, then no tries
    assert sender.frames == 0 and 1 in sender.fronts


def test_a_request_resumed_on_another_node_streams_each_position_once():
    """Node A streamed positions 0-3 but the controller heard of 0-1 when A failed: the
    resumed request on node B generates from position 2; the replica passes 4 on."""
    positions = Positions()
    a = [InboxToken(1, i, 10 + i, True, None, None) for i in range(4)]
    b = [InboxToken(1, i, 20 + i, True, None, None) for i in range(2, 6)] + [InboxToken(1, 6, 0, False, "abort", None)]
    passed = [t for t in a + b if positions.admit(t)]
    assert [(t.position, t.token) for t in passed] == [(0, 10), (1, 11), (2, 12), (3, 13), (4, 24), (5, 25), (6, 0)]
    positions.forget(1)
    assert positions.admit(InboxToken(1, 0, 1, True, None, None))


def test_frames_are_json_not_pickle():
    data = encode_tokens([(3, TokenOut(1, 5, True, "length", TokenLogprob(5, -1.0, [(5, -1.0)]), 7))])
    assert json.loads(data[4:]) == [[3, 7, 5, True, "length", [5, -1.0, [[5, -1.0]], None], None]]
    assert struct.unpack(">I", data[:4])[0] == len(data) - 4


def test_a_prompts_log_probabilities_travel_with_its_first_token_and_come_first():
    """The prompt's log-probabilities (the first token's None, each with its rank) ride on
    the request's first token, in the frame and in the stream's events, before the token."""
    prompt = [None, TokenLogprob(7, -2.5, [(3, -0.5), (7, -2.5)], 2), TokenLogprob(9, -9.0, [], 40)]
    out = TokenOut(1, 5, True, None, TokenLogprob(5, -0.1, [(5, -0.1)]), 0, prompt)
    (got,) = decode_tokens(encode_tokens([(4, out)])[4:])
    assert got == InboxToken(4, 0, 5, True, None, out.logprob, prompt)
    assert [e.kind for e in token_events(5, True, None, out.logprob, prompt)] == ["prompt_logprobs", "logprob", "token"]
    assert token_events(5, True, None, None, prompt)[0].value is prompt
