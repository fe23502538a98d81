"""Continuous-batching simulators of vLLM's FCFS scheduler (no Ray, no torch).

``fast.simulate`` skips between events in closed form; ``reference.simulate`` steps one
iteration at a time and exists to check the fast one. Both implement the policy in
``docs/simulator.md`` and take the same inputs.
"""
from raycolo.offline.sim.types import ReplicaWorkload, SimResult
from raycolo.batching.limits import SchedulerLimits, kv_block_capacity

__all__ = ["ReplicaWorkload", "SchedulerLimits", "SimResult", "kv_block_capacity"]
