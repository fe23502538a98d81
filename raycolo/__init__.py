"""raycolo: multi-LLM planning and serving on Ray.

The modules directly under ``raycolo`` (catalog, hardware, dag, workload, costmodel,
sim, planner) are pure Python: they never import Ray. Ray-facing code lives in
``raycolo.actors`` and ``jobs/``.
"""

__version__ = "0.1.0"
