"""gpu-check's references, which do not use the code under test: transformers' own
generate()/forward in float64 and peft's own training step."""
from __future__ import annotations

from raycolo.gpu_check.common import MODEL, _model, _require


def _hf_greedy(model, prompt, n: int) -> list[int]:
    """transformers' own generate(), greedy, EOS ignored (the reference)."""
    import torch
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=0)
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)], device=dev),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=dev),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def _hf_last_logits(model, prompts):
    """transformers' own forward: each prompt's last logits (on the CPU)."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p], device=dev)).logits[0, -1].cpu() for p in prompts])


def _reference(model_id: str, device):
    """The reference for a path on ``device``: transformers' own float64 model on that same
    device. Not the CPU: transformers computes the rotary cos/sin in float32 whatever the
    model's dtype (its rotary embedding runs with autocast off), and CUDA's float32 sin/cos
    round differently from the CPU's, so even float64 logits differ by about 1e-7 between
    the two (seen on an H100). ``executor.whole`` reports that cross-device gap too."""
    return _model(model_id, "float64", device).eval()


def teacher_forced_gaps(model, prompts, outputs):
    """Each output token teacher-forced through ``model`` on the outputs themselves: the gap
    between the model's best logit and the chosen token's (0 where it is the argmax), and
    that best logit; two float64 host tensors over all tokens, prompt by prompt."""
    import torch

    gaps, bests = [], []
    with torch.no_grad():
        for p, out in zip(prompts, outputs):
            ids = torch.tensor([list(p) + list(out)], device=model.device)
            logits = model(ids).logits[0, len(p) - 1:len(p) - 1 + len(out)].to(torch.float64)
            best = logits.max(-1).values
            chosen = logits.gather(1, torch.tensor(out, device=model.device).view(-1, 1))[:, 0]
            gaps.append((best - chosen).cpu())
            bests.append(best.cpu())
    return torch.cat(gaps), torch.cat(bests)


def _greedy_agreement(ref_model, prompts, outputs, tie: float) -> tuple[int, int, float]:
    """Whether ``outputs`` are greedy under ``ref_model`` (CPU float64), teacher-forced on the
    outputs themselves: (tokens that are the reference's argmax, tokens, the largest gap
    between the reference's best logit and the chosen token's). A lower-precision run may
    pick another token only where the reference's top two are within ``tie``."""
    gaps, _ = teacher_forced_gaps(ref_model, prompts, outputs)
    worst = float(gaps.max())
    _require(worst <= tie, f"a token {worst:.3g} below the reference's best logit (allowed {tie:g})")
    return int((gaps == 0).sum()), len(gaps), worst


def _reference_training(lora, batch, steps: int, device):
    """peft's own whole-model steps (float64 on ``device``, see :func:`_reference`): the
    losses and the final LoRA state (on the CPU)."""
    import torch
    from peft import get_peft_model_state_dict

    from raycolo.online.stages.stage_model import add_lora, causal_lm_loss

    whole = add_lora(_model(MODEL, "float64", device), lora)
    opt = torch.optim.AdamW([p for p in whole.parameters() if p.requires_grad], lr=lora.lr)
    ids, labels, lengths = batch
    ids, labels = ids.to(device), labels.to(device)
    mask = torch.tensor([[1] * n + [0] * (ids.shape[1] - n) for n in lengths], device=device)
    losses = []
    for _ in range(steps):
        loss = causal_lm_loss(whole(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().cpu() for k, v in get_peft_model_state_dict(whole).items()}
