"""Training samples posted to one HTTP replica (POST /v1/train_samples).

The deployment's controller stores them (fsynced) and acknowledges them. While it is down
(a call to it failed: Ray restarts it), the replica stores them itself in the same sample
store, which several processes may append to (:mod:`raycolo.online.samples`), and
acknowledges them as before; once the controller answers again, the replica hands it
each such batch under its *post key*, which the store finds stored already: nothing is
stored twice, and the controller trains them as it trains every posted sample. A call
that failed after the controller stored its batch is the same case (the key again).

The replica writes the store only when it can reach the directory (the controller's
node, or storage every host shares, as ``sample_store`` asks of a cluster of several
hosts); otherwise the post gets a 503 with ``Retry-After``.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional

from ray.exceptions import ActorUnavailableError, RayActorError

from raycolo.actors.serve.front_channel import FrontChannel
from raycolo.errors import ConfigError
from raycolo.online.config import OnlineConfig
from raycolo.online.samples import SampleStore
from raycolo.online.serving.openai_errors import OpenAIError

RETELL_POLL_S = 0.2      # how often a batch stored here is offered to a controller still down


class SampleIntake:
    def __init__(self, controller, channel: FrontChannel, config: OnlineConfig, stored_here):
        """``stored_here``: the counter of samples this replica stored itself."""
        self.controller, self.channel, self.config = controller, channel, config
        self.store: Optional[SampleStore] = None      # opened when the controller is first found down
        self.owed: set[asyncio.Task] = set()          # batches stored here, not yet told to a controller
        self.stored_here = stored_here

    async def add(self, pairs: list) -> dict:
        """Store ``pairs`` (validated token ids) and return ``{"ids", "stored"}``; StoreFull
        when the store's disk refused them (nothing was stored)."""
        post = uuid.uuid4().hex
        if not self.channel.down:
            try:
                return await self.controller.add_samples.remote(pairs, True, post)
            except (RayActorError, ActorUnavailableError):
                self.channel.controller_down()
        out = await asyncio.to_thread(self._store_here, pairs, post)
        self.stored_here.inc(len(out["ids"]))
        task = asyncio.get_running_loop().create_task(self._tell(pairs, post))
        self.owed.add(task)
        task.add_done_callback(self.owed.discard)
        return out

    def _store_here(self, pairs: list, post: str) -> dict:
        try:
            if self.store is None:
                self.store = SampleStore(self.config.sample_store)
        except ConfigError as exc:
            raise OpenAIError(503, f"the deployment's controller is restarting and this replica cannot "
                              f"store samples itself ({exc}); retry", code="unavailable",
                              headers={"Retry-After": str(self.config.serve.retry_after_s)}) from None
        ids = self.store.append(pairs, post=post)
        return {"ids": ids, "stored": len(self.store)}

    async def _tell(self, pairs: list, post: str) -> None:
        """Hand a batch stored here to the controller once it answers (within
        ``serve.restart_wait_s``; past it, a restarted controller still trains the batch,
        as every stored sample no checkpoint holds)."""
        deadline = time.monotonic() + self.config.serve.restart_wait_s
        while time.monotonic() < deadline:
            if await self.channel.back(RETELL_POLL_S):
                try:
                    await self.controller.add_samples.remote(pairs, True, post)
                    return
                except (RayActorError, ActorUnavailableError):
                    self.channel.controller_down()
            await asyncio.sleep(RETELL_POLL_S)
