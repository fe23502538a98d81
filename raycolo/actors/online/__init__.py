"""Ray actors of the online product: the online controller, node workers and stage workers
(Ray Train), adapters, reports and the launcher.
"""
