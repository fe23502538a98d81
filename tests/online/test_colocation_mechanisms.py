"""Co-location mechanisms shared by the simulator and the live runtime (issue 12):
Harli's decode-latency predictor, the DPO loss and MACE's
alignment metrics, gradient accumulation and aborted micro-batches on a real stage."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raycolo.online.stages.losses import IGNORE_INDEX, dpo_loss, preference_stats, sequence_logprob
from raycolo.latency_predictor import DecodeLatencyPredictor, DecodeSample, fit, mape


# -- Harli's two-stage predictor ------------------------------------------------------------------
TRUE = DecodeLatencyPredictor(b0=2e-4, c0=6e-3, k0=3e-7, b1=1.05, k1=0.35)


def synthetic(n, seed, noise=0.0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        bs, seqlen = int(rng.integers(1, 257)), float(rng.integers(16, 4096))
        if i % 3:
            share = float(rng.choice([0.3, 0.5, 0.7, 0.9]))
            latency = TRUE.colocated(bs, seqlen, share, 1 - share)
            sample = DecodeSample(bs, seqlen, 0.0, share, 1 - share)
        else:
            latency = TRUE.solo(bs, seqlen)
            sample = DecodeSample(bs, seqlen, 0.0)
        latency *= 1 + noise * rng.standard_normal()
        out.append(DecodeSample(sample.bs, sample.seqlen, latency, sample.share_inference, sample.share_finetune))
    return out


def test_predictor_fit_recovers_known_coefficients_and_reports_held_out_error():
    model = fit(synthetic(300, 0))
    for name in ("b0", "c0", "k0", "b1", "k1"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    noisy = fit(synthetic(300, 1, noise=0.03))
    held_out = synthetic(200, 2, noise=0.03)
    assert 0.015 < mape(noisy, held_out) < 0.04          # the noise, not the model, sets the error
    assert mape(model, synthetic(50, 3)) < 1e-9


def test_predictor_decision_is_the_smallest_share_that_meets_the_target():
    bs, seqlen = 64, 1000
    solo = TRUE.solo(bs, seqlen)
    # by hand: colocated = (s*1.05 + (1-s)*0.35) * solo / s
    by_hand = {s: (s * 1.05 + (1 - s) * 0.35) * solo / s for s in (0.5, 0.6, 0.7)}
    target = by_hand[0.6] * 1.0001
    assert by_hand[0.5] > target >= by_hand[0.6]
    assert TRUE.smallest_share(bs, seqlen, target) == pytest.approx(0.6)
    assert TRUE.smallest_share(bs, seqlen, solo * 0.99) is None        # pause fine-tuning
    assert TRUE.smallest_share(bs, seqlen, solo) == pytest.approx(1.0)   # the whole device, alone


def test_predictor_fit_errors_are_clear():
    with pytest.raises(ValueError, match="at least 3 solo"):
        fit([DecodeSample(1, 10, 0.01)])
    with pytest.raises(ValueError, match="two batch sizes"):
        fit([DecodeSample(8, 10, 0.01)] * 5)


# -- DPO and MACE's metrics ------------------------------------------------------------------------------
def test_dpo_loss_against_a_hand_computed_value():
    # margin = (-4 - -5) - (-6 - -5.5) = 1.5; beta 0.2 -> -log sigmoid(0.3)
    loss = dpo_loss(torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.5]), beta=0.2)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-0.3)), rel=1e-6)
    # equal policy and reference: log 2
    assert float(dpo_loss(*[torch.tensor([-3.0, -1.0])] * 4)) == pytest.approx(math.log(2))
    stats = preference_stats(torch.tensor([-1.0, -5.0, -2.0]), torch.tensor([-2.0, -3.0, -2.5]))
    assert stats["win_rate"] == pytest.approx(2 / 3) and stats["clpd"] == pytest.approx((1 - 2 + 0.5) / 3)


def test_sequence_logprob_sums_the_labelled_tokens():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]]]))
    labels = torch.tensor([[IGNORE_INDEX, 1, 2]])          # p(1 | t0) = 0.25, p(2 | t0 t1) = 0.3
    assert float(sequence_logprob(logits, labels)) == pytest.approx(math.log(0.25) + math.log(0.3), rel=1e-6)


# -- gradient accumulation and aborted micro-batches on a real stage -------------------------------------
def _stage():
    from raycolo.engine.models import build_tiny_model
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora

    model, _ = build_tiny_model("tiny-llama-s", 0, "float64")
    model = add_lora(model, LoraSettings(rank=4, alpha=8, lr=0.05))
    return StageModel(model, (0, model.config.num_hidden_layers), 64, 4, lr=0.05)


def _pairs(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 200, (int(n),), generator=g).tolist(), torch.randint(3, 200, (int(m),), generator=g).tolist())
            for n, m in ((5, 4), (9, 3), (6, 6), (4, 2))]


def test_accumulated_micro_batches_give_the_full_batch_update():
    from raycolo.online.stages.stage_model import training_batch

    pairs = _pairs(1)
    full, acc = _stage(), _stage()
    ids, labels, lengths = training_batch(pairs)
    full.train_forward(1, ids, lengths, labels)
    full.train_backward(1)
    tokens = [len(c) for _, c in pairs]
    halves = [pairs[:1], pairs[1:]]                       # unequal micro-batches
    for task, part in enumerate(halves):
        ids, labels, lengths = training_batch(part)
        share = sum(len(c) for _, c in part) / sum(tokens)
        acc.train_forward(10 + task, ids, lengths, labels, loss_scale=share)
        acc.train_backward(10 + task, step=False)
    acc.optimizer_step()
    for key, value in full.lora_state().items():
        torch.testing.assert_close(acc.lora_state()[key], value, rtol=0, atol=1e-12)
    assert full.steps == acc.steps == 1


def test_a_tasks_micro_batches_accumulate_apart_from_other_tasks_steps():
    """Two micro-batches of one task (a group) with another task's optimizer step between
    their backwards: the other step neither applies nor clears the group's gradients, and
    the result equals the other task's step followed by the whole task's, unsplit."""
    pairs, other = _pairs(5), _pairs(6)[:2]
    ref, split = _stage(), _stage()
    ref.train_forward(1, *_batch(pairs))
    ref.train_forward(2, *_batch(other))
    ref.train_backward(2)
    ref.train_backward(1)
    tokens = sum(len(c) for _, c in pairs)
    parts = [pairs[:3], pairs[3:]]
    for k, part in enumerate(parts):
        split.train_forward(10 + k, *_batch(part), loss_scale=sum(len(c) for _, c in part) / tokens)
    split.train_forward(2, *_batch(other))
    split.train_backward(10, step=False, group=1)
    split.train_backward(2)                                   # another task steps in between
    split.train_backward(11, step=True, group=1)
    for key, value in ref.lora_state().items():
        torch.testing.assert_close(split.lora_state()[key], value, rtol=0, atol=1e-12)
    assert ref.steps == split.steps == 2 and not split._groups


def _batch(pairs):
    from raycolo.online.stages.stage_model import training_batch

    ids, labels, lengths = training_batch(pairs)
    return ids, lengths, labels


def test_an_aborted_micro_batch_leaves_adapter_optimizer_and_gradients_untouched():
    from raycolo.online.stages.stage_model import training_batch

    stage = _stage()
    ids, labels, lengths = training_batch(_pairs(2))
    stage.train_forward(1, ids, lengths, labels)
    stage.train_backward(1)                                 # one real step: AdamW has state
    ids, labels, lengths = training_batch(_pairs(3)[:2])
    stage.train_forward(2, ids, lengths, labels)
    stage.train_backward(2, step=False)                     # accumulated, not applied
    before = {k: v.clone() for k, v in stage.lora_state().items()}
    grads = {n: p.grad.clone() for n, p in stage.model.named_parameters() if p.grad is not None}
    opt = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
           for k, v in stage.optimizer.state_dict()["state"].items()}
    ids, labels, lengths = training_batch(_pairs(4))
    stage.train_forward(3, ids, lengths, labels)             # then aborted (memory handed over)
    stage.drop_training(3)
    assert all(torch.equal(v, stage.lora_state()[k]) for k, v in before.items())
    now = {n: p.grad for n, p in stage.model.named_parameters() if p.grad is not None}
    assert grads.keys() == now.keys() and all(torch.equal(grads[n], now[n]) for n in grads)
    state = stage.optimizer.state_dict()["state"]
    assert all(torch.equal(t, state[k][n]) for k, v in opt.items() for n, t in v.items())
    assert stage.steps == 1 and not stage._train


def test_dpo_on_a_stage_matches_peft_by_hand_and_learns_the_preference():
    """The stage's preference log-probs and DPO loss against peft's own forward (with and
    without the adapter) and the formula by hand; a few DPO steps then raise the chosen
    answer's margin (CLPD up, loss down)."""
    import torch.nn.functional as F

    stage = _stage()
    with torch.no_grad():
        for name, p in stage.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(7)
    pairs = [(torch.randint(3, 200, (n,), generator=g).tolist(), torch.randint(3, 200, (4,), generator=g).tolist(),
              torch.randint(3, 200, (3,), generator=g).tolist()) for n in (5, 8)]

    def seq_logprob(ids, start, adapter):
        with torch.no_grad(), (stage.model.disable_adapter() if not adapter else torch.enable_grad()):
            logits = stage.model(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        return sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids)))

    by_hand = []
    for prompt, chosen, rejected in pairs:
        pc, pr = seq_logprob(prompt + chosen, len(prompt), True), seq_logprob(prompt + rejected, len(prompt), True)
        rc, rr = seq_logprob(prompt + chosen, len(prompt), False), seq_logprob(prompt + rejected, len(prompt), False)
        by_hand.append((pc, pr, rc, rr))
    chosen, rejected = stage.preference_logprobs(pairs)
    ref_chosen, ref_rejected = stage.preference_logprobs(pairs, reference=True)
    got = list(zip(chosen.tolist(), rejected.tolist(), ref_chosen.tolist(), ref_rejected.tolist()))
    for g_row, h_row in zip(got, by_hand):
        assert g_row == pytest.approx(h_row, rel=1e-9, abs=1e-9)
    expected = sum(-F.logsigmoid(torch.tensor(0.1 * ((pc - rc) - (pr - rr)), dtype=torch.float64)).item()
                   for pc, pr, rc, rr in by_hand) / len(pairs)
    before = preference_stats(chosen.detach(), rejected.detach())
    assert stage.dpo_step(pairs, beta=0.1) == pytest.approx(expected, rel=1e-9)
    for _ in range(5):
        last = stage.dpo_step(pairs, beta=0.1)
    after = preference_stats(*[t.detach() for t in stage.preference_logprobs(pairs)])
    assert after["clpd"] > before["clpd"] + 1.0 and last < expected
    assert stage.steps == 6


def test_device_reading_on_the_cpu_is_the_process_rss():
    import psutil

    from raycolo.engine.device_stats import device_reading

    r = device_reading()
    assert r["source"] == "process_rss" and r["utilization"] is None
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < r["memory_used_bytes"] < 2 * rss <= 2 * r["memory_total_bytes"]
