"""All of raycolo's Ray code: offline engine actors and controller (:mod:`.offline`), the
online controller and workers (:mod:`.online`), the Ray Serve front (:mod:`.serve`), and
the local cluster helpers shared by all three (:mod:`.local_cluster`)."""
