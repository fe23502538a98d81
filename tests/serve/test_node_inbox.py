"""Requests from a replica straight to a node while the controller is down
(raycolo/online/serving/node_inbox.py), over real loopback sockets, without Ray: the
request round trip, a node that does not take requests now, the secret, hostile bytes,
and the least-loaded rule against a brute force."""
from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
import time

import pytest

from raycolo.generation import SamplingParams
from raycolo.online.serving.node_inbox import NodeInbox, decode_request, encode_request, least_loaded, place
from raycolo.online.serving.token_wire import FrontInbox, FrontKey, NodeAddress, frame
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.tasks import OnlineTask, TaskKind


def _request(rid: int = -7) -> ServedRequest:
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=11, stop=["\n\n"], logprobs=2)
    return ServedRequest(OnlineTask(rid, TaskKind.INFERENCE, 0.0, 4, 1, 0, 9), [1, 5, 6, 7], params, seed=11,
                         stop_ids=frozenset({2, 50256}), base=True,
                         front=FrontKey("replica-a", 3, FrontInbox("127.0.0.1", 4321, "s" * 32)))


def test_a_request_crosses_the_wire_as_it_was_placed():
    sent = _request()
    got = decode_request(encode_request(sent)[4:], now=12.5)
    assert got.task == OnlineTask(-7, TaskKind.INFERENCE, 12.5, 4, 1, 0, 9)
    assert (got.prompt, got.params, got.seed, got.stop_ids, got.base, got.front) == \
        (sent.prompt, sent.params, sent.seed, sent.stop_ids, sent.base, sent.front)
    assert got.generated == [] and got.version is None


@pytest.mark.parametrize("body", [
    b"[]", b'{"id": 1}', b"not json",
    json.dumps({"id": "1", "prompt": [1], "params": {}, "seed": 0, "stop_ids": [], "base": False,
                "front": ["r", 0, "h", 1, "s"]}).encode(),
    json.dumps({"id": 1, "prompt": [], "params": {}, "seed": 0, "stop_ids": [], "base": False,
                "front": ["r", 0, "h", 1, "s"]}).encode(),
    json.dumps({"id": 1, "prompt": [1], "params": {"max_tokens": -3}, "seed": 0, "stop_ids": [], "base": False,
                "front": ["r", 0, "h", 1, "s"]}).encode(),
    json.dumps({"id": 1, "prompt": [1], "params": {}, "seed": 0, "stop_ids": [], "base": False,
                "front": ["r", 0, "h", "1", "s"]}).encode(),
])
def test_a_malformed_request_frame_is_refused(body):
    with pytest.raises(ValueError):
        decode_request(body, now=0.0)


def test_a_node_takes_requests_only_while_it_accepts_and_with_the_secret():
    inbox = NodeInbox(0, "127.0.0.1")
    taken, open_now = [], [False]

    def deliver(payload: bytes) -> bool:
        taken.append(decode_request(payload, now=1.0))
        return True

    inbox.attach(lambda: open_now[0], deliver)
    try:
        assert asyncio.run(place(inbox.address, _request(-1))) is False     # its controller is up
        open_now[0] = True
        assert asyncio.run(place(inbox.address, _request(-2))) is True
        assert [r.task.task_id for r in taken] == [-2] and inbox.taken == 1
        wrong = NodeAddress(0, "127.0.0.1", inbox.address.port, "0" * 32)
        assert asyncio.run(place(wrong, _request(-3))) is False
        with socket.create_connection(("127.0.0.1", inbox.address.port)) as s:    # hostile bytes
            s.sendall(frame(inbox.secret.encode()) + struct.pack(">I", 1 << 30) + b"x" * 64)
            s.settimeout(5)
            try:
                answer = s.recv(16)
            except ConnectionResetError:      # closed with our bytes unread
                answer = b""
            assert answer == b""              # closed without an answer
        assert asyncio.run(place(inbox.address, _request(-4))) is True     # still serving
        assert [r.task.task_id for r in taken] == [-2, -4]
    finally:
        inbox.close()
    gone = NodeAddress(0, "127.0.0.1", inbox.address.port, inbox.secret)
    started = time.monotonic()
    assert asyncio.run(place(gone, _request(-5))) is False and time.monotonic() - started < 5


def test_least_loaded_against_a_brute_force():
    for load_values in itertools.product(range(3), repeat=3):
        load = dict(enumerate(load_values))
        for placed_values in itertools.product(range(2), repeat=3):
            placed = dict(enumerate(placed_values))
            for tried in ({}, {0}, {0, 2}, {0, 1, 2}):
                left = [n for n in range(3) if n not in tried]
                want = sorted(left, key=lambda n: (load[n] + placed[n], n))[0] if left else None
                assert least_loaded(load, placed, set(tried)) == want
