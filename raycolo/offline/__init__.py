"""The offline product: application graphs and workloads, the cost model, the continuous-
batching simulators, the SamuLLM planner and its policies, run setup (pure Python, no Ray).
Ray actors that execute a plan live in :mod:`raycolo.actors.offline`.
"""
