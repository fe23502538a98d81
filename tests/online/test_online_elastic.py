"""SIRIUS's elastic micro-batches live: a 1 x 2 deployment of tiny-llama-s whose stages
have too little memory for a whole training task. The node scheduler splits the task
into micro-batches that fit, the stage workers accumulate their gradients apart from
everything else and step once, and the adapter comes out as one unsplit step on the
same samples would leave it (computed here on a local pipeline of the same stages)."""
from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from tests.support.online_checks import small_online_config
from raycolo.actors.online.launch import OnlineDeployment
from raycolo.engine.models import build_tiny_model
from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora, training_batch

MODEL = "tiny-llama-s"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    config = small_online_config(
        out, nodes=1, stages=2, model=MODEL, policy="sirius", train_rate=0.5,
        lora={"micro_batch": 4, "checkpoint_every": 100},
        # the smallest budget there is (twice the stage's weights): a task of 4 samples of
        # ~100 tokens does not fit under the threshold, one sample does
        stage={"kv_cache_tokens": 2048, "memory_bytes": 1})
    ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False,
             namespace="raycolo")
    dep = OnlineDeployment.start(config, timeout_s=240)
    yield dep, config, out
    try:
        dep.stop()
    finally:
        ray.shutdown()


def _samples():
    g = torch.Generator().manual_seed(21)
    return [([1] + torch.randint(3, 200, (n,), generator=g).tolist(), torch.randint(3, 200, (m,), generator=g).tolist())
            for n, m in ((96, 6), (90, 9), (99, 4), (93, 7))]


def test_a_task_too_big_for_memory_trains_in_micro_batches_like_one_step(deployment, tmp_path):
    dep, config, _ = deployment
    samples = _samples()
    ack = dep.add_samples(samples)
    rid = dep.submit([1, 50, 51, 52], max_tokens=4, ignore_eos=True)      # inference alongside
    assert dep.train() is not None
    assert len(list(dep.stream(rid))) == 4
    dep.drain()
    summary = dep.metrics().summary()
    assert summary["training_splits"] >= 1 and summary["train_done"] == 1
    assert {s: n for s, n in dep.sample_ledger()["trained"].items() if s in ack["ids"]} == {s: 1 for s in ack["ids"]}
    assert dep.stats()["errors"] == []

    # the reference: one unsplit step of the same 4 samples on a local pipeline of the same stages
    lora = LoraSettings(rank=4, alpha=8, lr=0.01, seed=config.model_loading_config.seed)
    chain = []
    for first, last in ((0, 1), (1, 2)):
        model, _ = build_tiny_model(MODEL, config.model_loading_config.seed, "float32")
        chain.append(StageModel(add_lora(model, lora), (first, last), 64, 16, lr=lora.lr))
    ids, labels, lengths = training_batch(samples)
    x = chain[0].train_forward(0, ids, lengths)
    chain[1].train_forward(0, x, lengths, labels)
    chain[0].train_backward(0, chain[1].train_backward(0))
    from safetensors.torch import load_file
    live = load_file(Path(dep.export_adapter(str(tmp_path / "live"), node=0)) / "adapter_model.safetensors")
    reference = {k: v for st in chain for k, v in st.lora_state().items()}
    assert set(live) == set(reference)
    moved = 0
    for key, value in reference.items():
        torch.testing.assert_close(live[key], value, rtol=1e-4, atol=1e-6)
        moved += int(not torch.equal(value, torch.zeros_like(value)) and "lora_B" in key)
    assert moved > 0                                          # the step did move the adapter
