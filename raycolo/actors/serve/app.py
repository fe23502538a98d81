"""raycolo's HTTP front: an OpenAI-compatible Ray Serve FastAPI ingress over the live
co-located deployment (docs/serve.md).

    serve run examples/serve.yaml                       # import_path: raycolo.actors.serve.app:build_app
    raycolo serve examples/online.yaml                  # a local cluster
    ray job submit --working-dir . -- python jobs/serve.py --config examples/online.yaml

The ingress tokenizes, renders chats, checks requests, streams server-sent events and
records metrics; the :class:`~raycolo.actors.online.controller.OnlineController` (one per
deployment, a detached named actor that every replica attaches to) admits requests and
places them and the training they bring with LeMix on the stage workers.
"""

import asyncio
import hmac
import os
import secrets
import time
import uuid
from typing import Optional, Union

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from raycolo.actors.serve.front_channel import CONTROLLER_FAILED, FrontChannel, FrontKey
from raycolo.actors.local_cluster import NAMESPACE, controller_name
from raycolo.errors import ConfigError
from raycolo.online.config import OnlineConfig, load_online_config, parse_online_config
from raycolo.errors import StoreFull
from raycolo.online.serving.errors import OpenAIError, from_error
from raycolo.online.serving.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse, Health,
                                      ModelCard, ModelList, TrainSamplesBody, TrainSamplesResponse,
                                      TrainStatus, CompletionResponse, ChatCompletionResponse, EvalResponse,
                                      BASE, BASE_SUFFIX, LATEST, VERSION_SUFFIX, model_variant)
from raycolo.online.serving.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from raycolo.online.serving.responses import SseChunks, StreamInterval, choice, usage
from raycolo.online.serving.text import TextStream, chat_prompt_ids, chat_sample_ids, encode_completion
from raycolo.online.serving.messages import TOKEN_EVENTS

MONITOR_EVERY_S = 2.0
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
CONTROLLER_DIED = "the deployment's controller failed mid-request (it restarts); retry"
SSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
             "description": "JSON, or server-sent events with stream: true"}}
PLAIN_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                    "description": "vLLM's success text (its LoRA routes answer plain text)"}}

app = FastAPI(title="raycolo", version="0.1.0",
              description="OpenAI-compatible serving with co-located LoRA retraining (LeMix on Ray).")
# This replica's limits, set by the ingress's __init__ in the process environment: Serve
# ships the FastAPI app to the replica by value, so a module global would be a copy.
BODY_LIMIT_ENV, KEY_NAME_ENV = "RAYCOLO_SERVE_MAX_BODY_BYTES", "RAYCOLO_SERVE_API_KEY_ENV"


def _error(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError):
    return _error(exc)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    return _error(from_error(errors[0] if errors else {}))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    status = exc.status_code if exc.status_code in (400, 401, 404, 405, 413) else 400
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    text = message.get(status) or ("the body could not be parsed (malformed or nested too deeply)"
                                   if "parsing the body" in str(exc.detail) else str(exc.detail))
    return _error(OpenAIError(status, text, code="invalid_request"))


@app.exception_handler(RayActorError)
@app.exception_handler(ActorUnavailableError)
async def _controller_gone(request: Request, exc: Exception):
    """The controller died while serving this call; Ray restarts it and it resumes from its
    checkpoints and sample store. Nothing of this call was acknowledged."""
    return _error(OpenAIError(503, "the deployment's controller failed and is restarting; retry",
                              code="unavailable", headers={"Retry-After": "5"}))


@app.exception_handler(RecursionError)
async def _too_deep(request: Request, exc: RecursionError):
    return _error(OpenAIError(400, "the body is nested too deeply", code="invalid_json"))


class AdapterName:
    """A request's ``model`` that names none of the served model's variants: perhaps an
    adapter loaded with POST /v1/load_lora_adapter (never equal to LATEST or BASE, whatever
    its name)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Guard:
    """API key and body size, checked before the body is parsed. A pure ASGI middleware:
    Starlette's ``BaseHTTPMiddleware`` wraps streamed responses and added about 40 ms to
    the first streamed chunk here."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key_env = os.environ.get(KEY_NAME_ENV)
        key = os.environ.get(key_env) if key_env else None
        if key and scope["path"] not in ("/health", "/openapi.json", "/docs"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return await _error(OpenAIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                                code="invalid_api_key"))(scope, receive, send)
        limit = int(os.environ.get(BODY_LIMIT_ENV, "0"))
        if limit and scope["method"] == "POST":
            too_big = OpenAIError(413, f"the body is larger than {limit} bytes", code="body_too_large")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                return await _error(too_big)(scope, receive, send)
            if length is None:       # chunked: read it all, counting, then replay it
                chunks, size, more = [], 0, True
                while more:
                    message = await receive()
                    chunks.append(message)
                    size += len(message.get("body", b""))
                    more = message.get("more_body", False) and message["type"] == "http.request"
                    if size > limit:
                        return await _error(too_big)(scope, receive, send)
                replay = iter(chunks)

                async def receive_again():
                    return next(replay, {"type": "http.request", "body": b"", "more_body": False})

                return await self.app(scope, receive_again, send)
        return await self.app(scope, receive, send)


app.add_middleware(Guard)


@serve.deployment(name="raycolo-openai", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, config: dict, controller_name: str):
        from raycolo.actors.online.controller import OnlineController
        from raycolo.actors.serve.metrics import DeploymentMetrics, FrontMetrics
        from raycolo.engine.models import load_tokenizer
        from raycolo.online.config import model_hf_config

        self.config = OnlineConfig.model_validate(config)
        cfg = self.config
        self.model_name = cfg.served_model_name()
        self.tokenizer = load_tokenizer(cfg.model_loading_config.model_id)
        hf = model_hf_config(cfg.model_loading_config.model_id)
        self.context = int(getattr(hf, "max_position_embeddings", 1 << 30))
        self.vocab = int(hf.vocab_size)
        key = os.environ.get(cfg.serve.api_key_env) if cfg.serve.api_key_env else None
        if cfg.serve.api_key_env and not key:
            raise ConfigError(f"serve.api_key_env: the environment variable {cfg.serve.api_key_env} "
                              "is not set in the Ray cluster's environment")
        os.environ[BODY_LIMIT_ENV] = str(cfg.serve.max_body_bytes)
        os.environ[KEY_NAME_ENV] = cfg.serve.api_key_env or ""
        self.controller = OnlineController.options(
            name=controller_name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            max_restarts=-1).remote(cfg.model_dump(), controller_name, NAMESPACE)
        ray.get(self.controller.start.remote())
        self.front_id = uuid.uuid4().hex[:8]
        ray.get(self.controller.attach.remote(self.front_id))
        self.channel = FrontChannel(self.controller, self.front_id,     # this replica's requests' events
                                    direct=cfg.serve.token_path == "direct")
        self.created = int(time.time())
        self.metrics = FrontMetrics()
        self.gauges = DeploymentMetrics()
        self.monitor = None

    def __del__(self):
        try:
            self.controller.detach.remote(self.front_id)
        except Exception:   # the cluster is going away
            pass

    async def _monitor(self) -> None:
        while True:
            try:
                self.gauges.update(self.model_name, await self.controller.monitor.remote())
            except Exception:    # the controller restarts or stops: try again
                pass
            await asyncio.sleep(MONITOR_EVERY_S)

    def _ensure_monitor(self) -> None:
        if self.monitor is None:
            self.monitor = asyncio.get_running_loop().create_task(self._monitor())

    # -- models ----------------------------------------------------------------------------
    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models(self) -> ModelList:
        """The served model (its latest adapter), ``<model>@base`` (no adapter) and
        ``<model>@v<k>`` for each saved adapter version still servable."""
        name = self.model_name
        cards = [ModelCard(id=name, created=self.created, root=name, adapter=LATEST),
                 ModelCard(id=f"{name}{BASE_SUFFIX}", created=self.created, root=name, parent=name,
                           adapter=BASE)]
        for k in await self.controller.adapter_versions.remote():
            cards.append(ModelCard(id=f"{name}{VERSION_SUFFIX}{k}", created=self.created, root=name,
                                   parent=name, adapter="version", adapter_version=k))
        for a in await self.controller.loaded_adapters.remote():     # POST /v1/load_lora_adapter
            cards.append(ModelCard(id=a["name"], created=a["created"], root=a["path"], parent=name,
                                   adapter="loaded"))
        return ModelList(data=cards)

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

    # -- adapters loaded while serving: vLLM's routes and bodies --------------------------------
    @app.post("/v1/load_lora_adapter", responses={**ERRORS, **PLAIN_TEXT, 403: {"model": ErrorResponse}})
    async def load_lora_adapter(self, body: LoadLoraAdapterRequest):
        """vLLM's route: serve the peft LoRA adapter at ``lora_path`` as model ``lora_name``
        (next to the served model, ``@base`` and ``@v<k>``), on every replica. 200 with
        vLLM's plain success text; 403 for a path outside ``serve.lora_load_dirs`` (none:
        loading is off); 404 for a path with nothing there; 400 for a directory
        that is not a peft LoRA adapter, one that does not fit (rank above ``lora.rank``,
        modules the deployment's LoRA does not adapt, another base model's shapes), a name
        loaded already (unless ``load_inplace``) or one of the served model's names."""
        out = await self.controller.load_adapter.remote(body.lora_name, body.lora_path, body.load_inplace)
        if "status" in out:
            raise OpenAIError(out["status"], out["message"], param=out["param"], code=out["code"])
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={**ERRORS, **PLAIN_TEXT})
    async def unload_lora_adapter(self, body: UnloadLoraAdapterRequest):
        """vLLM's route: stop serving loaded adapter ``lora_name`` (404 if none is loaded
        under that name). Requests running on it finish on it."""
        out = await self.controller.unload_adapter.remote(body.lora_name)
        if "status" in out:
            raise OpenAIError(out["status"], out["message"], param=out["param"], code=out["code"])
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- generation -------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses={**ERRORS, **SSE})
    async def completions(self, body: CompletionRequest, request: Request):
        variant = self._check_model(body.model)
        if isinstance(body.prompt, str):
            ids = self.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
            if max(ids) >= self.vocab:
                raise OpenAIError(400, f"prompt: token ids must be below the vocabulary size {self.vocab}",
                                  param="prompt", code="invalid_parameter")
        return await self._generate(body, ids, body.max_tokens, "prompt", chat=False, variant=variant)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**ERRORS, **SSE})
    async def chat(self, body: ChatCompletionRequest, request: Request):
        variant = self._check_model(body.model)
        ids = chat_prompt_ids(self.tokenizer, [(m.role, m.text()) for m in body.messages])
        return await self._generate(body, ids, body.limit(), "messages", chat=True, variant=variant)

    def _sampling(self, body, ids: list[int], max_tokens: Optional[int], prompt_param: str, chat: bool):
        """The request's SamplingParams, its limit checked against the context."""
        limit = max_tokens if max_tokens is not None else self.config.max_tokens
        kv = self.config.stage.kv_cache_tokens
        context = min(self.context, kv)
        if len(ids) >= context:
            raise OpenAIError(400, f"{prompt_param}: the prompt has {len(ids)} tokens; this model's "
                              f"context is {context} tokens", param=prompt_param, code="context_length_exceeded")
        param = "max_tokens" if not chat or body.max_completion_tokens is None else "max_completion_tokens"
        if len(ids) + limit > context:
            raise OpenAIError(400, f"{param}: {len(ids)} prompt tokens + {limit} completion tokens exceed "
                              f"this model's context of {context} tokens", param=param,
                              code="context_length_exceeded")
        if body.min_tokens > limit:
            raise OpenAIError(400, f"min_tokens: {body.min_tokens} is more than the {limit} tokens allowed",
                              param="min_tokens", code="invalid_parameter")
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        return body.sampling_params(limit, seed)

    async def _admit(self, body, ids: list[int], params, variant) -> tuple[int, FrontKey, asyncio.Queue]:
        """Admit one request: its id, its key on this replica's channel and its events' queue."""
        version = await self._pinned_version(variant)
        front, events = await self.channel.open()
        try:
            admitted = await self.controller.admit.remote(ids, base=variant == BASE, version=version,
                                                          params=params, front=front)
        except BaseException:
            self.channel.close(front)
            raise
        if admitted.rejected:
            self.channel.close(front)
        if admitted.rejected == "overloaded":
            self.metrics.rejected.inc(tags={"model_name": self.model_name})
            retry = admitted.retry_after_s
            raise OpenAIError(429, f"the server is at its limit of {self.config.serve.max_ongoing_requests} "
                              f"ongoing requests; retry after {retry} s", code="overloaded",
                              headers={"Retry-After": str(retry)})
        if admitted.rejected == "unknown_version":
            held = ", ".join(f"'{self.model_name}{VERSION_SUFFIX}{k}'" for k in admitted.versions) or "none yet"
            raise OpenAIError(404, f"model '{body.model}': adapter version {version} is not servable (only the "
                              f"newest {self.config.serve.pinned_versions} saved versions are); servable: {held}",
                              param="model", code="model_not_found")
        if admitted.rejected == "starting":
            raise OpenAIError(503, admitted.why, code="unavailable",
                              headers={"Retry-After": str(admitted.retry_after_s)})
        if admitted.rejected:
            raise OpenAIError(503, f"no stage-worker node is alive: {admitted.why}", code="unavailable")
        self.metrics.prompt_tokens.inc(len(ids), tags={"model_name": self.model_name})
        return admitted.id, front, events

    async def _generate(self, body, ids: list[int], max_tokens: Optional[int], prompt_param: str, chat: bool,
                        variant: Union[str, int] = LATEST):
        self._ensure_monitor()
        params = self._sampling(body, ids, max_tokens, prompt_param, chat)
        started = time.perf_counter()
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            admitted = await self._admit(body, ids, params, variant)
            out_id = f"{'chatcmpl' if chat else 'cmpl'}-{admitted[0]}-{uuid.uuid4().hex[:8]}"
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._events(admitted, params, started, ids)
            return StreamingResponse(self._sse(events, out_id, kind, len(ids), include_usage, body.model),
                                     media_type="text/event-stream")
        # n choices: n requests, choice i drawn with seed + i (all admitted before any is awaited)
        admitted = []
        for i in range(body.n):
            choice_params = params if i == 0 else params.model_copy(update={"seed": params.seed + i})
            admitted.append(await self._admit(body, ids, choice_params, variant))
        out_id = f"{'chatcmpl' if chat else 'cmpl'}-{admitted[0][0]}-{uuid.uuid4().hex[:8]}"
        results = await asyncio.gather(*[self._collect(a, params, started, ids) for a in admitted])
        count = sum(r[2] for r in results)
        choices = [choice(self.tokenizer, chat, i, content, reason, logprobs)
                   for i, (content, reason, _, logprobs) in enumerate(results)]
        return JSONResponse({"id": out_id, "object": kind, "created": int(time.time()), "model": body.model,
                             "choices": choices, "usage": usage(len(ids), count)})

    async def _collect(self, admitted: tuple, params, started: float, prompt_ids: list[int]):
        """A whole (non-streamed) choice: text, finish_reason, tokens, log-probabilities."""
        text, reason, count, logprobs = [], None, 0, None if params.logprobs is None else []
        async for delta, finish, n, lps in self._events(admitted, params, started, prompt_ids):
            text.append(delta)
            count = n
            if finish == "error":
                raise OpenAIError(503, f"generation failed: {delta}", code="generation_failed")
            reason = finish or reason
            if logprobs is not None:
                logprobs.extend(lps)
        return "".join(text), reason, count, logprobs

    async def _events(self, admitted: tuple, params, started: float, prompt_ids: list[int]):
        """(text delta, finish_reason or None, tokens so far, log-probabilities of the tokens
        since the last event) as tokens arrive (``admitted``: what :meth:`_admit` returned;
        the events come over this replica's channel); an "error" finish carries the
        error's text. Text follows raycolo.generation: a stop token is counted, never
        shown; a stop string ends the text before it (the request is cancelled upstream),
        as does a client that went away. Tokens that arrived together (the replica fell
        behind) go out as one delta: one chunk, not one per token."""
        rid, front, events = admitted
        tags = {"model_name": self.model_name}
        stream = TextStream(self.tokenizer, params.stop, params.skip_special_tokens, prompt_ids)
        count, last, finished, lps, held = 0, None, False, [], None
        try:
            while True:
                kind, value = held if held is not None else await events.get()
                held = None
                if (kind, value) == CONTROLLER_FAILED:
                    finished = True
                    self._finish("error", started)
                    yield CONTROLLER_DIED, "error", count, []
                    return
                if kind in TOKEN_EVENTS:
                    batch = [(kind, value)]          # this token and those queued behind it
                    while held is None and not events.empty():
                        nxt = events.get_nowait()
                        if nxt[0] in TOKEN_EVENTS:
                            batch.append(nxt)
                        else:
                            held = nxt
                    text = []
                    for kind, value in batch:
                        if kind == "logprob":
                            lps.append(value)
                            continue
                        now = time.perf_counter()
                        count += 1
                        if last is None:
                            self.metrics.ttft.observe(now - started, tags)
                        else:
                            self.metrics.itl.observe(now - last, tags)
                        last = now
                        self.metrics.generation_tokens.inc(1, tags)
                        if kind == "stop_token":
                            continue
                        text.append(stream.add(value, check=count > params.min_tokens))
                        if stream.stopped is not None:
                            finished = True
                            await self.controller.cancel.remote(rid, "stop")
                            self._finish("stop", started)
                            yield "".join(text), "stop", count, lps
                            return
                    delta = "".join(text)
                    if delta or lps:
                        yield delta, None, count, lps
                        lps = []
                elif kind == "done":
                    finished = True
                    self._finish(value, started)
                    yield stream.flush(), value, count, lps
                    return
                else:
                    finished = True
                    self._finish("error", started)
                    yield str(value), "error", count, lps
                    return
        except (RayActorError, ActorUnavailableError):   # the controller died: the stream ends with an error
            finished = True
            self._finish("error", started)
            yield CONTROLLER_DIED, "error", count, []
        finally:
            self.channel.close(front)
            if not finished:      # the client disconnected: free the request's work
                try:
                    await self.controller.cancel.remote(rid, "abort")
                except (RayActorError, ActorUnavailableError):
                    pass          # the controller died: the request died with it
                self._finish("abort", started)

    def _finish(self, reason: str, started: float) -> None:
        tags = {"model_name": self.model_name}
        self.metrics.success.inc(tags=dict(tags, finished_reason=reason))
        self.metrics.e2e.observe(time.perf_counter() - started, tags)

    async def _sse(self, events, out_id: str, kind: str, prompt_tokens: int, include_usage: bool, model: str):
        sse = SseChunks(self.tokenizer, out_id, kind == "chat.completion", model, int(time.time()))
        if sse.chat:
            yield sse.chunk(None, None, role=True)
        count, held = 0, StreamInterval(self.config.serve.stream_interval)
        async for delta, finish, count, lps in events:
            if finish == "error":       # after the 200: the failure travels inside the stream
                text, lps = held.add("", count, [], final=True)
                if text or lps:
                    yield sse.chunk(text, None, lps=lps)
                yield sse.error(OpenAIError(503, f"generation failed: {delta}", code="generation_failed").body())
                break
            out = held.add(delta, count, lps, final=finish is not None)
            if out is not None and (out[0] or out[1]):
                yield sse.chunk(out[0], None, lps=out[1])
            if finish:
                yield sse.chunk(None, finish)
        if include_usage:
            yield sse.usage(prompt_tokens, count)
        yield sse.DONE

    # -- training samples -------------------------------------------------------------------
    def _pairs(self, body: TrainSamplesBody) -> list[tuple[list[int], ...]]:
        """Each sample as token ids: (prompt, completion), or (prompt, chosen, rejected)."""
        out = []
        max_len = self.config.lora.max_len
        for i, s in enumerate(body.samples):
            if s.messages is not None:      # rendered with the chat template, once
                messages = [(m.role, m.text()) for m in s.messages]
                try:
                    p_ids, *c_ids = chat_sample_ids(self.tokenizer, messages, self.tokenizer.eos_token_ids,
                                                    [s.chosen, s.rejected] if s.is_pair else None)
                except ValueError as exc:
                    raise OpenAIError(400, f"{body.param}[{i}].messages: {exc}", param=f"{body.param}[{i}].messages",
                                      code="invalid_parameter") from None
            else:
                prompt, *completions = (s.prompt, s.chosen, s.rejected) if s.is_pair else (s.prompt, s.completion)
                p_ids = self.tokenizer.encode(prompt)
                c_ids = [encode_completion(self.tokenizer, c) for c in completions]
            if len(p_ids) >= max_len:
                raise OpenAIError(400, f"{body.param}[{i}]: the prompt has {len(p_ids)} tokens; training "
                                  f"samples hold at most lora.max_len = {max_len}", param=f"{body.param}[{i}]",
                                  code="sample_too_long")
            out.append((p_ids, *c_ids))
        return out

    @app.post("/v1/train_samples", response_model=TrainSamplesResponse, responses=ERRORS)
    async def train_samples(self, body: TrainSamplesBody) -> TrainSamplesResponse:
        """Validate, persist (fsync) and acknowledge samples (``{"samples": [...]}`` or a bare list);
        they are trained as they come."""
        pairs = self._pairs(body)
        try:
            out = await self.controller.add_samples.remote(pairs, True)
        except StoreFull as exc:        # nothing was stored, so nothing is acknowledged
            raise OpenAIError(507, str(exc).splitlines()[-1].split("StoreFull: ")[-1],
                              code="sample_store_full") from None
        self.metrics.samples_received.inc(len(pairs), tags={"model_name": self.model_name})
        return TrainSamplesResponse(ids=out["ids"], sequence=out["stored"], persisted=True)

    @app.post("/v1/eval", response_model=EvalResponse, responses=ERRORS)
    async def evaluate(self, body: TrainSamplesBody) -> EvalResponse:
        """Loss of the served model on held-out samples, or its win rate and CLPD on held-out
        preference pairs (forward only; nothing is stored)."""
        pairs = self._pairs(body)
        if len({len(x) for x in pairs}) > 1:
            raise OpenAIError(400, f"{body.param or 'the body'}: evaluate (prompt, completion) samples or "
                              "preference pairs, not both in one request", param=body.param or None)
        node = await self.controller.last_node.remote()
        if len(pairs[0]) == 3:
            out = await self.controller.held_out_preference.remote(pairs, node)
            figures = {"win_rate": out["win_rate"], "clpd": out["clpd"]}
        else:
            figures = {"loss": await self.controller.held_out_loss.remote(pairs, node)}
        status = await self.controller.train_status.remote()
        return EvalResponse(**figures, samples=len(pairs), adapter_version=status["adapter_version"])

    @app.get("/v1/train_samples/status", response_model=TrainStatus, responses=ERRORS)
    async def train_status(self) -> TrainStatus:
        return TrainStatus(**await self.controller.train_status.remote())

    @app.get("/v1/stats", responses=ERRORS)
    async def stats(self) -> dict:
        """Per-node queues, SLO attainment, throughput, training rate, staleness."""
        stats = await self.controller.stats.remote()
        monitor = await self.controller.monitor.remote()
        result = (await self.controller.metrics.remote()).summary()
        return {"model": self.model_name, **{k: stats[k] for k in (
                    "policy", "nodes", "stages", "now_s", "requests", "completed", "train_done",
                    "samples_stored", "samples_pending", "adapter_version", "queues", "restarts",
                    "dead_nodes", "restarting_nodes", "checkpoint_versions", "decision_us_p50", "decision_us_p99", "cancelled",
                    "unfinished")},
                "slo_attainment": monitor["slo_attainment"],
                "throughput_tasks_per_s": result.get("throughput_tasks_per_s"),
                "training_rate_steps_per_s": monitor["optimizer_steps"] / stats["now_s"] if stats["now_s"] else 0.0,
                "adapter_staleness_s": monitor["adapter_staleness_s"],
                "stages": monitor["stages"], "running": monitor["running"], "waiting": monitor["waiting"]}

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health(self):
        h = await self.controller.health.remote()
        return JSONResponse(h, status_code=200 if h["nodes_alive"] else 503)


class BuildArgs(BaseModel):
    """``args`` of the Serve application: ``config`` is a path to an online config (YAML)
    or the online config itself (a mapping)."""

    config: object = "examples/online.yaml"


def resolve_config(config) -> OnlineConfig:
    if isinstance(config, OnlineConfig):
        return config
    if isinstance(config, dict):
        return parse_online_config(config, "args.config")
    return load_online_config(str(config))


def build_app(args: BuildArgs):
    """The Serve application (``import_path: raycolo.actors.serve.app:build_app``)."""
    config = resolve_config(args.config if isinstance(args, BuildArgs) else BuildArgs(**args).config)
    config.check_init_from()           # lora.init_from: before anything starts
    name = controller_name(config.serve.app_name)
    return OpenAIIngress.options(num_replicas=config.serve.replicas).bind(config.model_dump(), name)
