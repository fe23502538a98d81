"""Continuous batching, one rule for every world: the block allocator, the FCFS step
scheduler (vLLM v1's policy) and a replica's limits. The offline simulators and the torch
engine both call it (no Ray, no torch)."""
