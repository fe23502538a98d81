"""The online deployment config's ``serve`` section: the HTTP front (``raycolo serve``,
``serve run examples/serve.yaml``, docs/serve.md). Every default is declared here once;
the CLI and the docs read them from this model."""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator

from raycolo.bounds import Name, PathText, Strict
from raycolo.online.serving.reasoning import ReasoningParserKind
from raycolo.online.serving.tool_calls import ToolParserKind
from raycolo.text_enum import TextEnum


class Ingress(TextEnum):
    """Which process answers HTTP on ``serve.host:serve.port`` (docs/serve.md, "Ingress")."""

    REPLICA = "replica"     # each ingress replica's own listener, the port shared (SO_REUSEPORT)
    PROXY = "proxy"         # Ray Serve's HTTP proxy, which forwards to the replicas


class ServeSpec(Strict):
    """The HTTP front (``raycolo serve``, ``serve run examples/serve.yaml``, docs/serve.md)."""

    host: Name = Field(default="127.0.0.1", description=(
        "Address the HTTP front listens on; the default is loopback only."))
    port: int = Field(default=8000, ge=1, le=65535, description=(
        "Port of the HTTP front (Ray Serve's own default)."))
    ingress: Ingress = Field(default=Ingress.REPLICA, strict=False, description=(
        "Who answers HTTP on host:port. \"replica\": every ingress replica listens there itself "
        "(uvicorn in its event loop, the port shared among a node's replicas with SO_REUSEPORT, the kernel "
        "spreading connections), and raycolo serve starts no Serve proxy: a streamed chunk costs one "
        "process's CPU, not two (bench/front.py). \"proxy\": Ray Serve's HTTP proxy listens and forwards each "
        "request and chunk to a replica over Ray (the only path before 2026-11-28)."))
    route_prefix: Name = Field(default="/", description=(
        "URL path prefix the Serve application is mounted under; must start with '/'."))
    app_name: Name = Field(default="raycolo", description=(
        "Name of the Serve application; its controller actor is named raycolo-online-<app_name>."))
    served_model_name: Optional[Name] = Field(default=None, description=(
        "The model name clients send (none: model_loading_config.model_id)."))
    api_key_env: Optional[Name] = Field(default=None, description=(
        "Name of the environment variable holding the key clients must send as a Bearer token "
        "(none: no key is asked for)."))
    max_ongoing_requests: int = Field(default=64, gt=0, le=1 << 20, description=(
        "Admission limit: unfinished requests beyond it get a 429."))
    retry_after_s: int = Field(default=1, ge=1, le=3600, description=(
        "Seconds sent in the Retry-After header of a refused request (429 when overloaded, 503 while the "
        "stage workers (re)start)."))
    restart_wait_s: float = Field(default=60.0, ge=0, le=3600, description=(
        "While the deployment's controller restarts (Ray restarts it after a crash), how long a replica that "
        "was serving holds requests rather than failing them: new ones wait to be admitted, and those it "
        "was streaming are admitted again with the tokens they already streamed, to continue from there. "
        "Past it they get a 503 (an error event mid-stream). 0: fail them at once."))
    max_body_bytes: int = Field(default=1 << 20, gt=0, le=1 << 40, description=(
        "Largest request body in bytes; a larger one gets a 413."))
    replicas: int = Field(default=1, gt=0, le=64, description=(
        "Ingress replicas (all attach to one controller)."))
    token_path: Literal["direct", "controller"] = Field(default="direct", description=(
        "With stage.data_plane node, how tokens reach the replica that admitted the request. \"direct\": "
        "the node writes them to the replica's token inbox, a TCP listener on the replica's Ray node "
        "address with a per-replica secret (raycolo/online/serving/token_wire.py); \"controller\": in the node's "
        "reports to the controller, then the controller's stream to the replica (two hops; the only path "
        "before 2026-11-27)."))
    stream_interval: int = Field(default=1, ge=1, le=1024, description=(
        "Streamed answers: a chunk for the first tokens, then one per this many tokens, and the rest with "
        "the last (vLLM's --stream-interval, same default). Above 1, fewer chunks are built and written "
        "(each costs CPU, more so through Serve's proxy), at the price of smoothness."))
    pinned_versions: int = Field(default=4, ge=0, le=64, description=(
        "Adapter checkpoints servable as <model>@v<k>: the newest this many (0: none)."))
    lora_load_dirs: list[PathText] = Field(default_factory=list, max_length=256, description=(
        "Directories POST /v1/load_lora_adapter may load adapters from (a lora_path must lie under one "
        "of them once symlinks are resolved; others are a 403 that says nothing of the path). Empty: "
        "loading adapters over HTTP is off, as vLLM's routes are without VLLM_ALLOW_RUNTIME_LORA_UPDATING. "
        "A relative directory is taken from the current directory."))
    reasoning_parser: Optional[ReasoningParserKind] = Field(default=None, strict=False, description=(
        "How a chat's reasoning is told from its content (vLLM's --reasoning-parser): \"deepseek_r1\" (the "
        "reply is reasoning until </think>: DeepSeek-R1 and its distills) or \"qwen3\" (reasoning until </think> "
        "unless the chat's chat_template_kwargs.enable_thinking is false: Qwen3, QwQ), as vLLM 0.32's parsers. "
        "The answer's message.reasoning (delta.reasoning "
        "streamed) holds it. None: the text is all content."))
    tool_call_parser: Optional[ToolParserKind] = Field(default=None, strict=False, description=(
        "How tool_choice \"auto\" reads tool calls from the model's text (vLLM's --tool-call-parser with "
        "--enable-auto-tool-choice): \"hermes\" (<tool_call>{...}</tool_call>: Hermes 2 Pro, Qwen 2.5 and 3, "
        "raycolo's plain template), \"llama3_json\" (a reply that is JSON calls: Llama 3.1 to 3.3), \"pythonic\" "
        "(a reply that is a Python list of calls: Llama 3.2 and 4), \"mistral\" (calls after [TOOL_CALLS]: "
        "Mistral 7B v0.3, Nemo, Small 3.1, Magistral, Devstral) or \"qwen3_coder\" (also \"qwen3_xml\": "
        "<tool_call><function=...><parameter=...>...: Qwen3-Coder, its values typed by the tool's schema). None: "
        "\"auto\" is a 400, and a request forces a call (\"required\", a named function) or asks for none."))

    @field_validator("lora_load_dirs")
    @classmethod
    def _absolute_dirs(cls, dirs: list[str]) -> list[str]:
        out = []
        for d in dirs:
            if not d.strip():
                raise ValueError("each entry must name a directory")
            try:
                out.append(str(Path(d).expanduser().resolve()))
            except (RuntimeError, OSError, ValueError) as exc:
                raise ValueError(f"not a usable path: {d!r}: {exc}") from None
        return out

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must start with '/'")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.replace("_", "").isalnum():
            raise ValueError("must be an environment variable name (letters, digits, '_')")
        return v
