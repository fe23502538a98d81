"""Ray actors of the offline product: engine replicas, their pool, the controller that runs a
plan on them, and the launcher.
"""
