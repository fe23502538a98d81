"""What crosses between the HTTP replicas (or any client) and the online controller,
typed: the answer to an admission, and the events of a request's stream.

* :class:`Admission`: the controller's answer to ``admit``: the request's id, or why it
  was not accepted (nothing of a rejected request was kept).
* :class:`AdapterRefusal`: why an adapter was not loaded or unloaded.
* :class:`StreamEvent`: one event of a request's stream. ``("logprob", TokenLogprob)``
  before a token where log-probabilities were asked for; ``("token", id)`` for each token
  of the text; ``("stop_token", id)`` for the stop token that ended it (counted, never
  text); then ``("done", finish_reason)``, or ``("error", why)``. A named tuple: it is sent
  once per token, and costs what the pair costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from raycolo.text_enum import TextEnum


class EventKind(TextEnum):
    """The kind of a :class:`StreamEvent` (a ``str`` enum: equal to its value)."""

    LOGPROB = "logprob"          # TokenLogprob of the token that follows
    PROMPT_LOGPROBS = "prompt_logprobs"   # the prompt's TokenLogprob list (the first None), before its first token
    TOKEN = "token"              # a token of the text
    STOP_TOKEN = "stop_token"    # the stop token that ended the request (counted, never text)
    DONE = "done"                # the end: its finish reason
    ERROR = "error"              # the end: what failed
    CONTROLLER_FAILED = "controller_failed"   # the replica's channel lost the controller


TOKEN_EVENTS = (EventKind.LOGPROB, EventKind.TOKEN, EventKind.STOP_TOKEN)   # a token's; then DONE
LAST_EVENTS = (EventKind.DONE, EventKind.ERROR)                            # a stream ends with one


class StreamEvent(NamedTuple):
    kind: EventKind
    value: Any


class Rejection(TextEnum):
    """Why the controller did not admit a request (the front's answer: 503, 404, 503, 429)."""

    STARTING = "starting"                  # the stage workers (re)start
    UNKNOWN_VERSION = "unknown_version"    # the pinned adapter version is not servable
    UNAVAILABLE = "unavailable"            # no stage-worker node is alive
    OVERLOADED = "overloaded"              # serve.max_ongoing_requests unfinished requests


@dataclass(frozen=True, slots=True)
class AdapterRefusal:
    """Why loading or unloading an adapter (vLLM's LoRA routes) did nothing: the HTTP status
    and the OpenAI error's message, param and code."""

    status: int
    message: str
    param: str
    code: str


@dataclass(frozen=True, slots=True)
class Admission:
    """``id`` of the accepted request, or ``rejected`` with what the client needs:
    ``retry_after_s`` (starting, overloaded), ``why`` (starting, unavailable) and the
    servable ``versions`` (unknown_version)."""

    id: Optional[int] = None
    rejected: Optional[Rejection] = None
    retry_after_s: Optional[int] = None
    why: str = ""
    versions: tuple[int, ...] = ()
