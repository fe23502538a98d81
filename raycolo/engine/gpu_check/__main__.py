"""``python -m raycolo.engine.gpu_check``, the old spelling of ``python -m raycolo.gpu_check``.

The checks moved to :mod:`raycolo.gpu_check`: they check the CUDA paths of the engine and of
the online stages, so they sit above both (the engine imports neither product). This runs
them by name, so the engine package still imports nothing above it.
"""
import runpy

runpy.run_module("raycolo.gpu_check", run_name="__main__", alter_sys=True)
