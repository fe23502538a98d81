"""What the ingress's generation routes (/v1/completions, /v1/chat/completions) share,
outside the ingress class: the requested model variant, the sampling parameters and
their checks, the request's token events turned into text deltas (and metrics), and the
server-sent events of a streamed response (admission: :mod:`.admission`).
:class:`Completions` is a base class of :class:`~raycolo.actors.serve.app.OpenAIIngress`,
which sets every attribute it declares."""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import ActorUnavailableError, RayActorError

from raycolo.actors.serve.admission import CONTROLLER_DIED, Admissions, Admitted
from raycolo.actors.serve.front_channel import CONTROLLER_FAILED
from raycolo.generation import FinishReason
from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.messages import TOKEN_EVENTS, EventKind
from raycolo.online.serving.token_wire import NodeAddress
from raycolo.online.serving.protocol import BASE_SUFFIX, LATEST, VERSION_SUFFIX, model_variant
from raycolo.online.serving.echo import Echo, with_prompt
from raycolo.online.serving.responses import ChoiceEvent, TokenFields, choice, prompt_logprobs, usage
from raycolo.online.serving.sse_stream import sse_answer
from raycolo.online.serving.answer_reading import AnswerReading, constraint_after
from raycolo.generation.detokenize import text_stream

if TYPE_CHECKING:
    from raycolo.actors.serve.front_metrics import DeploymentMetrics

MONITOR_EVERY_S = 2.0


class AdapterName:
    """A request's ``model`` that names none of the served model's variants: perhaps an
    adapter loaded with POST /v1/load_lora_adapter (never equal to LATEST or BASE, whatever
    its name)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Completions(Admissions):
    """The generation machinery of an ingress replica (set by its ``__init__``)."""

    context: int                 # the model's context (max_position_embeddings)
    gauges: "DeploymentMetrics"
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
        limit = max(limit, 1)      # 0: echo's prompt alone, one token generated and not shown (vLLM's)
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
        echoes = self._echoes(body, prompts) if not chat else [None] * len(prompts)
        choice_echoes = [e for e in echoes for _ in range(body.n)]
        said = body.echoed() if chat else ""      # a chat's echo: the assistant's last message before the answer
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = [self._choice_events(a, started, ids, e)
                      for a, ids, e in zip(admitted, choice_prompts, choice_echoes)]
            return StreamingResponse(sse_answer(events, self.tokenizer, out_id, chat, body.model, prompt_tokens,
                                                include_usage, self.config.serve.stream_interval, tokens, reading,
                                                said),
                                     media_type="text/event-stream")
        results = await asyncio.gather(*[self._collect(a, started, ids, e)
                                         for a, ids, e in zip(admitted, choice_prompts, choice_echoes)])
        choices = [choice(self.tokenizer, chat, i, r, tokens[i], reading, said) for i, r in enumerate(results)]
        answer = {"id": out_id, "object": kind, "created": int(time.time()), "model": body.model,
                  "choices": choices, "usage": usage(prompt_tokens, sum(r.count for r in results))}
        if chat and body.return_token_ids:
            answer["prompt_token_ids"] = list(prompts[0])
        if chat and results[0].prompt is not None:
            answer["prompt_logprobs"] = prompt_logprobs(self.tokenizer, results[0].prompt)
        return JSONResponse(answer)

    def _echoes(self, body, prompts: list[list[int]]) -> list[Optional[Echo]]:
        """What each prompt's choices show of it (a completions request's ``echo``; None: nothing)."""
        if not body.echo:
            return [None] * len(prompts)
        texts = [p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False)
                 for p in body.prompts()]
        return [Echo("" if body.return_token_ids else text, ids, body.logprobs is not None, body.max_tokens == 0)
                for text, ids in zip(texts, prompts)]

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

    def _choice_events(self, admitted: "Admitted", started: float, prompt_ids: list[int],
                       echo: Optional[Echo] = None):
        """:meth:`_events` with the prompt's log-probabilities on the first, and ``echo``'s
        prompt before the completion (:mod:`raycolo.online.serving.echo`)."""
        return with_prompt(self._events(admitted, admitted.params, started, prompt_ids),
                           lambda: admitted.prompt_logprobs, echo)

    async def _collect(self, admitted: "Admitted", started: float, prompt_ids: list[int],
                       echo: Optional[Echo] = None) -> ChoiceEvent:
        """A whole (non-streamed) choice: its events joined (log-probabilities None where
        not asked for)."""
        params, prompt = admitted.params, None
        text, reason, count, ids, stop_reason = [], None, 0, [], None
        logprobs = None if params.logprobs is None else []
        async for ev in self._choice_events(admitted, started, prompt_ids, echo):
            prompt = ev.prompt if ev.prompt is not None else prompt
            text.append(ev.delta)
            count = ev.count
            if ev.finish == FinishReason.ERROR:
                raise OpenAIError(503, f"generation failed: {ev.delta}", code="generation_failed")
            reason, stop_reason = ev.finish or reason, ev.stop_reason if ev.finish else stop_reason
            ids.extend(ev.ids)
            if logprobs is not None:
                logprobs.extend(ev.lps)
        return ChoiceEvent("".join(text), reason, count, logprobs, tuple(ids), stop_reason, prompt)

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
                if kind == EventKind.PROMPT_LOGPROBS:     # before the first token; a resumed request's again
                    admitted.prompt_logprobs = admitted.prompt_logprobs or value
                    continue
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
