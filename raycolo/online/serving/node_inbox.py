"""Requests from an HTTP replica straight to a node, while the deployment's controller is down.

A node's loop takes its work from the controller (``node_commands``). When the controller
dies, Ray restarts it (a few seconds: a new process, its imports, its state) and the
nodes' worker groups wait for it (raycolo/actors/online/node_worker.py). Meanwhile a
replica places new completions on the nodes itself: each node's stage 0 listens on a
*node inbox* (its Ray node's address, any free port, a random secret), which the
controller's ``monitor()`` tells the replicas along with each node's load.

The node takes a request only while its controller is gone (before, the controller's
mirror of the node must see every request, and after it the node registers again with
the new controller); it runs it like one the controller placed and streams its tokens
to the replica's token inbox (:mod:`raycolo.online.serving.token_wire`). Once the restarted
controller is ready (every node registered again, ending what it ran meanwhile), the
replica admits the request to it with the tokens it streamed, and the request continues
from there: each token keeps its position, and one streamed already is dropped.

The wire is :mod:`~raycolo.online.serving.token_wire`'s: frames of a 4-byte big-endian
length and JSON (never pickle). A connection sends the secret first, then one request;
the node answers ``{"ok": true}`` (taken) or ``{"ok": false}`` (not now). Pure: sockets
and threads, no Ray.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import threading
from typing import Callable, Optional

from raycolo.generation import SamplingParams
from raycolo.online.serving.token_wire import (_LENGTH, CONNECT_TIMEOUT_S, MAX_FRAME_BYTES, FrontInbox, FrontKey,
                                               NodeAddress, frame)
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.tasks import OnlineTask, TaskKind

PLACE_TIMEOUT_S = 2.0        # a node that does not answer a placement within this is passed over


def encode_request(request: ServedRequest) -> bytes:
    """One frame holding what a node needs of a fresh request (no adapter version: a
    request pinned to one waits for the controller)."""
    front = request.front
    body = {"id": request.task.task_id, "prompt": request.prompt, "params": request.params.model_dump(mode="json"),
            "seed": request.seed, "stop_ids": sorted(request.stop_ids), "base": request.base,
            "front": [front.replica, front.key, front.inbox.host, front.inbox.port, front.inbox.secret]}
    return frame(json.dumps(body, separators=(",", ":")).encode())


def decode_request(payload: bytes, now: float) -> ServedRequest:
    """The request of one frame, arriving at ``now`` (the node's clock); ValueError if it is
    not one :func:`encode_request` wrote."""
    body = json.loads(payload)
    if not isinstance(body, dict) or set(body) != {"id", "prompt", "params", "seed", "stop_ids", "base", "front"}:
        raise ValueError("not a request frame")
    rid, prompt, seed, stop_ids, base, front = (body[k] for k in ("id", "prompt", "seed", "stop_ids", "base", "front"))
    if not (type(rid) is int and isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
            and type(seed) is int and isinstance(stop_ids, list) and all(type(t) is int for t in stop_ids)
            and type(base) is bool and isinstance(front, list) and len(front) == 5):
        raise ValueError("a malformed request frame")
    replica, key, host, port, secret = front
    if not (isinstance(replica, str) and type(key) is int and isinstance(host, str) and type(port) is int
            and isinstance(secret, str)):
        raise ValueError("a malformed request frame: front")
    params = SamplingParams.model_validate(body["params"])
    task = OnlineTask(rid, TaskKind.INFERENCE, now, len(prompt), 1, 0, params.max_tokens)
    return ServedRequest(task, prompt, params, seed=seed, stop_ids=frozenset(stop_ids), base=base,
                         front=FrontKey(replica, key, FrontInbox(host, port, secret)))


def _read_frame(sock: socket.socket) -> bytes:
    head = _recv_exactly(sock, _LENGTH.size)
    (size,) = _LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed mid-frame")
        data += chunk
    return bytes(data)


class NodeInbox:
    """A node's side: a listener thread (and one per connection) that hands each request to
    ``deliver`` while ``accepting()`` is true; both are set per loop (:meth:`attach`)."""

    def __init__(self, node: int, host: str):
        self.secret = secrets.token_hex(16)
        self.server = socket.create_server((host, 0))
        self.address = NodeAddress(node, host, self.server.getsockname()[1], self.secret)
        self.accepting: Callable[[], bool] = lambda: False
        self.deliver: Callable[[bytes], bool] = lambda payload: False
        self.taken = 0
        threading.Thread(target=self._listen, daemon=True, name="node-inbox").start()

    def attach(self, accepting: Callable[[], bool], deliver: Callable[[bytes], bool]) -> None:
        """From now: take requests while ``accepting()``; ``deliver(payload)`` takes one
        (its frame's bytes) and says whether it did."""
        self.accepting, self.deliver = accepting, deliver

    def _listen(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:          # closed
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(PLACE_TIMEOUT_S)
                if not hmac.compare_digest(_read_frame(conn), self.secret.encode()):
                    return
                payload = _read_frame(conn)
                ok = self.accepting() and self.deliver(payload)
                self.taken += ok
                conn.sendall(frame(json.dumps({"ok": bool(ok)}).encode()))
            except (OSError, ValueError, TypeError, RecursionError):
                pass

    def close(self) -> None:
        self.accepting = lambda: False
        try:
            self.server.shutdown(socket.SHUT_RDWR)     # wakes the thread in accept()
        except OSError:
            pass
        self.server.close()


async def place(address: NodeAddress, request: ServedRequest, timeout_s: float = PLACE_TIMEOUT_S) -> bool:
    """A replica's side: offer ``request`` to the node at ``address``; whether it took it
    (False too when it cannot be reached in time)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port),
                                                min(timeout_s, CONNECT_TIMEOUT_S))
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(frame(address.secret.encode()) + encode_request(request))
        await writer.drain()
        (size,) = _LENGTH.unpack(await asyncio.wait_for(reader.readexactly(_LENGTH.size), timeout_s))
        answer = json.loads(await asyncio.wait_for(reader.readexactly(min(size, 64)), timeout_s))
        return isinstance(answer, dict) and answer.get("ok") is True
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    finally:
        writer.close()


def least_loaded(load: dict[int, float], placed: dict[int, int], tried: set[int]) -> Optional[int]:
    """The node to offer a request to: the fewest requests as the controller last reported
    them (``load``) plus those this replica placed there since (``placed``), ties to the
    lower index, among the nodes not ``tried`` yet; None when none is left."""
    left = [n for n in load if n not in tried]
    if not left:
        return None
    return min(left, key=lambda n: (load[n] + placed.get(n, 0), n))
