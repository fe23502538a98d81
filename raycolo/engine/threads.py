"""The torch engine's CPU thread policy (docs/executor.md, "Threads").

* ``engine_kwargs.cpu_threads`` set: exactly that many intra-op threads.
* Unset: ``OMP_NUM_THREADS`` when the environment sets it (Ray sets it to an actor's
  ``num_cpus``), else one thread per CPU in this process's affinity mask.

Engines that share a node must share its cores: the offline runtime gives each replica
``cpus // replicas`` threads (``runtime.threads`` overrides), never more engines' threads
than cores. OpenMP threads that wait spin on their core, so an oversubscribed node is many
times slower than one thread per engine; measured in docs/executor.md.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def default_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def apply_thread_policy(cpu_threads: Optional[int]) -> int:
    """Set torch's intra-op threads by the policy above; returns the count."""
    threads = cpu_threads or default_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
