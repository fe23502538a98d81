"""The torch engine's test cases (tests/engine/test_engine*.py): the tiny model, its prompts,
transformers' greedy decoding as the reference, a deadline for a stuck engine, and the
engines built once per module (pytest fixtures: a test module imports them).
"""
from __future__ import annotations

import contextlib
import signal

import pytest
import torch

from raycolo.engine import SamplingParams, create_engine
from raycolo.engine.models import (BOS_ID, ByteTokenizer, build_tiny_model)


MODEL = "tiny-llama-s"
SEED = 0


def make_engine(model_id: str = MODEL, dtype: str = "float64", seed: int = SEED, **engine_kwargs):
    return create_engine({"model_loading_config": {"model_id": model_id, "seed": seed, "dtype": dtype},
                          "engine_kwargs": engine_kwargs})


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine
    OpenMP spin-waiting makes them many times slower; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def deadline(seconds: int = 60):
    """Turn an engine that never finishes (e.g. a scheduler stuck idle) into a failure."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"the engine did not finish within {seconds} s (stuck scheduler?)")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def generate(engine, prompts, params):
    with deadline():
        return engine.generate(prompts, params)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding of ``n`` tokens, EOS disabled so the length is fixed."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                           bos_token_id=BOS_ID)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def total_new_tokens(iterations) -> int:
    return sum(r.new_tokens for r in iterations)


TOK = ByteTokenizer(512)
# Different lengths on purpose: the decode batch is left-padded to the longest.
PROMPTS = [TOK.encode(s) for s in ("Hi", "The quick brown fox jumps", "raycolo batches requests, "
                                   "one iteration at a time.")]
MAX_TOKENS = [16, 12, 14]  # the batch shrinks as requests finish


# -- engines built once per module ------------------------------------------------------
@pytest.fixture(scope="module")
def e64():
    engine = make_engine(dtype="float64")
    yield engine
    engine.release()


@pytest.fixture(scope="module")
def ref64():
    model, _ = build_tiny_model(MODEL, SEED, "float64")
    return model


@pytest.fixture(scope="module")
def greedy64(e64):
    """Greedy outputs of PROMPTS, run together in the float64 engine."""
    start = len(e64.stats.iterations)
    outs = generate(e64, PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return outs, e64.stats.iterations[start:]
