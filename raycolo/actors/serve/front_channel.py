"""The token channel from the deployment's controller to one HTTP replica.

Every request a replica admits sends its events (tokens, log-probabilities, its end)
through one long-lived Ray streaming call per replica,
:meth:`~raycolo.actors.online.controller.OnlineController.front_events`, each message
holding every event that was ready: with B requests decoding, one message per decode
iteration rather than B (one streaming call per request, one message per token, as
before). The replica hands each event to the request it belongs to.

A request is keyed by the replica before it is admitted (:meth:`FrontChannel.open`), so
an event that overtakes the admission's reply still finds its request. If the
controller dies, every open request gets :data:`CONTROLLER_FAILED` (what the controller
knew of it went with it: the replica admits one whose tokens come straight from its node
again, raycolo/actors/serve/completions.py) and the channel opens again on the next
admission.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Optional

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from raycolo.online.serving.beacon import BeaconAddress, watch
from raycolo.online.serving.messages import EventKind, StreamEvent
from raycolo.online.serving.token_wire import FrontInbox, FrontKey, InboxToken, Positions, serve_inbox, token_events

__all__ = ["CONTROLLER_FAILED", "FrontChannel", "FrontKey"]

CONTROLLER_FAILED = StreamEvent(EventKind.CONTROLLER_FAILED, None)
PROBE_EVERY_S = 0.05        # how often a replica asks a failed controller whether it is back


class FrontChannel:
    def __init__(self, controller, front_id: str, direct: bool = True):
        self.controller, self.front_id = controller, front_id
        self.waiting: dict[int, asyncio.Queue] = {}     # key -> the request's events
        self.positions = Positions()                    # tokens each request got from the inbox
        self.keys = itertools.count()
        self.pump: Optional[asyncio.Task] = None
        self.direct = direct
        self.inbox: Optional[FrontInbox] = None
        self.server: Optional[asyncio.Server] = None
        self.opening = asyncio.Lock()
        self.down = False              # the controller failed and has not answered since
        self.probe: Optional[asyncio.Task] = None
        self.watched: Optional[BeaconAddress] = None    # the controller's beacon this replica watches

    def controller_down(self) -> None:
        """A call found the controller dead: until it answers again (:meth:`back`), the
        replica places new requests on the nodes itself rather than wait on a call that
        Ray holds until the controller is back."""
        self.down = True

    def _gone(self, address: BeaconAddress) -> None:
        if address == self.watched:
            self.controller_down()

    async def back(self, wait_s: float) -> bool:
        """Whether the controller answers (again), waiting up to ``wait_s`` for it."""
        if self.down and self.probe is None:
            self.probe = asyncio.get_running_loop().create_task(self._probe())
        if self.down:
            await asyncio.wait({self.probe}, timeout=wait_s)
        return not self.down

    async def _probe(self) -> None:
        while True:
            try:
                await self.controller.incarnation.remote()
                break
            except (RayActorError, ActorUnavailableError):
                await asyncio.sleep(PROBE_EVERY_S)
        self.down, self.probe = False, None

    def resume(self) -> None:
        """Take the controller's events again (after it failed, from the restarted one)."""
        if self.pump is None or self.pump.done():
            self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def open(self) -> tuple[FrontKey, asyncio.Queue]:
        """For a request about to be admitted: the ``front`` to admit it with, and the
        queue its events will come to. :meth:`close` it when the request is done."""
        self.resume()
        async with self.opening:      # the first requests, at once: one inbox
            if self.direct and self.server is None:
                self.inbox, self.server = await serve_inbox(ray.util.get_node_ip_address(), self._take)
        key = next(self.keys)
        queue = self.waiting[key] = asyncio.Queue()
        return FrontKey(self.front_id, key, self.inbox), queue

    def close(self, front: FrontKey) -> None:
        """The request is done (or was never admitted): its later events are dropped."""
        self.waiting.pop(front.key, None)
        self.positions.forget(front.key)

    def _take(self, tokens: list[InboxToken]) -> None:
        """Tokens from a node's :class:`~raycolo.online.serving.token_wire.TokenSender`; a token
        the request already streamed (it resumed on another node) is dropped."""
        for t in tokens:
            queue = self.waiting.get(t.key)
            if queue is None or not self.positions.admit(t):
                continue
            for event in token_events(t.token, t.kept, t.finish_reason, t.logprob, t.prompt_logprobs):
                queue.put_nowait(event)

    async def _pump(self) -> None:
        """Hand out the controller's batches of events until the controller fails."""
        try:
            await self.controller.attach.remote(self.front_id)   # again, to a restarted controller
            address = await self.controller.beacon.remote()
        except (RayActorError, ActorUnavailableError):
            return     # not back yet: the next admission tries again (those waiting were told)
        if address != self.watched:      # its process's end, at once (Ray says so later)
            self.watched, loop = address, asyncio.get_running_loop()
            watch(address, lambda: loop.call_soon_threadsafe(self._gone, address), name="controller-beacon")
        try:
            gen = self.controller.front_events.options(num_returns="streaming").remote(self.front_id)
            async for ref in gen:
                for key, event in await ref:
                    queue = self.waiting.get(key)
                    if queue is not None:
                        queue.put_nowait(event)
        except (RayActorError, ActorUnavailableError):
            self.down = True
        for queue in self.waiting.values():     # their outcome went with the controller
            queue.put_nowait(CONTROLLER_FAILED)
