"""Build the engine a config names."""
from __future__ import annotations

from raycolo.engine.base import Engine, EngineConfig
from raycolo.errors import ConfigError


def create_engine(config: EngineConfig | dict, ranks=None) -> Engine:
    """Build the engine a config names (``backend``: torch or vllm). ``ranks``: how the
    torch engine starts its other tensor-parallel ranks (:class:`TorchEngine`)."""
    if isinstance(config, dict):
        config = EngineConfig.model_validate(config)
    if config.backend == "torch":
        from raycolo.engine.torch_engine import TorchEngine
        return TorchEngine(config, ranks=ranks)
    if config.backend == "vllm":
        from raycolo.engine.vllm_engine import VllmEngine
        return VllmEngine(config)
    raise ConfigError(f"backend: unknown engine backend '{config.backend}'")
