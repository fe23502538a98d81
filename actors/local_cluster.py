"""The private local Ray cluster raycolo starts when it is given no cluster to join.

It listens on loopback only. Ray binds its services (GCS, raylet, object manager, core
workers, agents) to the node's address; on macOS and Windows Ray's single-machine mode
makes that address 127.0.0.1, and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects the
same mode on Linux (ray/_private/ray_constants.py and services.get_node_ip_address).
raycolo sets it for the clusters it starts, unless the variable is already set (set it
to 1 to let other machines join a cluster you started with raycolo). Ray reads the
variable when ``ray._private.ray_constants`` is imported; if Ray was imported before,
the constant is updated to match (a private constant: checked by the socket test in
tests/test_serve.py). Joining a cluster (``--address``, ``ray job submit``) changes
nothing: its addresses are the cluster's.

Its GCS keeps the events of the last ``TASK_EVENTS_KEPT`` tasks (the dashboard's task
list and timeline), not Ray's default 100,000: a service runs a few tasks per request,
and under the default the GCS grew by 162 MB in a 30-minute soak (README, Reliability). A cluster you start yourself takes the same bound from
``RAY_task_events_max_num_task_in_gcs`` (an environment variable of ``ray start``).
"""
from __future__ import annotations

import os

import ray

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
TASK_EVENTS_KEPT = 10_000      # tasks whose events the GCS keeps (Ray's default: 100,000)


def start_local(**kwargs):
    """``ray.init(address="local", **kwargs)`` on loopback only; returns Ray's context."""
    os.environ.setdefault(LOOPBACK_ENV, "0")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = os.environ[LOOPBACK_ENV].lower() in ("1", "true")
    kwargs["_system_config"] = {"task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT,
                                **(kwargs.get("_system_config") or {})}
    return ray.init(address="local", **kwargs)
