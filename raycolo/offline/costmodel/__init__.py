"""Cost model: output-length sampling, per-iteration latency, load times."""
from raycolo.offline.costmodel.latency import IterationLatency, LatencyProfile, default_profile
from raycolo.offline.costmodel.length_sampler import OutputLengthSampler

__all__ = ["IterationLatency", "LatencyProfile", "OutputLengthSampler", "default_profile"]
