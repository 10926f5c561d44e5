"""Clipped value loss (PPO critic), per token; aggregated by the caller through the plan.

    v_c = clamp(v, v_old - c, v_old + c)
    l_t = 0.5 * max((v - R)^2, (v_c - R)^2)
"""

from __future__ import annotations

import torch


def clipped_value_loss(
    values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (per-token loss [n, W], {"vf_clipfrac": indicator that the clipped term won})."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (values - returns).square()
    loss2 = (clipped - returns).square()
    loss = 0.5 * torch.maximum(loss1, loss2)
    return loss, {"vf_clipfrac": (loss2 > loss1).detach().to(values.dtype)}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """1 - Var(R - v) / Var(R) over valid tokens (population variances; nan when Var(R) = 0).

    1 = the critic predicts the returns exactly, 0 = no better than their mean, < 0 = worse."""
    valid = response_mask != 0
    r, v = returns[valid].double(), values[valid].double()
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)
