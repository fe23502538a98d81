"""The ingress's HTTP guard rails, outside the ingress class: the API key and body-size
middleware (:class:`Guard`) and the exception handlers that turn every failure into an
OpenAI error body (raycolo.online.serving.openai_errors). :func:`install` puts both on the
FastAPI app of :mod:`raycolo.actors.serve.app`."""

import hmac
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from raycolo.online.serving.openai_errors import OpenAIError, from_error

# This replica's limits, set by the ingress's __init__ in the process environment: Serve
# ships the FastAPI app to the replica by value, so a module global would be a copy.
BODY_LIMIT_ENV, KEY_NAME_ENV = "RAYCOLO_SERVE_MAX_BODY_BYTES", "RAYCOLO_SERVE_API_KEY_ENV"


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _openai_error(request: Request, exc: OpenAIError):
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    return error_response(from_error(errors[0] if errors else {}))


async def _http_error(request: Request, exc: StarletteHTTPException):
    status = exc.status_code if exc.status_code in (400, 401, 404, 405, 413) else 400
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    text = message.get(status) or ("the body could not be parsed (malformed or nested too deeply)"
                                   if "parsing the body" in str(exc.detail) else str(exc.detail))
    return error_response(OpenAIError(status, text, code="invalid_request"))


async def _controller_gone(request: Request, exc: Exception):
    """The controller died while serving this call; Ray restarts it and it resumes from its
    checkpoints and sample store. Nothing of this call was acknowledged."""
    return error_response(OpenAIError(503, "the deployment's controller failed and is restarting; retry",
                                      code="unavailable", headers={"Retry-After": "5"}))


async def _too_deep(request: Request, exc: RecursionError):
    return error_response(OpenAIError(400, "the body is nested too deeply", code="invalid_json"))


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
                return await error_response(OpenAIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                                        code="invalid_api_key"))(scope, receive, send)
        limit = int(os.environ.get(BODY_LIMIT_ENV, "0"))
        if limit and scope["method"] == "POST":
            too_big = OpenAIError(413, f"the body is larger than {limit} bytes", code="body_too_large")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                return await error_response(too_big)(scope, receive, send)
            if length is None:       # chunked: read it all, counting, then replay it
                chunks, size, more = [], 0, True
                while more:
                    message = await receive()
                    chunks.append(message)
                    size += len(message.get("body", b""))
                    more = message.get("more_body", False) and message["type"] == "http.request"
                    if size > limit:
                        return await error_response(too_big)(scope, receive, send)
                replay = iter(chunks)

                async def receive_again():
                    return next(replay, {"type": "http.request", "body": b"", "more_body": False})

                return await self.app(scope, receive_again, send)
        return await self.app(scope, receive, send)


def install(app: FastAPI) -> None:
    """The exception handlers and the :class:`Guard` middleware, on ``app``."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RayActorError, _controller_gone)
    app.add_exception_handler(ActorUnavailableError, _controller_gone)
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_middleware(Guard)
