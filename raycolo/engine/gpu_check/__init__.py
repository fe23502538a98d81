"""The old spelling of :mod:`raycolo.gpu_check` (``python -m raycolo.engine.gpu_check``; see __main__)."""
