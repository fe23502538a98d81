"""raycolo: multi-LLM planning and serving on Ray.

The modules directly under ``raycolo`` (catalog, hardware, dag, workload, costmodel,
sim, planner) are pure Python: they never import Ray. Ray-facing code lives in
``raycolo.actors`` and ``jobs/``.
"""

__version__ = "0.1.0"

# In a source tree (``ray job submit --working-dir .`` puts the tree first on the path),
# ``raycolo.actors`` and ``raycolo.policies`` live beside this package, in ``actors/`` and
# ``policies/`` (pyproject.toml maps them when installed): let the package find them there.
import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "actors")) and \
        _os.path.isfile(_os.path.join(_root, "actors", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
