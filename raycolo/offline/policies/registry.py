"""The offline policy registry: name -> ``plan(problem, **options) -> AppPlan``. Policy
modules register here; the package loads them and looks names up."""
from raycolo.name_registry import Registry

_REGISTRY = Registry()
register = _REGISTRY.register
