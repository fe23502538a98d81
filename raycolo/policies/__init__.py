"""Every policy by name: the offline planners and the online allocators.

A thin home for the names the design card gives (``raycolo.policies``). The registries
live with their products: :mod:`raycolo.offline.policies` and :mod:`raycolo.online.policies`.
Nothing inside raycolo imports this module.
"""
from raycolo.offline.policies import (DEFAULT_OFFLINE_POLICY, get_policy, optimal_applies,
                                      policy_names, register)
from raycolo.online.policies import (get_online_policy, make_online_policy, online_policy_names,
                                     register_online)

__all__ = ["DEFAULT_OFFLINE_POLICY", "get_online_policy", "get_policy", "make_online_policy",
           "online_policy_names", "optimal_applies", "policy_names", "register", "register_online"]
