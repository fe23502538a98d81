"""The token channel from the deployment's controller to one HTTP replica.

Every request a replica admits sends its events (tokens, log-probabilities, its end)
through one long-lived Ray streaming call per replica,
:meth:`~raycolo.actors.online_controller.OnlineController.front_events`, each message
holding every event that was ready: with B requests decoding, one message per decode
iteration rather than B (one streaming call per request, one message per token, as
before). The replica hands each event to the request it belongs to.

A request is keyed by the replica before it is admitted (:meth:`FrontChannel.open`), so
an event that overtakes the admission's reply still finds its request. If the
controller dies, every open request gets :data:`CONTROLLER_FAILED` (its outcome went with
the controller) and the channel opens again on the next request.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Optional

from ray.exceptions import ActorUnavailableError, RayActorError

CONTROLLER_FAILED = ("controller_failed", None)


@dataclass(frozen=True)
class FrontKey:
    """Which HTTP replica admitted a request, and its key for it there (``admit(front=)``)."""

    replica: str
    key: int


class FrontChannel:
    def __init__(self, controller, front_id: str):
        self.controller, self.front_id = controller, front_id
        self.waiting: dict[int, asyncio.Queue] = {}     # key -> the request's events
        self.keys = itertools.count()
        self.pump: Optional[asyncio.Task] = None

    def open(self) -> tuple[FrontKey, asyncio.Queue]:
        """For a request about to be admitted: the ``front`` to admit it with, and the
        queue its events will come to. :meth:`close` it when the request is done."""
        if self.pump is None or self.pump.done():
            self.pump = asyncio.get_running_loop().create_task(self._pump())
        key = next(self.keys)
        queue = self.waiting[key] = asyncio.Queue()
        return FrontKey(self.front_id, key), queue

    def close(self, front: FrontKey) -> None:
        """The request is done (or was never admitted): its later events are dropped."""
        self.waiting.pop(front.key, None)

    async def _pump(self) -> None:
        """Hand out the controller's batches of events until the controller fails."""
        try:
            gen = self.controller.front_events.options(num_returns="streaming").remote(self.front_id)
            async for ref in gen:
                for key, event in await ref:
                    queue = self.waiting.get(key)
                    if queue is not None:
                        queue.put_nowait(event)
        except (RayActorError, ActorUnavailableError):
            pass
        for queue in self.waiting.values():     # their outcome went with the controller
            queue.put_nowait(CONTROLLER_FAILED)
