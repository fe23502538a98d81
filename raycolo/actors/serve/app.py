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

import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve

from raycolo.actors.serve.completions import Completions
from raycolo.actors.serve.front_channel import FrontChannel
from raycolo.actors.serve.guard import BODY_LIMIT_ENV, KEY_NAME_ENV, install
from raycolo.actors.serve.listener import ReplicaListener, shared_socket
from raycolo.actors.serve.sample_intake import SampleIntake
from raycolo.actors.local_cluster import NAMESPACE, controller_name
from raycolo.errors import ConfigError, StoreFull
from raycolo.online.config import Ingress, OnlineConfig, load_online_config, parse_online_config
from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.protocol import (BASE, BASE_SUFFIX, LATEST, VERSION_SUFFIX, ChatCompletionRequest,
                                             ChatCompletionResponse, CompletionRequest, CompletionResponse,
                                             ErrorResponse, EvalResponse, Health, LoadLoraAdapterRequest,
                                             ModelCard, ModelList, TrainSamplesBody, TrainSamplesResponse,
                                             TrainStatus, UnloadLoraAdapterRequest)
from raycolo.online.serving.responses_api import ResponseEvents, whole_response
from raycolo.online.serving.responses_protocol import ResponseObject, ResponsesRequest, responses_error
from raycolo.online.serving.text import ChatTemplateError, chat_prompt_ids
from raycolo.online.serving.answer_reading import chat_reading
from raycolo.online.serving.tool_protocol import template_tools
from raycolo.online.serving.tokenize_protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeBody,
                                                      TokenizeChatRequest, TokenizeResponse)
from raycolo.online.serving.train_samples import sample_ids

DRAIN_S = 15.0        # within Serve's graceful_shutdown_timeout_s (20 s by default), which ends it anyway
SHUTDOWN_CHECK_S = 0.2   # a stopping replica looks this often for requests still in flight (Serve: 2 s)
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
SSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
             "description": "JSON, or server-sent events with stream: true"}}
PLAIN_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                    "description": "vLLM's success text (its LoRA routes answer plain text)"}}

app = FastAPI(title="raycolo", version="0.1.0",
              description="OpenAI-compatible serving with co-located LoRA retraining (LeMix on Ray).")
install(app)     # the API key and body-size middleware, and the OpenAI error bodies (guard.py)


def deployment_controller(cfg: OnlineConfig, name: str):
    """The deployment's controller (detached, named ``name``, restarted by Ray whenever it
    dies): the first HTTP replica creates it, the others get the same actor. (Above the
    ingress class: Serve pickles that class when it is decorated, with the globals its
    methods name that exist by then.)"""
    from raycolo.actors.online.controller import OnlineController

    return OnlineController.options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                    max_restarts=-1).remote(cfg.model_dump(), name, NAMESPACE)


@serve.deployment(name="raycolo-openai", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  graceful_shutdown_wait_loop_s=SHUTDOWN_CHECK_S)
@serve.ingress(app)
class OpenAIIngress(Completions):
    """The routes; what the generation routes share is :class:`~raycolo.actors.serve.completions.Completions`."""

    async def __init__(self, config: dict, controller_name: str):
        from raycolo.actors.serve.front_metrics import DeploymentMetrics, FrontMetrics
        from raycolo.engine.models import load_tokenizer
        from raycolo.online.config import model_hf_config

        self.config = OnlineConfig.model_validate(config)
        cfg = self.config
        # this replica answers HTTP itself (listener.py): its port, held from the start
        sock = shared_socket(cfg.serve.host, cfg.serve.port) if cfg.serve.ingress == Ingress.REPLICA else None
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
        self.controller = deployment_controller(cfg, controller_name)
        await self.controller.start.remote()
        self.front_id = uuid.uuid4().hex[:8]
        await self.controller.attach.remote(self.front_id)
        self.channel = FrontChannel(self.controller, self.front_id,     # this replica's requests' events
                                    direct=cfg.serve.token_path == "direct")
        self.created = int(time.time())
        self.metrics = FrontMetrics(self.model_name, self.front_id)
        self.samples = SampleIntake(self.controller, self.channel, cfg, self.metrics.samples_stored_here)
        self.gauges = DeploymentMetrics()
        self.monitor = None
        self.nodes, self.node_load, self.placed = [], {}, {}     # direct placement (controller down)
        self.listener = None
        if sock is not None:
            self.listener = await ReplicaListener.start(
                app, sock, cfg.serve.route_prefix,
                ready=lambda: serve.get_replica_context().servable_object is not None)

    async def __del__(self):
        """Serve stops this replica (scale-down, update, delete): with its own listener, stop
        accepting and let the streams in flight finish first (Serve's drain counts only
        requests that came through its proxy), within the deployment's graceful shutdown."""
        if getattr(self, "listener", None) is not None:
            await self.listener.drain(DRAIN_S)
        try:
            self.controller.detach.remote(self.front_id)
        except Exception:   # the cluster is going away
            pass

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

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
    async def model(self, model: str) -> ModelCard:
        """OpenAI's route: the card ``GET /v1/models`` lists under this id (404 naming
        ``model`` for any other)."""
        for card in (await self.models()).data:
            if card.id == model:
                return card
        raise OpenAIError(404, f"model '{model}' does not exist; GET /v1/models lists the models served here",
                          param="model", code="model_not_found")

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
        if out is not None:          # an AdapterRefusal
            raise OpenAIError(out.status, out.message, param=out.param, code=out.code)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={**ERRORS, **PLAIN_TEXT})
    async def unload_lora_adapter(self, body: UnloadLoraAdapterRequest):
        """vLLM's route: stop serving loaded adapter ``lora_name`` (404 if none is loaded
        under that name). Requests running on it finish on it."""
        out = await self.controller.unload_adapter.remote(body.lora_name)
        if out is not None:          # an AdapterRefusal
            raise OpenAIError(out.status, out.message, param=out.param, code=out.code)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- generation -------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses={**ERRORS, **SSE})
    async def completions(self, body: CompletionRequest, request: Request):
        variant = self._check_model(body.model)
        given = body.prompts()
        prompts, batch = [], len(given) > 1
        for i, prompt in enumerate(given):
            where = f"prompt {i}: " if batch else ""
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:           # an empty text, with a tokenizer that adds no BOS
                raise OpenAIError(400, f"prompt: {where}the prompt is empty (no tokens)", param="prompt",
                                  code="invalid_parameter")
            if max(ids) >= self.vocab:
                raise OpenAIError(400, f"prompt: {where}token ids must be below the vocabulary size {self.vocab}",
                                  param="prompt", code="invalid_parameter")
            prompts.append(ids)
        return await self._generate(body, prompts, body.max_tokens, "prompt", chat=False, variant=variant)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**ERRORS, **SSE})
    async def chat(self, body: ChatCompletionRequest, request: Request):
        variant = self._check_model(body.model)
        ids = self._chat_ids(body, tools=template_tools(body.tools))
        reading = chat_reading(body, self.config.serve.tool_call_parser, self.config.serve.reasoning_parser,
                               self.tokenizer, ids)
        return await self._generate(body, [ids], body.limit(), "messages", chat=True, variant=variant,
                                    reading=reading)

    @app.post("/v1/responses", response_model=ResponseObject, responses={**ERRORS, **SSE})
    async def responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, served as the chat request it is equal to
        (:mod:`raycolo.online.serving.responses_protocol`), answered in its shape
        (:mod:`raycolo.online.serving.responses_api`)."""
        try:
            answer = await self.chat(body.chat_request(), request)
        except OpenAIError as err:        # the chat's field named as this body has it
            raise responses_error(err) from None
        if body.stream:
            return StreamingResponse(ResponseEvents(body).events(answer.body_iterator),
                                     media_type="text/event-stream")
        return JSONResponse(whole_response(body, json.loads(answer.body)))

    def _chat_ids(self, body, add_special_tokens: bool = False, tools=None) -> list[int]:
        """A chat body's prompt ids (its template, tools, ``chat_template_kwargs`` and how it
        is rendered: :class:`~raycolo.online.serving.chat_messages.ChatRendering`); a 400
        where the template refuses it, naming the variables where any were given."""
        try:
            return chat_prompt_ids(self.tokenizer, [m.template_dict() for m in body.messages],
                                   body.add_generation_prompt, add_special_tokens, tools,
                                   template_kwargs=body.chat_template_kwargs,
                                   continue_final_message=body.continue_final_message)
        except ChatTemplateError as exc:
            param = "chat_template_kwargs" if body.chat_template_kwargs else "messages"
            raise OpenAIError(400, f"{param}: {exc}", param=param, code="invalid_parameter") from None

    # -- the tokenizer: vLLM's routes and bodies ---------------------------------------------
    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(self, body: TokenizeBody) -> TokenizeResponse:
        """vLLM's route: the ids a prompt (``add_special_tokens`` true) or a chat (its
        template, ``add_generation_prompt`` true, or ``continue_final_message``) comes to, as the generation routes
        prefill them; ``max_model_len`` is the context they enforce."""
        req = body.root
        if req.model is not None:
            await self.model(req.model)          # 404: not served here (GET /v1/models lists what is)
        if isinstance(req, TokenizeChatRequest):
            ids = self._chat_ids(req, req.add_special_tokens, template_tools(req.tools))
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's route: the text of ``tokens``, special tokens included."""
        if body.model is not None:
            await self.model(body.model)
        if body.tokens and max(body.tokens) >= self.vocab:
            raise OpenAIError(400, f"tokens: token ids must be below the vocabulary size {self.vocab}",
                              param="tokens", code="invalid_parameter")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens, skip_special_tokens=False))

    # -- training samples -------------------------------------------------------------------
    @app.post("/v1/train_samples", response_model=TrainSamplesResponse, responses=ERRORS)
    async def train_samples(self, body: TrainSamplesBody) -> TrainSamplesResponse:
        """Validate, persist (fsync) and acknowledge samples (``{"samples": [...]}`` or a bare list);
        they are trained as they come."""
        pairs = sample_ids(self.tokenizer, body, self.config.lora.max_len)
        try:
            out = await self.samples.add(pairs)       # the controller, or this replica while it is down
        except StoreFull as exc:        # nothing was stored, so nothing is acknowledged
            raise OpenAIError(507, str(exc).splitlines()[-1].split("StoreFull: ")[-1],
                              code="sample_store_full") from None
        self.metrics.samples_received.inc(len(pairs))
        return TrainSamplesResponse(ids=out["ids"], sequence=out["stored"], persisted=True)

    @app.post("/v1/eval", response_model=EvalResponse, responses=ERRORS)
    async def evaluate(self, body: TrainSamplesBody) -> EvalResponse:
        """Loss of the served model on held-out samples, or its win rate and CLPD on held-out
        preference pairs (forward only; nothing is stored)."""
        pairs = sample_ids(self.tokenizer, body, self.config.lora.max_len)
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
                    "unfinished", "peak_ongoing")},
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
