"""Ray actors of raycolo (installed as ``raycolo.actors``): engine replicas and the
controller that runs an application's plan on them."""
