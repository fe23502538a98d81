"""Admission of a generation request by the deployment's controller, or, while the
controller is down, directly on a node (:mod:`raycolo.online.serving.node_inbox`), and its
admission again by a restarted controller with the tokens it streamed.
:class:`Admissions` is a base class of :class:`~raycolo.actors.serve.completions.Completions`
(the ingress sets every attribute it declares)."""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from ray.exceptions import ActorUnavailableError, RayActorError

from raycolo.actors.serve.front_channel import CONTROLLER_FAILED, FrontChannel, FrontKey
from raycolo.generation import FinishReason, stop_token_set
from raycolo.online.config import OnlineConfig
from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.messages import Admission, EventKind, Rejection, StreamEvent
from raycolo.online.serving.node_inbox import least_loaded, place
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.tasks import OnlineTask, TaskKind
from raycolo.online.serving.protocol import BASE, VERSION_SUFFIX

if TYPE_CHECKING:
    from raycolo.actors.serve.front_metrics import FrontMetrics

RESTART_POLL_S = 0.1       # how often a held admission asks a restarting controller again
ADMIT_PATIENCE_S = 0.2     # an admission not answered within this: try the nodes (if they lost their controller)
WATCH_S = 0.02             # how often an unanswered admission looks whether the controller's process ended
CONTROLLER_DIED = "the deployment's controller failed mid-request (it restarts); retry"

@dataclass
class Admitted:
    """A request this replica admitted: its id (another once admitted again after a
    controller restart), its key and events' queue on the channel, what it was admitted
    with, and the tokens it streamed so far."""

    rid: int
    front: FrontKey
    events: asyncio.Queue
    prompt: list[int]
    base: bool
    version: Union[int, str, None]
    params: Any
    stop_ids: frozenset           # the token ids that end it (its params and the checkpoint's EOS set)
    streamed: list[int] = field(default_factory=list)
    direct: bool = False          # placed on a node by the replica while the controller was down
    prompt_logprobs: Optional[list] = None     # the prompt's, where asked for (they come before its first token)


class Admissions:
    """A replica's admissions (set by the ingress's ``__init__``)."""

    config: OnlineConfig
    model_name: str
    tokenizer: Any
    controller: Any              # the OnlineController's actor handle
    nodes: list                  # the node inboxes (NodeAddress) as the controller last told them
    node_load: dict              # node -> requests in its batch, as the controller last told them
    placed: dict                 # node -> requests this replica placed there since (controller down)
    channel: FrontChannel        # this replica's requests' events
    metrics: "FrontMetrics"

    async def _admit(self, body, ids: list[int], params, variant, version) -> "Admitted":
        """Admit one request: its id, its key on this replica's channel and its events' queue
        (``version``: :meth:`_pinned_version` of ``variant``, resolved once per HTTP request)."""
        front, events = await self.channel.open()
        request = Admitted(0, front, events, ids, variant == BASE, version, params,
                           stop_token_set(params, self.tokenizer.eos_token_ids))
        try:
            admitted = await self._admission(request, direct=True)
        except BaseException:
            self.channel.close(front)
            raise
        if admitted.rejected:
            self.channel.close(front)
        if admitted.rejected == Rejection.OVERLOADED:
            self.metrics.rejected.inc()
            retry = admitted.retry_after_s
            raise OpenAIError(429, f"the server is at its limit of {self.config.serve.max_ongoing_requests} "
                              f"ongoing requests; retry after {retry} s", code="overloaded",
                              headers={"Retry-After": str(retry)})
        if admitted.rejected == Rejection.UNKNOWN_VERSION:
            held = ", ".join(f"'{self.model_name}{VERSION_SUFFIX}{k}'" for k in admitted.versions) or "none yet"
            raise OpenAIError(404, f"model '{body.model}': adapter version {version} is not servable (only the "
                              f"newest {self.config.serve.pinned_versions} saved versions are); servable: {held}",
                              param="model", code="model_not_found")
        if admitted.rejected == Rejection.STARTING:
            raise OpenAIError(503, admitted.why, code="unavailable",
                              headers={"Retry-After": str(admitted.retry_after_s)})
        if admitted.rejected:
            raise OpenAIError(503, f"no stage-worker node is alive: {admitted.why}", code="unavailable")
        self.metrics.prompt_tokens.inc(len(ids))
        request.rid = admitted.id
        if request.direct:        # to be admitted by the restarted controller once it is ready
            events.put_nowait(CONTROLLER_FAILED)
        return request

    async def _admission(self, request: "Admitted", direct: bool = False) -> Admission:
        """The controller's admission of ``request`` (with the tokens it already streamed,
        if any). While the controller restarts, for up to ``serve.restart_wait_s``: a call
        that finds it dead, or a restarted one still starting (its stage workers register
        again), is made again. With ``direct`` (a new request), when the controller has
        not answered within ``ADMIT_PATIENCE_S`` or is known down, the replica meanwhile
        places the request on a node itself (:meth:`_place_directly`; the nodes take it
        only once they lost their controller)."""
        deadline = time.monotonic() + self.config.serve.restart_wait_s
        while True:
            if direct and self.channel.down and await self._place_directly(request):
                return Admission(id=request.rid)
            if await self.channel.back(RESTART_POLL_S):     # not a call Ray holds until it is back
                call = asyncio.ensure_future(self.controller.admit.remote(
                    request.prompt, base=request.base, version=request.version, params=request.params,
                    front=request.front, streamed=list(request.streamed) or None,
                    stop_ids=request.stop_ids))
                asked, tried = time.monotonic(), 0.0
                while not (await asyncio.wait({call}, timeout=WATCH_S if direct else None))[0]:
                    now = time.monotonic()      # the controller's process ended (its beacon), or it is slow
                    if (self.channel.down or now - asked >= ADMIT_PATIENCE_S) and now - tried >= RESTART_POLL_S:
                        if await self._place_directly(request):
                            call.add_done_callback(self._cancel_admitted)   # placed already: not twice
                            return Admission(id=request.rid)
                        tried = time.monotonic()
                try:
                    admitted = call.result()
                    if admitted.rejected != Rejection.STARTING or time.monotonic() >= deadline:
                        self.channel.resume()       # its events come from this controller (a new one)
                        return admitted
                    if direct and await self._place_directly(request):    # its nodes register again
                        return Admission(id=request.rid)
                except (RayActorError, ActorUnavailableError):
                    self.channel.controller_down()
                await asyncio.sleep(RESTART_POLL_S)
            if time.monotonic() >= deadline:
                return Admission(rejected=Rejection.STARTING, retry_after_s=self.config.serve.retry_after_s,
                                 why="the deployment's controller failed and is restarting")

    def _cancel_admitted(self, call: asyncio.Future) -> None:
        """An admission answered after the replica placed the request on a node itself:
        the controller's copy is cancelled."""
        try:
            admitted = call.result()
        except Exception:
            return
        if admitted.id is not None:
            self.controller.cancel.remote(admitted.id, FinishReason.ABORT)

    async def _place_directly(self, request: "Admitted") -> bool:
        """Place a new request on a node while the controller is down: the least-loaded node
        (:func:`~raycolo.online.serving.node_inbox.least_loaded`: the controller's last
        figures plus what this replica placed since) that takes it. Its tokens come to this
        replica's inbox; it gets a negative id, which no controller issues, and once the
        restarted controller is ready it is admitted there with the tokens it streamed
        (:meth:`_readmit`). Only a request of the latest adapter or the base whose tokens
        come straight from the nodes."""
        if not self.nodes or request.front.inbox is None or request.version is not None:
            return False
        rid = -1 - secrets.randbits(62)
        served = ServedRequest(OnlineTask(rid, TaskKind.INFERENCE, 0.0, len(request.prompt), 1, 0,
                                          request.params.max_tokens),
                               list(request.prompt), request.params, seed=request.params.seed if request.params.seed is not None else 0,
                               stop_ids=request.stop_ids,
                               base=request.base, front=request.front)
        load = self.node_load or {a.node: 0 for a in self.nodes}
        by_node = {a.node: a for a in self.nodes}
        tried: set[int] = set(load) - set(by_node)
        while (n := least_loaded(load, self.placed, tried)) is not None:
            tried.add(n)
            if await place(by_node[n], served):
                self.placed[n] = self.placed.get(n, 0) + 1
                request.rid, request.direct = rid, True
                self.metrics.placed_directly.inc()
                return True
        return False

    async def _readmit(self, request: "Admitted") -> None:
        """The controller died while ``request`` streamed: admit it again to the restarted
        controller with the tokens it streamed, so its node continues from there (each
        token keeps its position: one streamed already is dropped). Its node went on
        streaming while the controller was down, and is done with it by the time the new
        controller admits (it admits once every node registered again). Past
        ``serve.restart_wait_s`` the request ends with an error event. A request the
        controller answering now runs (it admitted it: the failure reached the request's
        queue before its admission) is left as it is. One that streamed nothing yet (the
        dead controller may have held it, not sent it to a node) is offered to a node at
        once while the controller is down; if a node had it already, both copies stream
        the same tokens, and each position is taken once."""
        try:
            deadline = time.monotonic() + self.config.serve.restart_wait_s
            while not request.streamed and not request.direct and self.channel.down \
                    and time.monotonic() < deadline:        # the nodes take it once they know
                if await self._place_directly(request):
                    return     # it streamed nothing: a node runs it now, rather than after the restart
                await self.channel.back(RESTART_POLL_S)
            if await self._running(request.rid):
                return
            admitted = await self._admission(request)
        except Exception:     # the controller did not come back in time, or refused the request
            admitted = None
        if admitted is None or admitted.rejected:
            why = CONTROLLER_DIED if admitted is None else f"{CONTROLLER_DIED}: {admitted.why or admitted.rejected}"
            request.events.put_nowait(StreamEvent(EventKind.ERROR, why))
            return
        request.rid = admitted.id
        self.metrics.readmitted.inc()

    async def _running(self, rid: int) -> bool:
        """Whether the controller runs request ``rid`` (waits, within ``serve.restart_wait_s``,
        for it to answer: a restarted controller answers that a request of the one before
        ended with an error)."""
        deadline = time.monotonic() + self.config.serve.restart_wait_s
        while True:
            try:
                return (await self.controller.progress.remote(rid))["finish_reason"] is None
            except (RayActorError, ActorUnavailableError):
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(RESTART_POLL_S)
