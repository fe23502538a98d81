"""Tokens from a node straight to the HTTP replica that admitted the request.

With the node-loop data plane (``stage.data_plane: node``) a node's loop knows every
token its requests get, whether it ends them, and their log-probabilities. Rather than
sending them to the controller and the controller to the replica (two hops, and every
token of the deployment through one process), stage 0 of the node writes them to the
replica's *token inbox*, a TCP listener the replica opens on its own Ray node's address
(127.0.0.1 on a one-machine cluster), one connection per node and replica. The
controller still gets the tokens in the node's reports, for its own books (a request
moved to another node after a failure resumes from them), but sends no events for
them.

* :class:`FrontInbox` is the replica's listener: address, port and a random secret that a
  connection must send first (so nothing else on the network can write to a stream);
* :class:`FrontKey` names a request on its replica, with the inbox where that replica
  takes its tokens;
* :func:`token_events` is the one rule turning a token into a stream's events, used by the
  controller's streams and by the inbox alike;
* :class:`TokenSender` (node side, blocking sockets) and :func:`serve_inbox` (replica
  side, asyncio) speak the wire: frames of a 4-byte big-endian length and JSON (never
  pickle: the bytes come from a socket).

A request moved to another node after its node failed starts again from the tokens the
controller knew, which can be fewer than the replica already streamed; every token
carries its position in the completion, and the replica drops the ones it has.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from raycolo.generation import FinishReason
from raycolo.generation.rows import TokenLogprob
from raycolo.online.serving.messages import EventKind, StreamEvent

MAX_FRAME_BYTES = 256 << 20       # a frame longer than this closes the connection (a long prompt's log-probabilities fit)
CONNECT_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 5.0              # a replica that takes nothing for this long is dropped
RETRY_AFTER_S = 1.0               # an inbox that failed is not tried again before this
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class FrontInbox:
    """Where an HTTP replica takes its requests' tokens from nodes."""

    host: str
    port: int
    secret: str


@dataclass(frozen=True)
class NodeAddress:
    """Where node ``node``'s stage 0 takes requests from replicas while the controller is
    down (:mod:`raycolo.online.serving.node_inbox`)."""

    node: int
    host: str
    port: int
    secret: str


@dataclass(frozen=True)
class FrontKey:
    """Which HTTP replica admitted a request, and its key for it there (``admit(front=)``);
    ``inbox``: where that replica takes tokens straight from the nodes (None: they come
    through the controller)."""

    replica: str
    key: int
    inbox: Optional[FrontInbox] = None


def token_events(token: int, kept: bool, reason: Optional[FinishReason], logprob,
                 prompt: Optional[list] = None) -> list[StreamEvent]:
    """A stream's events for a token the request got (``kept``: it is the request's;
    ``reason``: it ended the request): ("prompt_logprobs", [TokenLogprob | None]) with the
    first token where asked for (``prompt``), ("logprob", TokenLogprob) where asked for, then
    ("token", id), or ("stop_token", id) for the stop token that ended it (counted, never
    text); then ("done", reason)."""
    out = [] if prompt is None else [StreamEvent(EventKind.PROMPT_LOGPROBS, prompt)]
    if kept:
        if logprob is not None:
            out.append(StreamEvent(EventKind.LOGPROB, logprob))
        out.append(StreamEvent(EventKind.STOP_TOKEN if reason == FinishReason.STOP else EventKind.TOKEN, token))
    if reason:
        out.append(StreamEvent(EventKind.DONE, reason))
    return out


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def _logprob_row(lp: Optional[TokenLogprob]) -> Optional[list]:
    return None if lp is None else [lp.token, lp.logprob, [list(t) for t in lp.top], lp.rank]


def _logprob_of(row) -> Optional[TokenLogprob]:
    if row is None:
        return None
    token, logprob, top, rank = row
    return TokenLogprob(int(token), float(logprob), [(int(t), float(v)) for t, v in top],
                        None if rank is None else int(rank))


def encode_tokens(items: Iterable[tuple]) -> bytes:
    """One frame of (key, TokenOut) pairs."""
    rows = []
    for key, out in items:
        prompt = out.prompt_logprobs
        rows.append([key, out.position, out.token, out.kept, out.finish_reason, _logprob_row(out.logprob),
                     None if prompt is None else [_logprob_row(lp) for lp in prompt]])
    return frame(json.dumps(rows, separators=(",", ":")).encode())


@dataclass(frozen=True, slots=True)
class InboxToken:
    """A token as the replica receives it (see :class:`raycolo.online.scheduling.node_loop.TokenOut`)."""

    key: int
    position: int
    token: int
    kept: bool
    finish_reason: Optional[FinishReason]
    logprob: Optional[TokenLogprob]
    prompt_logprobs: Optional[list] = None


def decode_tokens(payload: bytes) -> list[InboxToken]:
    """The tokens of one frame; ValueError if it is not one :func:`encode_tokens` wrote."""
    rows = json.loads(payload)
    if not isinstance(rows, list):
        raise ValueError("a token frame is a list")
    out = []
    for row in rows:
        key, position, token, kept, reason, lp, prompt = row
        if not (type(key) is int and type(position) is int and type(token) is int and type(kept) is bool
                and (reason is None or type(reason) is str) and (prompt is None or type(prompt) is list)):
            raise ValueError(f"not a token row: {row!r}")
        out.append(InboxToken(key, position, token, kept, None if reason is None else FinishReason(reason),
                              _logprob_of(lp), None if prompt is None else [_logprob_of(p) for p in prompt]))
    return out


class Positions:
    """The replica's side of a request that resumed on another node: it starts again from
    the tokens the controller knew, which can be fewer than the replica streamed. Keeps,
    per request key, how many tokens it streamed and drops tokens already streamed."""

    def __init__(self) -> None:
        self.streamed: dict[int, int] = {}

    def admit(self, t: InboxToken) -> bool:
        """Whether ``t`` goes to its stream (a token not kept, which ends the request, always does)."""
        seen = self.streamed.get(t.key, 0)
        if t.kept and t.position < seen:
            return False
        self.streamed[t.key] = max(seen, t.position + t.kept)
        return True

    def forget(self, key: int) -> None:
        self.streamed.pop(key, None)


class TokenSender:
    """A node's side: sends its requests' tokens to the replicas that admitted them, one
    connection per replica, one frame per replica per call. Thread-safe for :meth:`watch`
    from another thread than :meth:`send`'s."""

    def __init__(self) -> None:
        self.fronts: dict[int, FrontKey] = {}         # task id -> where its tokens go
        self.socks: dict[FrontInbox, socket.socket] = {}
        self.failed: dict[FrontInbox, float] = {}     # inbox -> when it last failed
        self.frames = 0
        self.muted = False

    def watch(self, task_id: int, front: Optional[FrontKey]) -> None:
        """Request ``task_id`` (placed on this node) streams to ``front``'s inbox."""
        if front is not None and front.inbox is not None and not self.muted:
            self.fronts[task_id] = front

    def mute(self) -> None:
        """Send nothing more (from any thread): the node's controller restarted, the node
        ends its requests, and the replicas admit them again with what they streamed."""
        self.muted = True
        self.fronts.clear()

    def send(self, tokens: Iterable) -> None:
        """Send the tokens (TokenOut) of watched requests; a request that ended is
        forgotten. An unreachable replica loses its tokens (its requests' clients are gone
        with it; the controller keeps them)."""
        if self.muted:
            return
        batches: dict[FrontInbox, list] = {}
        for out in tokens:
            front = self.fronts.get(out.task_id)
            if front is None:
                continue
            if out.finish_reason is not None:
                self.fronts.pop(out.task_id, None)
            batches.setdefault(front.inbox, []).append((front.key, out))
        for inbox, items in batches.items():
            self._write(inbox, encode_tokens(items))

    def _write(self, inbox: FrontInbox, data: bytes) -> None:
        sock = self.socks.get(inbox)
        try:
            if sock is None:
                if time.monotonic() - self.failed.get(inbox, -RETRY_AFTER_S) < RETRY_AFTER_S:
                    return
                sock = socket.create_connection((inbox.host, inbox.port), timeout=CONNECT_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendall(frame(inbox.secret.encode()))
                self.socks[inbox] = sock
            sock.sendall(data)
            self.frames += 1
        except OSError:
            self.failed[inbox] = time.monotonic()
            dropped = self.socks.pop(inbox, None)
            if dropped is not None:
                dropped.close()

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    return await reader.readexactly(size)


async def serve_inbox(host: str, deliver: Callable[[list[InboxToken]], None]) -> tuple[FrontInbox, asyncio.Server]:
    """A replica's side: listen on ``host`` (its Ray node's address), any free port, and
    hand each frame's tokens to ``deliver``. A connection that does not start with the
    secret, or sends anything but token frames, is closed and what it sent is dropped."""
    secret = secrets.token_hex(16)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not hmac.compare_digest(await _read_frame(reader), secret.encode()):
                return
            while True:
                deliver(decode_tokens(await _read_frame(reader)))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError, RecursionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, host, 0)
    port = server.sockets[0].getsockname()[1]
    return FrontInbox(host, port, secret), server
