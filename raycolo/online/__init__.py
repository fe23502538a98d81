"""Online co-location of serving and retraining: the LeMix scheduler and a cluster simulator (pure Python, no Ray)."""
