"""What the ingress's generation routes (/v1/completions, /v1/chat/completions) share,
outside the ingress class: the requested model variant, the sampling parameters and
their checks, admission by the controller, the request's token events turned into text
deltas (and metrics), and the server-sent events of a streamed response.
:class:`Completions` is a base class of :class:`~raycolo.actors.serve.app.OpenAIIngress`,
which sets every attribute it declares."""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import ActorUnavailableError, RayActorError

from raycolo.actors.serve.front_channel import CONTROLLER_FAILED, FrontChannel, FrontKey
from raycolo.generation import FinishReason, stop_token_set
from raycolo.online.config import OnlineConfig
from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.messages import TOKEN_EVENTS, Admission, EventKind, Rejection, StreamEvent
from raycolo.online.serving.node_inbox import least_loaded, place
from raycolo.online.serving.token_wire import NodeAddress
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.tasks import OnlineTask, TaskKind
from raycolo.online.serving.protocol import BASE, BASE_SUFFIX, LATEST, VERSION_SUFFIX, model_variant
from raycolo.online.serving.responses import ChoiceEvent, TokenFields, choice, usage
from raycolo.online.serving.sse_stream import sse_answer
from raycolo.online.serving.answer_reading import AnswerReading, constraint_after
from raycolo.generation.detokenize import text_stream

if TYPE_CHECKING:
    from raycolo.actors.serve.front_metrics import DeploymentMetrics, FrontMetrics

MONITOR_EVERY_S = 2.0
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


class AdapterName:
    """A request's ``model`` that names none of the served model's variants: perhaps an
    adapter loaded with POST /v1/load_lora_adapter (never equal to LATEST or BASE, whatever
    its name)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Completions:
    """The generation machinery of an ingress replica (set by its ``__init__``)."""

    config: OnlineConfig
    model_name: str
    tokenizer: Any
    context: int                 # the model's context (max_position_embeddings)
    controller: Any              # the OnlineController's actor handle
    nodes: list                  # the node inboxes (NodeAddress) as the controller last told them
    node_load: dict              # node -> requests in its batch, as the controller last told them
    placed: dict                 # node -> requests this replica placed there since (controller down)
    channel: FrontChannel        # this replica's requests' events
    metrics: FrontMetrics
    gauges: DeploymentMetrics
    monitor: Optional[asyncio.Task]
    grammar: Any = None          # structured outputs' grammars for this vocabulary (GrammarMasks), at the first need

    async def _monitor(self) -> None:
        while True:
            try:
                figures = await self.controller.monitor.remote()
                self.gauges.update(self.model_name, figures)
                self.nodes = [NodeAddress(**a) for a in figures["node_inboxes"]]
                self.node_load, self.placed = {int(n): v for n, v in figures["node_load"].items()}, {}
            except Exception:    # the controller restarts or stops: try again
                pass
            await asyncio.sleep(MONITOR_EVERY_S)

    def _ensure_monitor(self) -> None:
        if self.monitor is None:
            self.monitor = asyncio.get_running_loop().create_task(self._monitor())

    def _check_model(self, name: str) -> Union[str, int, "AdapterName"]:
        """The variant ``name`` asks for (model_variant), or an :class:`AdapterName` for any
        other name: a loaded adapter's, or nothing this server serves (the controller's
        registry says which when it is pinned: :meth:`_pinned_version`). Whether a version
        is still servable is the controller's answer too (admit)."""
        variant = model_variant(name, self.model_name)
        return AdapterName(name) if variant is None else variant

    async def _pinned_version(self, variant) -> Union[int, str, None]:
        """``version`` of the controller's admit: k of ``<model>@v<k>``, the handle of a
        loaded adapter, or None (the latest adapter, or the base). 404 for a name that is
        neither the served model's nor a loaded adapter's."""
        if isinstance(variant, int):
            return variant
        if not isinstance(variant, AdapterName):
            return None
        handle = await self.controller.resolve_adapter.remote(variant.name)
        if handle is None:
            raise OpenAIError(404, f"model '{variant.name}' does not exist; this server serves "
                              f"'{self.model_name}', '{self.model_name}{BASE_SUFFIX}', "
                              f"'{self.model_name}{VERSION_SUFFIX}<k>' for saved adapter versions and the "
                              "adapters loaded with POST /v1/load_lora_adapter (GET /v1/models)",
                              param="model", code="model_not_found")
        return handle

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output a request may have: the model's context, or the
        stage's KV cache where that is shorter (vLLM's ``max_model_len``)."""
        return min(self.context, self.config.stage.kv_cache_tokens)

    def _sampling(self, body, ids: list[int], max_tokens: Optional[int], prompt_param: str, chat: bool,
                  which: str = "the prompt"):
        """The request's SamplingParams, its limit checked against the context (``which``:
        the prompt's name in errors, a batch's ``prompt i``)."""
        limit = max_tokens if max_tokens is not None else self.config.max_tokens
        context = self.max_model_len
        if len(ids) >= context:
            raise OpenAIError(400, f"{prompt_param}: {which} has {len(ids)} tokens; this model's "
                              f"context is {context} tokens", param=prompt_param, code="context_length_exceeded")
        param = "max_tokens" if not chat or body.max_completion_tokens is None else "max_completion_tokens"
        if len(ids) + limit > context:
            raise OpenAIError(400, f"{param}: {len(ids)} prompt tokens + {limit} completion tokens exceed "
                              f"this model's context of {context} tokens", param=param,
                              code="context_length_exceeded")
        if body.min_tokens > limit:
            raise OpenAIError(400, f"min_tokens: {body.min_tokens} is more than the {limit} tokens allowed",
                              param="min_tokens", code="invalid_parameter")
        for param, ids in (("logit_bias", body.bias_ids()), ("allowed_token_ids", body.allowed_token_ids),
                           ("stop_token_ids", body.stop_token_ids)):
            if ids and max(ids) >= self.vocab:
                raise OpenAIError(400, f"{param}: token ids must be below the vocabulary size {self.vocab}",
                                  param=param, code="invalid_parameter")
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        return body.sampling_params(limit, seed)

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

    async def _generate(self, body, prompts: list[list[int]], max_tokens: Optional[int], prompt_param: str,
                        chat: bool, variant: Union[str, int] = LATEST, reading: Optional[AnswerReading] = None):
        """``prompts``: the request's prompts' ids (a chat's one, or a completions batch);
        ``reading``: how a chat's choices are read for reasoning and tool calls (None: they
        are not)."""
        self._ensure_monitor()
        params = []
        for i, ids in enumerate(prompts):
            one = self._sampling(body, ids, max_tokens, prompt_param, chat, f"prompt {i}" if len(prompts) > 1
                                 else "the prompt")
            one = reading.sampling(one) if reading is not None else one
            if one.structured_outputs is not None:       # a reasoning deployment's binds after the reasoning
                after = constraint_after(self.config.serve.reasoning_parser, body, self.tokenizer, ids)
                one = one.model_copy(update={"structured_after_token": after}) if after is not None else one
            params.append(one)
        if params[0].structured_outputs is not None:       # the same constraint for every prompt
            forced = reading is not None and reading.tools is not None and reading.tools.kind.forces_a_call
            await self._check_grammar(params[0].structured_outputs, "tool_choice" if forced else "structured_outputs")
        started = time.perf_counter()
        kind = "chat.completion" if chat else "text_completion"
        # n choices per prompt: n requests, choice j drawn with seed + j (all admitted before any is
        # awaited); prompt p's choice j is choice p * n + j, as vLLM numbers a batch's choices
        admitted, choice_prompts = [], []
        version = await self._pinned_version(variant)
        try:
            for ids, first in zip(prompts, params):
                for j in range(body.n):
                    choice_params = first if j == 0 else first.model_copy(update={"seed": first.seed + j})
                    admitted.append(await self._admit(body, ids, choice_params, variant, version))
                    choice_prompts.append(ids)
        except BaseException:     # choice k refused (429...) or the client gone: the others must not run on
            for a in admitted:
                self.channel.close(a.front)
                self.controller.cancel.remote(a.rid, FinishReason.ABORT)
            raise
        out_id = f"{'chatcmpl' if chat else 'cmpl'}-{admitted[0].rid}-{uuid.uuid4().hex[:8]}"
        as_ids = bool(body.return_tokens_as_token_ids)
        tokens = [TokenFields(list(ids) if body.return_token_ids else None, as_ids) for ids in choice_prompts]
        prompt_tokens = sum(len(ids) for ids in prompts)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = [self._events(a, a.params, started, ids) for a, ids in zip(admitted, choice_prompts)]
            return StreamingResponse(sse_answer(events, self.tokenizer, out_id, chat, body.model, prompt_tokens,
                                                include_usage, self.config.serve.stream_interval, tokens, reading),
                                     media_type="text/event-stream")
        results = await asyncio.gather(*[self._collect(a, a.params, started, ids)
                                         for a, ids in zip(admitted, choice_prompts)])
        choices = [choice(self.tokenizer, chat, i, r, tokens[i], reading) for i, r in enumerate(results)]
        answer = {"id": out_id, "object": kind, "created": int(time.time()), "model": body.model,
                  "choices": choices, "usage": usage(prompt_tokens, sum(r.count for r in results))}
        if chat and body.return_token_ids:
            answer["prompt_token_ids"] = list(prompts[0])
        return JSONResponse(answer)

    async def _check_grammar(self, constraint, param: str) -> None:
        """A 400 naming ``param`` for a constraint whose grammar is too big for a stage to
        compile in its step (compiled here, off the event loop, once per constraint)."""
        from raycolo.generation.grammar_masks import GrammarMasks

        if self.grammar is None:
            self.grammar = await asyncio.to_thread(GrammarMasks, self.tokenizer, self.vocab)
        try:
            await asyncio.to_thread(self.grammar.check_size, constraint)
        except ValueError as exc:
            raise OpenAIError(400, f"{param}: {exc}", param=param, code="invalid_parameter") from None

    async def _collect(self, admitted: "Admitted", params, started: float, prompt_ids: list[int]) -> ChoiceEvent:
        """A whole (non-streamed) choice: its events joined (log-probabilities None where
        not asked for)."""
        text, reason, count, logprobs, ids, stop_reason = [], None, 0, None if params.logprobs is None else [], [], None
        async for ev in self._events(admitted, params, started, prompt_ids):
            text.append(ev.delta)
            count = ev.count
            if ev.finish == FinishReason.ERROR:
                raise OpenAIError(503, f"generation failed: {ev.delta}", code="generation_failed")
            reason, stop_reason = ev.finish or reason, ev.stop_reason if ev.finish else stop_reason
            ids.extend(ev.ids)
            if logprobs is not None:
                logprobs.extend(ev.lps)
        return ChoiceEvent("".join(text), reason, count, logprobs, tuple(ids), stop_reason)

    async def _events(self, admitted: "Admitted", params, started: float, prompt_ids: list[int]):
        """:class:`ChoiceEvent` (text delta, finish_reason or None, tokens so far, the
        log-probabilities and ids of the tokens since the last event, the stop reason) as
        tokens arrive (``admitted``: what :meth:`_admit` returned;
        the events come over this replica's channel); an "error" finish carries the
        error's text. Text follows raycolo.generation: a stop token is counted, never
        shown; a stop string ends the text before it (the request is cancelled upstream),
        as does a client that went away. Tokens that arrived together (the replica fell
        behind) go out as one delta: one chunk, not one per token. If the controller dies,
        a request whose tokens come straight from its node is admitted again
        (:meth:`_readmit`) while its stream goes on."""
        front, events = admitted.front, admitted.events
        stream = text_stream(self.tokenizer, params, prompt_ids)
        count, last, finished, lps, held, ids, stop_reason = 0, None, False, [], None, [], None
        readmit: Optional[asyncio.Task] = None
        try:
            while True:
                kind, value = held if held is not None else await events.get()
                held = None
                if (kind, value) == CONTROLLER_FAILED:
                    if self.channel.direct and front.inbox is not None and self.config.serve.restart_wait_s > 0:
                        if readmit is None or readmit.done():
                            readmit = asyncio.get_running_loop().create_task(self._readmit(admitted))
                        continue
                    finished = True
                    self._finish(FinishReason.ERROR, started, count)
                    yield ChoiceEvent(CONTROLLER_DIED, FinishReason.ERROR, count, [])
                    return
                if kind in TOKEN_EVENTS:
                    batch = [(kind, value)]          # this token and those queued behind it
                    while held is None and not events.empty():
                        nxt = events.get_nowait()
                        if nxt[0] in TOKEN_EVENTS:
                            batch.append(nxt)
                        else:
                            held = nxt
                    text, before = [], count
                    for kind, value in batch:
                        if kind == EventKind.LOGPROB:
                            lps.append(value)
                            continue
                        count += 1
                        ids.append(value)
                        if kind == EventKind.TOKEN:
                            admitted.streamed.append(value)
                        if kind == EventKind.STOP_TOKEN:     # vLLM: the tokenizer's own EOS is no stop reason
                            stop_reason = None if value == self.tokenizer.eos_token_id else value
                            continue
                        text.append(stream.add(value, check=count > params.min_tokens))
                        if stream.stopped is not None:
                            break
                    # once per chunk (the tokens that came together), not per token
                    now = time.perf_counter()
                    if count > before:
                        if last is None:
                            self.metrics.ttft.observe(now - started)
                        else:
                            self.metrics.itl.observe((now - last) / (count - before))
                        last = now
                    if stream.stopped is not None:
                        finished = True
                        await self.controller.cancel.remote(admitted.rid, FinishReason.STOP)
                        self._finish(FinishReason.STOP, started, count)
                        yield ChoiceEvent("".join(text), FinishReason.STOP, count, lps, tuple(ids), stream.stopped)
                        return
                    delta = "".join(text)
                    if delta or lps or ids:
                        yield ChoiceEvent(delta, None, count, lps, tuple(ids))
                        lps, ids = [], []
                elif kind == EventKind.DONE:
                    finished = True
                    self._finish(value, started, count)
                    yield ChoiceEvent(stream.flush(), value, count, lps, tuple(ids),
                                      stop_reason if value == FinishReason.STOP else None)
                    return
                else:
                    finished = True
                    self._finish(FinishReason.ERROR, started, count)
                    yield ChoiceEvent(str(value), FinishReason.ERROR, count, lps, tuple(ids))
                    return
        except (RayActorError, ActorUnavailableError):   # the controller died: the stream ends with an error
            finished = True
            self._finish(FinishReason.ERROR, started, count)
            yield ChoiceEvent(CONTROLLER_DIED, FinishReason.ERROR, count, [])
        finally:
            self.channel.close(front)
            if readmit is not None and not readmit.done():
                readmit.cancel()
            if not finished:      # the client disconnected: free the request's work
                # counted first: a cancelled stream may be cancelled again at the await below
                self._finish(FinishReason.ABORT, started, count)
                try:
                    await self.controller.cancel.remote(admitted.rid, FinishReason.ABORT)
                except (RayActorError, ActorUnavailableError):
                    pass          # the controller died: the request died with it

    def _finish(self, reason: FinishReason, started: float, tokens: int) -> None:
        """A request ended: its outcome, latency and generated tokens, once per request."""
        self.metrics.success.inc(tags={"finished_reason": reason})
        self.metrics.e2e.observe(time.perf_counter() - started)
        if tokens:
            self.metrics.generation_tokens.inc(tokens)
