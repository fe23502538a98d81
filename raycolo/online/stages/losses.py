"""Preference-pair training: the DPO loss (Rafailov et al., 2023), as MACE trains with it.

For a pair (prompt x, chosen y_w, rejected y_l), with the policy pi (the model with its
LoRA adapter) and the reference pi_ref (the same model with the adapter switched off,
i.e. the frozen base):

    loss = -log sigmoid(beta * ((log pi(y_w|x) - log pi_ref(y_w|x))
                                - (log pi(y_l|x) - log pi_ref(y_l|x))))

averaged over pairs. A sequence's log-probability sums its completion tokens' log-probs
(the prompt and padding are labelled ``IGNORE_INDEX``, as in the causal-LM loss). Pure torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100   # the label of a token no loss counts (PyTorch's cross_entropy default)


def sequence_logprob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over each row's labelled positions of log p(label | prefix): logits (B, T, V)
    predict the next token, labels (B, T) with ``IGNORE_INDEX`` where nothing counts."""
    targets = labels[:, 1:]
    logits = logits[:, :-1]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    mask = targets != IGNORE_INDEX
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """The mean DPO loss of pairs, from sequence log-probabilities (B,) each."""
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(beta * margin).mean()


def preference_stats(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> dict[str, float]:
    """MACE's alignment metrics on held-out pairs (MACE §2, after Zhang & Ranganath 2025
    and Chen et al. 2024), from the policy's sequence log-probabilities: the win rate,
    the fraction of pairs where the chosen answer is more probable than the rejected one,
    and CLPD, the mean of log pi(chosen|x) - log pi(rejected|x)."""
    diff = policy_chosen - policy_rejected
    return {"win_rate": float((diff > 0).float().mean()), "clpd": float(diff.mean())}
