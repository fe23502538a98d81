"""LLM engines behind one interface (:class:`raycolo.engines.base.Engine`)."""
from raycolo.engines.base import (Engine, EngineConfig, EngineKwargs, IterationRecord,
                                  ModelLoadingConfig, RequestOutput, SamplingParams, create_engine)

__all__ = ["Engine", "EngineConfig", "EngineKwargs", "IterationRecord", "ModelLoadingConfig",
           "RequestOutput", "SamplingParams", "create_engine"]
