"""A Ray cluster of two raylets on 127.0.0.1 (``ray.cluster_utils.Cluster``) for the
multi-node tests, offline and online."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ray.cluster_utils import Cluster

# Where a bare ray.init() looks for the cluster to join (Ray's default temp dir). Cluster
# writes its address there even with a temp_dir of its own, and fails if the directory is
# missing: on a fresh machine, before any Ray ran with the default temp dir.
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


@contextlib.contextmanager
def two_raylets(prefix: str, head: dict, worker: dict) -> Iterator[Cluster]:
    """A head raylet with ``head``'s arguments and a worker raylet (``cluster.worker``)
    with ``worker``'s, under a temp dir of their own (short: Ray's socket paths live in
    it); shut down and removed on exit."""
    temp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    CURRENT_CLUSTER.parent.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        node_ip_address="127.0.0.1", include_dashboard=False, temp_dir=temp, **head))
    try:
        cluster.worker = cluster.add_node(node_ip_address="127.0.0.1", **worker)
        # no other process on this machine joins this cluster by accident
        if CURRENT_CLUSTER.exists() and CURRENT_CLUSTER.read_text().strip() == cluster.address:
            CURRENT_CLUSTER.unlink()
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
