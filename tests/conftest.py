"""Shared fixtures."""
import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter (tests/engine/test_triton_attention.py).
# Triton reads the switch when it is imported and when a kernel is decorated, so it is set
# before anything can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process torch work on one thread (tiny models; keeps timings stable on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """The realistic checkpoints of tests/support/hf_checkpoints.py (llama3, qwen2, gpt2), built once
    per session: kind -> directory."""
    from tests.support.hf_checkpoints import KINDS, build_checkpoint

    root = tmp_path_factory.mktemp("hf-checkpoints")
    return {kind: build_checkpoint(kind, root / kind, seed=0) for kind in KINDS}


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    """tests/support/hf_checkpoints.py's Qwen3 checkpoint (per-head query and key norms, a
    head_dim that is not hidden_size / heads), built once per session: its directory."""
    from tests.support.hf_checkpoints import build_checkpoint

    return build_checkpoint("qwen3", tmp_path_factory.mktemp("hf-qwen3") / "qwen3", seed=0)


@pytest.fixture(scope="module")
def bpe_engines(hf_checkpoints):
    """Torch engines on the Llama 3-style and the Qwen2 checkpoints (kind -> engine), one
    pair per module."""
    from raycolo.engine import create_engine

    out = {kind: create_engine({"model_loading_config": {"model_id": str(hf_checkpoints[kind])},
                                "engine_kwargs": {"kv_cache_tokens": 4096}}) for kind in ("llama3", "qwen2")}
    yield out
    for e in out.values():
        e.release()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test past its timeout (pytest-timeout's ``timeout`` in pyproject.toml) fails by a
    signal, which a thread blocked in C (a ``ray.get`` with no timeout) never sees. Half
    as long again, the run ends with every thread's stack on stderr rather than stalling
    a CI run until it is killed with nothing said."""
    import faulthandler
    import sys

    try:
        limit = float(item.config.getini("timeout") or 0)
    except ValueError:       # pytest-timeout is not installed: no limit
        limit = 0.0
    if limit > 0:     # to the stderr pytest's own faulthandler keeps (the captured one is lost)
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        out = item.config.stash.get(fault_handler_stderr_fd_key, None)
        faulthandler.dump_traceback_later(1.5 * limit, exit=True, file=out if out is not None else sys.__stderr__)
    try:
        return (yield)
    finally:
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()


_EXIT = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's own exit status once every report is written, without the
    interpreter's teardown: a fresh-clone run (814 passed) once died there with SIGSEGV,
    after the summary, as the threads that Ray's driver and torch leave behind were torn
    down, and make took the crash for a failed suite. Only where pytest is the program
    (``pytest``, ``python -m pytest``): a tool that runs pytest in its own process, as
    mutmut does for every mutant, must get control back."""
    import os
    import sys

    program = sys.argv[0] if sys.argv else ""
    by_pytest = (os.path.basename(program).startswith(("pytest", "py.test"))
                 or os.path.basename(os.path.dirname(program)) == "pytest")
    if "status" in _EXIT and by_pytest:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])
