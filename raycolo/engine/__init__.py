"""LLM engines behind one interface (:class:`raycolo.engine.base.Engine`)."""
from raycolo.engine.base import (Engine, EngineConfig, EngineKwargs, IterationRecord,
                                  ModelLoadingConfig, RequestOutput, SamplingParams)
from raycolo.engine.factory import create_engine

__all__ = ["Engine", "EngineConfig", "EngineKwargs", "IterationRecord", "ModelLoadingConfig",
           "RequestOutput", "SamplingParams", "create_engine"]
