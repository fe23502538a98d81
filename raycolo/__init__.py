"""raycolo: multi-LLM planning and serving on Ray.

The two products and the line between pure code and Ray (docs/layout.md):

* :mod:`raycolo.offline`: application graphs, workloads, cost model, simulators, the
  SamuLLM planner and its policies;
* :mod:`raycolo.online`: tasks, profiles, LeMix scheduling, online policies, the simulator,
  the HTTP front's pure parts;
* :mod:`raycolo.engine`: engines and the model executor;
* shared modules: catalog, hardware, bounds, errors, lengths, kv_bytes, rng, generation,
  batching.

None of these import Ray. All Ray code is in :mod:`raycolo.actors`; the ``raycolo``
command in :mod:`raycolo.cli` wires both.
"""

__version__ = "0.1.0"
