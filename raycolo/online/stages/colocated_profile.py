"""Co-located decode iterations, as a raycolo stage runs them under time shares: the
samples of stage 2 of Harli's decode predictor (:mod:`raycolo.latency_predictor`).

``raycolo profile`` passes :func:`measure_colocated` to
:func:`raycolo.offline.profiler.profile_model` (the profiler, part of the offline product,
does not import the online one; the CLI wires the two).
"""
from __future__ import annotations

import time

import numpy as np

from raycolo.catalog import model_spec
from raycolo.latency_predictor import DecodeSample
from raycolo.rng import random_prompts, seeded_rng

COLOCATED_BATCHES = (1, 4, 16)
COLOCATED_CONTEXTS = (16, 128)
COLOCATED_FINETUNE = ((1, 32), (2, 64), (4, 96))      # fine-tune ops: samples x tokens


def measure_colocated(model_id: str, seed: int, device: str, max_batch: int, dtype: str = "float32",
                      repeats: int = 3) -> list[DecodeSample]:
    """A whole-model stage with LoRA runs a fine-tune op (forward and backward of a
    micro-batch) and then a decode iteration of ``bs`` requests (``bs`` of
    COLOCATED_BATCHES up to ``max_batch``) at context ``seqlen``. Each gives a
    :class:`DecodeSample` whose latency is the period (fine-tune op plus the decode
    iteration after it) and whose shares are the solo decode's and the fine-tune op's parts
    of the solo-time period; the solo iteration timed before each is a sample too. Harli's
    stage 2 then fits the interference (caches and memory traffic the fine-tune op leaves
    behind). The model is loaded in ``dtype``; on a GPU every timing waits for the
    device."""
    import torch

    from raycolo.engine.models import load_model
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora, training_batch

    model, _ = load_model(model_id, seed=seed, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def _timed(fn) -> float:
        sync()
        started = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - started

    layers = model.config.num_hidden_layers
    # decoding as the stage workers serve it: with CUDA graphs on a GPU (eager there, the
    # launch overhead would hide what the fine-tune op does to the decode after it; the
    # executor captures only on CUDA)
    stage = StageModel(add_lora(model, LoraSettings(seed=seed)), (0, layers), 4096, 16, cuda_graphs=True)
    rng = seeded_rng(seed, "profile", model_id, "colocated")
    vocab = model_spec(model_id).vocab
    out, rid, task = [], 0, 0
    for bs in [b for b in COLOCATED_BATCHES if b <= max_batch]:
        for ctx in COLOCATED_CONTEXTS:
            requests = list(range(rid, rid + bs))
            rid += bs
            with torch.no_grad():
                stage.forward(requests, random_prompts(rng, bs, ctx, vocab))
            _decode(stage, requests, rng, vocab)     # untimed: a first step of this batch captures its graph
            for samples, tokens in COLOCATED_FINETUNE:
                pairs = [(p[: tokens // 2], p[tokens // 2:]) for p in random_prompts(rng, samples, tokens, vocab)]
                ids, labels, lengths = training_batch(pairs)
                for _ in range(repeats):
                    solo = _timed(lambda: _decode(stage, requests, rng, vocab))
                    task += 1
                    ft = _timed(lambda: (stage.train_forward(task, ids, lengths, labels),
                                         stage.train_backward(task, step=False)))
                    after = _timed(lambda: _decode(stage, requests, rng, vocab))
                    share = solo / (solo + ft)
                    seqlen = float(np.mean([stage.contexts[r] for r in requests]))
                    out.append(DecodeSample(bs, seqlen - 1, solo))
                    out.append(DecodeSample(bs, seqlen, ft + after, share, 1.0 - share))
            for r in requests:
                stage.release(r)
    if stage.optimizer is not None:
        stage.optimizer.zero_grad(set_to_none=True)   # nothing is applied: the gradients go
    return out


def _decode(stage, requests, rng, vocab) -> None:
    import torch

    with torch.no_grad():
        stage.forward(requests, [[int(t)] for t in rng.integers(3, vocab, len(requests))])

