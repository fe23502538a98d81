"""The process group a rank waits on while its replica or node idles.

A gloo receive fails once it has waited its group's timeout: 30 minutes by default,
Ray Train's ``TorchConfig.timeout_s`` for a stage worker's group, and raycolo's own
collective timeout for tensor-parallel ranks (2 minutes). A rank that waits for its
next instruction waits as long as nobody sends work, which has no bound: a warm-pooled
replica, a DAG's later stage, an online node with no requests. Such a wait on the
group of the computation failed once the idle time passed that timeout, and the
replica or node started over for nothing (reproduced for tensor-parallel followers
after 2 minutes, and for a node's stages after the group's timeout: tests shorten it).

So the instructions travel on a group of their own, made here, whose timeout is a week;
the computation's tensors keep their group and its timeout. A rank whose peer died is
not left waiting on it: the peer's process ending closes its sockets (gloo fails the
receive at once), and a process that hangs or a node that vanishes is seen by the
rank's host (Ray Train's health check; a tensor-parallel replica's collectives).

Pure torch: no Ray.
"""
from __future__ import annotations

import datetime

IDLE_TIMEOUT_S = 7 * 24 * 3600       # how long an idle rank waits for its next instruction


def idle_group(dist):
    """A gloo group of every rank of ``dist``'s default group, with a timeout of
    :data:`IDLE_TIMEOUT_S` (a collective call: every rank makes it, once, in the same
    order as its other groups). None when ``dist`` has no group (a single process)."""
    if dist is None or not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
