"""Truncated importance sampling for rollout/training mismatch (TIS; Yao et al., 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training").

The rollout engine samples from pi_rollout, the loss is built on the trainer's pi_old; their
per-token ratio corrects the gradient, truncated at a cap C for variance:

    w_i,t = min(exp(old_logp_i,t - rollout_logp_i,t), C) on valid tokens, 0 elsewhere.

The weights multiply the per-token policy loss (``is_weights`` of every policy loss).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    valid = response_mask != 0
    log_ratio = torch.where(valid, old_log_probs - rollout_log_probs, torch.zeros_like(old_log_probs))
    return torch.exp(log_ratio.clamp(max=20.0)).clamp(max=cap) * valid.to(old_log_probs.dtype)
