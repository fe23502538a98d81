"""LeMix's scheduling, shared by the simulator and the live runtime: task planning (Alg. 1),
allocation (eq. 1-4), the cluster scheduler, node schedulers (Alg. 2, 3), their events and
commands, the stage rules, and the policy interface (no Ray, no clock).
"""
