"""The online policy registry: name -> a factory ``(params, nodes, train_rate) ->
OnlinePolicy``. Policy modules register here; the package loads them and looks names up."""
from raycolo.name_registry import Registry

_ONLINE = Registry()
register_online = _ONLINE.register
