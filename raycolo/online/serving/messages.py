"""What crosses between the HTTP replicas (or any client) and the online controller,
typed: the answer to an admission, and the events of a request's stream.

* :class:`Admission`: the controller's answer to ``admit``: the request's id, or why it
  was not accepted (nothing of a rejected request was kept).
* :class:`StreamEvent`: one event of a request's stream. ``("logprob", TokenLogprob)``
  before a token where log-probabilities were asked for; ``("token", id)`` for each token
  of the text; ``("stop_token", id)`` for the stop token that ended it (counted, never
  text); then ``("done", finish_reason)``, or ``("error", why)``. A named tuple: it is sent
  once per token, and costs what the pair costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Optional

EventKind = Literal["logprob", "token", "stop_token", "done", "error"]
TOKEN_EVENTS = ("logprob", "token", "stop_token")     # a token's events; then ("done", reason)
LAST_EVENTS = ("done", "error")                       # a stream ends with one of these


class StreamEvent(NamedTuple):
    kind: EventKind
    value: Any


Rejection = Literal["starting", "unknown_version", "unavailable", "overloaded"]


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
