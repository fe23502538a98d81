"""The private local Ray cluster raycolo starts when it is given no cluster to join.

It listens on loopback only. Ray binds its services (GCS, raylet, object manager, core
workers, agents) to the node's address; on macOS and Windows Ray's single-machine mode
makes that address 127.0.0.1, and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects the
same mode on Linux (ray/_private/ray_constants.py and services.get_node_ip_address).
raycolo sets it for the clusters it starts, unless the variable is already set (set it
to 1 to let other machines join a cluster you started with raycolo). Ray reads the
variable when ``ray._private.ray_constants`` is imported; if Ray was imported before,
the constant is updated to match (a private constant: checked by the socket test in
tests/serve/deployment/test_deployment_faults.py).

Joining a cluster (``--address``, ``ray job submit``) goes through :func:`join_cluster`:
the cluster's addresses are its own, but a cluster bound to loopback needs this process
in the same single-machine mode, and an address nothing answers at fails at once
(tests/offline/test_multinode.py).

Its GCS keeps the events of the last ``TASK_EVENTS_KEPT`` tasks (the dashboard's task
list and timeline), not Ray's default 100,000: a service runs a few tasks per request,
and under the default the GCS grew by 162 MB in a 30-minute soak (docs/benchmarks.md, Reliability). A cluster you start yourself takes the same bound from
``RAY_task_events_max_num_task_in_gcs`` (an environment variable of ``ray start``).

A call to an actor whose process died fails once the GCS says why, or after
``DEATH_INFO_WAIT_MS``: Ray's default is 1,000 ms, and a call made while Ray restarts the
actor waits as long before it is refused. The online deployment's replicas and nodes
carry on without their controller while Ray restarts it (docs/online-live.md), so they
must learn of its death soon: at Ray's default the first of them knew 1.15-1.34 s after
``ray.kill``, at 100 ms 0.13-0.35 s (this 2-core VM, 2026-11-29). A cluster you start
yourself takes it from ``RAY_timeout_ms_task_wait_for_death_info``.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Optional

import ray

from raycolo.errors import ConfigError

NAMESPACE = "raycolo"          # the Ray namespace of every named actor raycolo starts
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
TASK_EVENTS_KEPT = 10_000      # tasks whose events the GCS keeps (Ray's default: 100,000)
DEATH_INFO_WAIT_MS = 100       # a call to a dead actor fails after at most this (Ray's default: 1,000)


def start_local(env: Optional[dict] = None, **kwargs):
    """``ray.init(address="local", **kwargs)`` on loopback only; returns Ray's context.
    ``env``: variables the cluster's processes start with (the raylet and every worker it
    spawns inherit them), unless this process sets them already; this process's own
    environment is as before once the cluster is up."""
    os.environ.setdefault(LOOPBACK_ENV, "0")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = os.environ[LOOPBACK_ENV].lower() in ("1", "true")
    kwargs["_system_config"] = {"task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT,
                                "timeout_ms_task_wait_for_death_info": DEATH_INFO_WAIT_MS,
                                **(kwargs.get("_system_config") or {})}
    added = [k for k in (env or {}) if k not in os.environ]
    os.environ.update({k: env[k] for k in added})
    try:
        return ray.init(address="local", **kwargs)
    finally:
        for k in added:
            os.environ.pop(k, None)


# -- joining a cluster ----------------------------------------------------------------------
CONNECT_TIMEOUT_S = 3.0   # the TCP probe of a cluster's GCS before ray.init, per address tried


def _reachable(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _single_machine_mode(on: bool) -> None:
    """Ray's single-machine mode (its node address is loopback) on or off in this process:
    the variable for processes started from here, the constant Ray already read."""
    from ray._private import ray_constants

    if on:
        os.environ[LOOPBACK_ENV] = "0"
    elif os.environ.get(LOOPBACK_ENV, "").lower() not in ("", "1", "true"):
        os.environ[LOOPBACK_ENV] = "1"
    ray_constants.ENABLE_RAY_CLUSTER = not on


def resolve_cluster_address(address: Optional[str], flag: str = "--address") -> str:
    """The ``HOST:PORT`` of the GCS to join, checked to answer within ``CONNECT_TIMEOUT_S``.

    ``address`` (else ``RAY_ADDRESS``) is ``HOST:PORT``, ``ray://HOST:PORT`` (Ray Client,
    returned as given) or ``auto`` (``RAY_ADDRESS``, the last ``ray start`` on this machine,
    or a running GCS, as Ray looks them up). Ray rewrites a loopback host to the machine's
    outward address (``services.canonicalize_bootstrap_address`` calls
    ``resolve_ip_for_localhost``, unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off): right
    for a cluster bound there, a hang for one bound to 127.0.0.1 (``ray start
    --node-ip-address 127.0.0.1`` with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, or
    ``ray.cluster_utils.Cluster``). So for a loopback host this probes the outward address
    first and keeps Ray's rewrite if the GCS answers there; else, if it answers on loopback,
    this process joins in Ray's single-machine mode (node address 127.0.0.1, so the driver
    also finds the raylets registered on 127.0.0.1). Nothing answering is a
    :class:`ConfigError` naming ``flag``."""
    from ray._common.network_utils import is_localhost, node_ip_address_from_perspective, parse_address

    given = address or os.environ.get("RAY_ADDRESS") or ""
    where = flag if address else f"{flag} (RAY_ADDRESS)"
    raw = given.strip()
    if raw in ("", "auto"):
        from ray._private import services
        try:
            raw = services.get_ray_address_from_environment("auto", None) or ""
        except ConnectionError:
            raw = ""
        if not raw:
            raise ConfigError(f"{where}: no running Ray cluster found for '{given or 'auto'}'; "
                              "start one with 'ray start --head' or give HOST:PORT")
    client = raw.startswith("ray://")
    parsed = parse_address(raw.removeprefix("ray://"))
    if parsed is None or not parsed[1].isdigit() or not 0 < int(parsed[1]) < 65536:
        raise ConfigError(f"{where}: expected HOST:PORT (or ray://HOST:PORT, auto), got '{raw}'")
    host, port = parsed[0], int(parsed[1])
    if client:
        if not _reachable(host, port):
            raise ConfigError(f"{where}: nothing answers at {raw} within {CONNECT_TIMEOUT_S:g}s "
                              "(is the Ray Client server running?)")
        return raw
    if is_localhost(host):
        outward = node_ip_address_from_perspective(None)
        if outward and not is_localhost(outward) and _reachable(outward, port):
            _single_machine_mode(False)
            return f"{outward}:{port}"
        if _reachable("127.0.0.1", port):
            _single_machine_mode(True)
            return f"127.0.0.1:{port}"
    elif _reachable(host, port):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raise ConfigError(f"{where}: no Ray cluster answers at {raw} within {CONNECT_TIMEOUT_S:g}s "
                      "(start it with 'ray start --head', or check the GCS port)")


def join_cluster(address: Optional[str] = None, flag: str = "--address", **init_kwargs):
    """Join the cluster at ``address`` (else ``RAY_ADDRESS``; ``auto``): every place raycolo
    joins a cluster goes through here (``raycolo run/serve/online run --address``,
    ``jobs/run_dag.py`` and ``jobs/serve.py`` under ``ray job submit``). The address is
    resolved and probed by :func:`resolve_cluster_address` (fails within seconds, naming
    ``flag``), then ``ray.init(address=..., **init_kwargs)``; returns Ray's context."""
    target = resolve_cluster_address(address, flag)
    try:
        return ray.init(address=target, **init_kwargs)
    except ConnectionError as exc:
        raise ConfigError(f"{flag}: cannot join the Ray cluster at {target}: {exc}") from None


def join_or_start(address: Optional[str] = None, env: Optional[dict] = None, **kwargs) -> tuple[bool, Any]:
    """The cluster at ``address`` if one is given, else a private local one
    (:func:`start_local` with ``env`` and ``kwargs``, which also go to ``ray.init`` when
    joining, less the local-only ones); in raycolo's namespace. Returns (whether this
    process started the cluster, Ray's context); nothing when Ray is already up."""
    if ray.is_initialized():
        return False, None
    kwargs.setdefault("namespace", NAMESPACE)
    if address:
        joined = {k: v for k, v in kwargs.items() if k in ("namespace", "log_to_driver", "runtime_env")}
        return False, join_cluster(address, **joined)
    return True, start_local(env=env, **kwargs)


def controller_name(app_name: str) -> str:
    """The online controller actor of the Serve application ``app_name``."""
    return f"raycolo-online-{app_name}"
