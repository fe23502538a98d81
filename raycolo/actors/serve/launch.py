"""Starting the HTTP front: ``raycolo serve CONFIG`` (a local cluster) and ``jobs/serve.py``
(under ``ray job submit``). ``serve run examples/serve.yaml`` needs neither: Serve imports
:func:`raycolo.actors.serve.app.build_app` itself."""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import ray

from raycolo.actors.local_cluster import NAMESPACE, controller_name, join_or_start
from raycolo.online.config import Ingress, OnlineConfig



def init_ray(config: OnlineConfig, address: Optional[str] = None,
             metrics_port: Optional[int] = None) -> tuple[bool, Optional[str]]:
    """Join ``address`` (or RAY_ADDRESS), or start a local cluster with ``nodes x stages``
    logical GPUs, the dashboard on 127.0.0.1 and metrics exported every second. Returns
    whether this process started the cluster, and the dashboard's URL."""
    started, ctx = join_or_start(address, env=config.cluster_env(), num_gpus=config.gpus_needed(),
                                 num_cpus=config.local_cpus(), include_dashboard=True, dashboard_host="127.0.0.1",
                                 log_to_driver=False, _metrics_export_port=metrics_port,
                                 _system_config={"metrics_report_interval_ms": 1000})
    return started, ctx and ctx.dashboard_url


def start(config: OnlineConfig, timeout_s: float = 600.0) -> str:
    """Deploy the front on the connected cluster; returns its URL once it answers."""
    from ray import serve

    from raycolo.actors.serve.app import build_app

    if config.serve.ingress == Ingress.REPLICA:      # the replicas listen on host:port themselves
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": config.serve.host, "port": config.serve.port})
    serve.run(build_app({"config": config}), name=config.serve.app_name,
              route_prefix=config.serve.route_prefix, blocking=False)
    prefix = config.serve.route_prefix.rstrip("/")
    return f"http://{config.serve.host}:{config.serve.port}{prefix}"


def controller_handle(config: OnlineConfig):
    """The deployment's controller actor (one per Serve app, detached, named after it)."""
    return ray.get_actor(controller_name(config.serve.app_name), namespace=NAMESPACE)


def stop(config: OnlineConfig, started_ray: bool) -> None:
    from ray import serve

    try:
        serve.delete(config.serve.app_name)
    finally:
        try:     # the deployment's controller (and its stage workers) go with the app
            controller = controller_handle(config)
            ray.get(controller.stop.remote(), timeout=120)
            ray.kill(controller)
        except (ValueError, ray.exceptions.RayError):
            pass
        if started_ray:
            serve.shutdown()
            ray.shutdown()
        else:   # a cluster we joined: Serve goes too (its HTTP proxy would answer 404 on the
            # port) unless other applications still use it
            try:
                if not serve.status().applications:
                    serve.shutdown()
            except ray.exceptions.RayError:
                pass


def serve_until_stopped(config: OnlineConfig, address: Optional[str] = None, say=print) -> int:
    """Start, print the URL, and wait for Ctrl-C (or SIGTERM, or the app being deleted with
    ``serve shutdown``); then stop cleanly."""
    from ray import serve

    started, dashboard = init_ray(config, address)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        say(f"starting {config.nodes} x {config.stages} stage workers "
            f"({config.model_loading_config.model_id}, policy {config.policy}) and the HTTP front")
        url = start(config)
        say(f"raycolo: serving '{config.served_model_name()}' at {url}/v1 (OpenAI API; Ctrl-C stops)")
        if dashboard:
            say(f"Ray dashboard: http://{dashboard}" if "://" not in dashboard else f"Ray dashboard: {dashboard}")
        sys.stdout.flush()
        while not stopped.wait(2.0):
            if config.serve.app_name not in serve.status().applications:
                say("raycolo: the application was deleted; stopping")
                break
    finally:
        say("raycolo: stopping")
        stop(config, started)
    return 0
