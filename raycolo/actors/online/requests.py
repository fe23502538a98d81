"""The request desk: admission (the HTTP front's ``admit``), ``submit``, and every request's
events to its stream or its HTTP replica's channel (``front_events``); results and
progress; a bounded memory of finished requests.

A role of the online controller (``ctl.<role>``, see :mod:`.state`)."""
from __future__ import annotations

import asyncio
from typing import Optional

import ray

from raycolo.online.serving.messages import LAST_EVENTS, Admission, EventKind, Rejection, StreamEvent
from raycolo.online.serving.token_wire import FrontKey
from raycolo.generation import FinishReason, SamplingParams, stop_token_set
from raycolo.online.scheduling.cluster import resumed_task
from raycolo.online.tasks import OnlineTask, TaskKind

from raycolo.actors.online.state import LiveRequest


KEPT_FINISHED = 4096      # finished requests the controller keeps (result(), progress())
LOST_IN_RESTART = ("request {rid} was accepted before the deployment's controller restarted; "
                   "its outcome went with that controller (its stream ended then)")


class FrontQueue:
    """The events of a request an HTTP replica admitted: they go to that replica's
    channel (:meth:`RequestDesk.front_events`), tagged with the replica's key for
    the request, rather than to a queue per request (raycolo/actors/serve/front_channel.py)."""

    __slots__ = ("mux", "key")

    def __init__(self, mux: asyncio.Queue, key: int):
        self.mux, self.key = mux, key

    def put_nowait(self, event) -> None:
        self.mux.put_nowait((self.key, event))


class RequestDesk:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        self.fronts: set[str] = set()                 # HTTP replicas attached (serve/app.py)
        self.requests: dict[int, LiveRequest] = {}
        self.tasks: dict[int, OnlineTask] = {}
        self.next_id = self.ctl.first_id
        self.arrived = 0                              # tasks arrived since the controller's CPU mark
        self.rejections = 0                           # admissions refused (429)
        self.admitting = 0                            # admissions past the limit's check, not yet submitted
        self.peak_ongoing = 0                         # the most admitted requests unfinished at once
        self.muxes: dict[str, asyncio.Queue] = {}     # HTTP replica -> its requests' events (front_events)
        self.front_sent = [0, 0]                      # front_events: messages, events in them
        self.cancelled: dict[str, int] = {}           # requests ended early, by reason: stop, abort (client gone)

    def register_task(self, task: OnlineTask) -> None:
        """A task (inference or training) arrived: it is known by its id, and counted."""
        self.tasks[task.task_id] = task
        self.arrived += 1

    def forget_tasks(self) -> None:
        """A new policy: the tasks known so far are not its (nothing is in flight)."""
        self.tasks = {}

    def count_arrivals(self) -> None:
        """Count arrivals from now (the controller's CPU per task: Reports.stats)."""
        self.arrived = 0

    async def attach(self, front: str) -> None:
        """An HTTP replica uses this deployment."""
        self.fronts.add(front)

    async def detach(self, front: str, grace_s: float = 30.0) -> None:
        """An HTTP replica shut down; with none attached after ``grace_s`` (a replica that is
        only being replaced attaches again), the deployment stops and this actor exits."""
        self.fronts.discard(front)
        await asyncio.sleep(grace_s)
        if front not in self.fronts and front in self.muxes:
            self.muxes.pop(front).put_nowait(None)      # ends its front_events call
        if not self.fronts:
            await self.ctl.stop()
            ray.actor.exit_actor()

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _params(self, max_tokens: Optional[int], temperature: float, top_p: float, seed: int,
                ignore_eos: bool, params: Optional[SamplingParams]) -> SamplingParams:
        """The request's SamplingParams: ``params`` as given (its max_tokens defaulting to
        the deployment's), or built from the older positional arguments."""
        if params is None:
            params = SamplingParams(max_tokens=max_tokens or self.ctl.config.max_tokens, temperature=temperature,
                                    top_p=top_p, seed=seed, ignore_eos=ignore_eos)
        elif "max_tokens" not in params.model_fields_set:
            params = params.model_copy(update={"max_tokens": self.ctl.config.max_tokens})
        return params

    async def submit(self, prompt: list, max_tokens: Optional[int] = None, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, base: bool = False,
                     version: Optional[int] = None, params: Optional[SamplingParams] = None,
                     front: Optional[FrontKey] = None, streamed: Optional[list] = None,
                     stop_ids: Optional[frozenset] = None) -> int:
        """Accept a completion request; returns its id (stream it with :meth:`stream`).
        ``params``: its SamplingParams (else built from max_tokens ... ignore_eos);
        ``base``: serve it with the base model (the adapter switched off for its rows);
        ``version``: with that saved adapter version (one of :meth:`adapter_versions`);
        ``front``: (HTTP replica, its key for the request): the events go to that
        replica's :meth:`front_events` instead; ``streamed``: the tokens it already
        streamed (a request the replica admits again after the controller restarted): it
        continues after them, as a request resumed on another node does; ``stop_ids``: the
        token ids that end it (the HTTP replica's tokenizer gives them; else this
        controller's, which it loads at its first need)."""
        await self.ctl.workers.start()
        if version is not None and not self.ctl.adapters.servable(version):
            raise ValueError(f"adapter version {version} is not servable; these are: {self.ctl.adapters.versions}")
        params = self._params(max_tokens, temperature, top_p, seed, ignore_eos, params)
        pool = self.ctl.config.stage.kv_cache_tokens
        if len(prompt) + params.max_tokens > pool:    # (the HTTP front refuses it first, with a 400)
            raise ValueError(f"max_tokens: {len(prompt)} prompt tokens + {params.max_tokens} to generate exceed "
                             f"a stage's KV cache of {pool} tokens (stage.kv_cache_tokens)")
        stops = frozenset(stop_ids) if stop_ids is not None else stop_token_set(params, await self.ctl.eos_token_ids())
        tid = self.new_id()
        task = OnlineTask(tid, TaskKind.INFERENCE, self.ctl.driver.now(), len(prompt), 1, 0, params.max_tokens)
        streamed = [int(t) for t in streamed or ()]
        if len(streamed) >= params.max_tokens:
            raise ValueError(f"streamed: {len(streamed)} tokens already reach max_tokens {params.max_tokens}")
        task = resumed_task(task, len(streamed))
        self._forget_finished()
        req = LiveRequest(task, list(prompt), params, seed=params.seed if params.seed is not None else seed,
                          stop_ids=stops,
                          submitted_s=self.ctl.driver.now(), base=base, version=version, generated=streamed)
        if front is not None:
            req.events = FrontQueue(self._mux(front.replica), front.key)
            if self.ctl.links.node_loops and front.inbox is not None:
                req.front = front       # its node sends its tokens to the replica itself
        self.requests[tid] = req
        self.register_task(task)
        self.ctl.driver.submit(task)
        return tid

    async def admit(self, prompt: list, max_tokens: Optional[int] = None, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, base: bool = False,
                    version: Optional[int] = None, params: Optional[SamplingParams] = None,
                    front: Optional[FrontKey] = None, streamed: Optional[list] = None,
                    stop_ids: Optional[frozenset] = None) -> Admission:
        """The HTTP front's submit: the request's id, or rejected "overloaded" beyond
        ``serve.max_ongoing_requests`` unfinished requests, "unavailable" when no node is
        alive, "unknown_version" (with the servable versions) for an adapter version that
        is not (or no longer) servable, "starting" while the stage workers (re)start. A
        rejected request was never accepted; an accepted one ends with its tokens or an
        error event, never silently."""
        if not self.ctl.ready.is_set():
            self.ctl.workers.wake()
            return Admission(rejected=Rejection.STARTING, retry_after_s=self.ctl.config.serve.retry_after_s,
                             why="the deployment is starting (or restarting after its controller failed)")
        if version is not None and not self.ctl.adapters.servable(version):
            return Admission(rejected=Rejection.UNKNOWN_VERSION, versions=tuple(self.ctl.adapters.versions))
        if len(self.ctl.workers.dead) == self.ctl.config.nodes:
            return Admission(rejected=Rejection.UNAVAILABLE, why="; ".join(self.ctl.workers.dead.values()))
        # Admissions whose submit has not yet registered the request count against the limit:
        # submit awaits (the workers' start, the EOS ids) before it does, so without them every
        # admission of a burst that came in meanwhile passed the check (7 ongoing of a limit of
        # 6 seen in a test; under load enough to fill a stage's KV pool).
        if self.unfinished() + self.admitting >= self.ctl.config.serve.max_ongoing_requests:
            self.rejections += 1
            return Admission(rejected=Rejection.OVERLOADED, retry_after_s=self.ctl.config.serve.retry_after_s)
        self.admitting += 1
        self.peak_ongoing = max(self.peak_ongoing, self.unfinished() + self.admitting)
        try:
            return Admission(id=await self.submit(prompt, max_tokens, temperature, top_p, seed, ignore_eos, base,
                                                  version, params, front, streamed, stop_ids))
        finally:
            self.admitting -= 1

    def _mux(self, front: str) -> asyncio.Queue:
        if front not in self.muxes:
            self.muxes[front] = asyncio.Queue()
        return self.muxes[front]

    @ray.method(enable_task_events=False)
    async def front_events(self, front: str):
        """The events of every request HTTP replica ``front`` admitted (``admit(...,
        front=FrontKey(front, key))``), as they come: lists of (key, event), each with every event
        ready then (with B requests decoding, one message per iteration rather than B).
        Ends when the replica detached for good."""
        mux = self._mux(front)
        while True:
            batch = [await mux.get()]
            while not mux.empty():
                batch.append(mux.get_nowait())
            if None in batch:
                return
            self.front_sent[0] += 1
            self.front_sent[1] += len(batch)
            yield batch

    def _forget_finished(self) -> None:
        """A long-running service keeps at most ``KEPT_FINISHED`` finished requests (their
        prompts, tokens and event queues; the oldest go first), so memory does not grow
        with every request served; the scheduler and metrics forget them too (the run's
        figures then cover the requests kept; Prometheus histograms hold the rest)."""
        finished = len(self.requests) - self.unfinished()
        if finished <= KEPT_FINISHED + KEPT_FINISHED // 4:
            return
        gone = [rid for rid, r in self.requests.items() if r.finish_reason is not None][:finished - KEPT_FINISHED]
        trained = [tid for tid, t in self.tasks.items() if t.is_train and tid not in self.ctl.pump.train_tasks]
        gone += trained[:max(0, len(trained) - KEPT_FINISHED)]
        for rid in gone:
            self.requests.pop(rid, None)
            self.tasks.pop(rid, None)
        self.ctl.cluster.forget(gone)

    def unfinished(self) -> int:
        return sum(1 for r in self.requests.values() if r.finish_reason is None)

    async def cancel(self, rid: int, reason: FinishReason = FinishReason.STOP) -> None:
        """End request ``rid`` at its next step (a stop string matched, or its client went
        away): no more tokens are sent, and its KV blocks are released like a finished one's."""
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None and req.cancelled is None:
            req.cancelled = reason
            self.cancelled[reason] = self.cancelled.get(reason, 0) + 1
            if self.ctl.links.node_loops:
                self.ctl.links.cancel_on_nodes(rid, reason)

    def _request(self, rid: int) -> Optional[LiveRequest]:
        """Request ``rid``, or None when it was accepted before this controller restarted
        (its outcome went with the old one; its client got an error). Unknown ids and
        finished requests forgotten long ago (only the last ``KEPT_FINISHED`` are kept)
        raise ValueError."""
        req = self.requests.get(rid)
        if req is not None:
            return req
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise ValueError(f"request id: expected an int, got {rid!r}")
        if rid < self.ctl.first_id:
            return None
        if rid < self.next_id:
            raise ValueError(f"request {rid} finished long ago and was forgotten "
                             f"(the last {KEPT_FINISHED} finished requests are kept)")
        raise ValueError(f"request {rid}: no such request")

    async def stream(self, rid: int):
        """Events of request ``rid`` as they come (:class:`~raycolo.online.serving.messages.StreamEvent`)."""
        req = self._request(rid)
        if req is None:
            yield StreamEvent(EventKind.ERROR, LOST_IN_RESTART.format(rid=rid))
            return
        self._own_queue(req, rid)
        while True:
            event = await req.events.get()
            yield event
            if event[0] in LAST_EVENTS:
                return

    async def result(self, rid: int) -> dict:
        """The whole completion: tokens (the stop token included), and finish_reason
        "stop", "length" or "error" (with ``error``, what failed)."""
        req = self._request(rid)
        if req is None:
            return {"id": rid, "tokens": [], "finish_reason": FinishReason.ERROR, "error": LOST_IN_RESTART.format(rid=rid)}
        self._own_queue(req, rid)
        tokens = []
        while True:
            kind, value = await req.events.get()
            if kind in (EventKind.TOKEN, EventKind.STOP_TOKEN):
                tokens.append(value)
            elif kind in (EventKind.LOGPROB, EventKind.PROMPT_LOGPROBS):
                continue
            elif kind == EventKind.DONE:
                return {"id": rid, "tokens": tokens, "finish_reason": value}
            else:
                return {"id": rid, "tokens": tokens, "finish_reason": FinishReason.ERROR, "error": value}

    @staticmethod
    def _own_queue(req: LiveRequest, rid: int) -> None:
        if isinstance(req.events, FrontQueue):
            raise ValueError(f"request {rid} streams to the HTTP replica that admitted it")

    async def progress(self, rid: int) -> dict:
        """Tokens request ``rid`` has streamed so far, and how it ended (None: running)."""
        req = self._request(rid)
        if req is None:
            return {"id": rid, "tokens": 0, "finish_reason": FinishReason.ERROR}
        return {"id": rid, "tokens": len(req.generated), "finish_reason": req.finish_reason}
