"""Each ingress replica's own HTTP listener (``serve.ingress: replica``, the default).

Through Ray Serve's HTTP proxy every streamed chunk crosses two processes: the replica
pickles its ASGI messages into a Ray streaming generator, the proxy unpickles them and
writes them (0.6-0.8 ms of CPU per chunk on the 2-core machine, bench/front.py). Here
the replica answers HTTP itself: uvicorn, in the replica's own event loop (the one its
routes and its token inbox run on), serves the same FastAPI app (same routes, API key,
body limit, OpenAI errors, admission and metrics) on ``serve.host:serve.port``.

Every ingress replica on a node binds that same address with ``SO_REUSEPORT``: the
kernel spreads new connections over them, so clients keep one URL and ``serve.replicas``
replicas share it without a balancer in between. Ray Serve's direct ingress (Ray 2.60)
is the same idea but gives each replica its own port from a range
(``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``..``MAX``, without ``SO_REUSEPORT``) and relies on
HAProxy, which binds every interface, to put them behind one address (docs/serve.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from ray.serve.config import HTTPOptions

from raycolo.actors.serve.guard import error_response
from raycolo.errors import ConfigError
from raycolo.online.serving.openai_errors import OpenAIError

STARTUP_TIMEOUT_S = 30.0
KEEP_ALIVE_S = HTTPOptions().keep_alive_timeout_s     # Ray Serve's proxy's idle keep-alive


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (every ingress replica of the
    node binds the same one); ConfigError naming serve.port if the port is taken by a
    process that did not ask to share it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"serve.port: cannot listen on {host}:{port} ({exc.strerror}); another program "
                          "holds it (serve.ingress: replica shares the port only among raycolo's ingress "
                          "replicas and Ray Serve's proxy)") from None
    return sock


class Mounted:
    """The app under ``serve.route_prefix`` (as Serve's proxy mounts it), answering 503 until
    Serve has registered the replica's instance that the routes run on."""

    def __init__(self, app, prefix: str, ready):
        self.app, self.prefix, self.ready = app, prefix.rstrip("/"), ready

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.prefix and not (path == self.prefix or path.startswith(self.prefix + "/")):
            exc = OpenAIError(404, f"no route {path}", code="invalid_request")
            return await error_response(exc)(scope, receive, send)
        if not self.ready():
            exc = OpenAIError(503, "this replica is starting; retry", code="unavailable", headers={"Retry-After": "1"})
            return await error_response(exc)(scope, receive, send)
        if self.prefix:
            scope = dict(scope, path=path[len(self.prefix):] or "/",
                         root_path=scope.get("root_path", "") + self.prefix)
        return await self.app(scope, receive, send)


class ReplicaListener:
    """uvicorn on the running event loop, on a shared socket."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, sock: socket.socket):
        self.server, self.task, self.sock = server, task, sock

    @property
    def address(self) -> tuple:
        return self.sock.getsockname()[:2]

    @classmethod
    async def start(cls, app, sock: socket.socket, prefix: str, ready) -> "ReplicaListener":
        """Serve ``app`` on ``sock`` (:func:`shared_socket`, bound first thing when the replica
        starts: the port is held before the replica's other work opens connections, one of
        which the kernel could otherwise give that port as its own end)."""
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(Mounted(app, prefix, ready), lifespan="off", access_log=False, log_level="warning",
                                log_config=None, timeout_keep_alive=KEEP_ALIVE_S)
        server = uvicorn.Server(config)
        # the replica's signals stay Ray's (uvicorn takes SIGINT/SIGTERM on a main thread)
        server.capture_signals = contextlib.nullcontext
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not server.started:
            if task.done():
                task.result()          # its failure, raised here
                raise ConfigError(f"serve.port: the listener on {host}:{port} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise ConfigError(f"serve.port: the listener on {host}:{port} did not start "
                                  f"within {STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.01)
        return cls(server, task, sock)

    def stop(self) -> None:
        """Stop accepting and end once the open requests are answered (uvicorn closes the
        socket on its way out; :attr:`task` ends)."""
        self.server.should_exit = True

    async def drain(self, timeout_s: float) -> bool:
        """:meth:`stop`, then wait up to ``timeout_s`` for the requests in flight (streams
        included) to finish, as Serve's proxy waits for a stopping replica's requests;
        whether they all did (if not, their connections are closed)."""
        self.stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
            return True
        except asyncio.TimeoutError:
            self.server.force_exit = True
            return False
