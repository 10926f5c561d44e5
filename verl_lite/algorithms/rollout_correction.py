"""Off-policy correction between the behaviour policy and the trainer's old policy (verl's
``algorithm.rollout_correction``).

Per token of a response (mask m_t), with the rollout's log-probs ``b_t = log pi_rollout`` (the
policy that sampled, possibly some versions old) and the trainer's ``o_t = log pi_old`` (the
proximal policy recomputed at the update, docs/async.md):

    log-ratio       l_t = o_t - b_t
    token IS        w_t = min(exp(clamp(l_t, -20, 20)), C)                        C = rollout_is_threshold
    sequence IS     w_t = min(exp(clamp(sum_s m_s l_s, -20, 20)), C)    for every token of the row
    rejection (RS)  keep a token (token), a row (sequence: exp(sum m l), geometric: exp(sum m l / n))
                    whose ratio lies in [lower, upper]; lower defaults to 1 / upper
    KL(behaviour || old) = E_b[b - o] (k1) and E_b[exp(l) - l - 1] (k3), token means over m

The IS weights carry no gradient and multiply the per-token policy loss (``is_weights`` of every
policy loss); rejected tokens get weight 0. Padding positions hold weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_CLAMP = 20.0


@dataclass
class Correction:
    weights: torch.Tensor  # [n, W]: IS weight x keep mask (1 on kept tokens when rollout_is is off), 0 on padding
    keep: torch.Tensor  # [n, W] float: 1 where rejection keeps the token (and it is valid)
    metrics: dict


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp(min=1))


@torch.no_grad()
def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: float = 2.0, rollout_rs: str | None = None,
                       rollout_rs_threshold: float = 2.0, rollout_rs_threshold_lower: float | None = None) -> Correction:
    """The weights, the rejection mask and the metrics of the module docstring."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r}; choose one of {list(IS_LEVELS)} or None")
    if rollout_rs is not None and rollout_rs not in RS_LEVELS:
        raise ValueError(f"rollout_rs={rollout_rs!r}; choose one of {list(RS_LEVELS)} or None")
    m = (response_mask != 0).to(old_log_probs.dtype)
    log_ratio = (old_log_probs - rollout_log_probs) * m
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)  # [n, 1]
    lengths = m.sum(-1, keepdim=True)
    metrics: dict = {}
    if rollout_is == "token":
        w = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    elif rollout_is == "sequence":
        w = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(m)
    else:
        w = torch.ones_like(m)
    if rollout_is is not None:
        raw = w * m
        metrics["rollout_corr/is_truncated_fraction"] = _masked_mean((w > rollout_is_threshold).to(m.dtype), m)
        w = w.clamp(max=rollout_is_threshold)
        valid = m.bool()
        metrics["rollout_corr/is_weight_mean"] = _masked_mean(w, m)
        metrics["rollout_corr/is_weight_max"] = float(w[valid].max()) if valid.any() else 0.0
        metrics["rollout_corr/is_weight_min"] = float(w[valid].min()) if valid.any() else 0.0
        metrics["rollout_corr/is_raw_weight_mean"] = _masked_mean(raw, m)
    keep = m.clone()
    if rollout_rs is not None:
        upper = rollout_rs_threshold
        lower = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper
        if rollout_rs == "token":
            ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        elif rollout_rs == "sequence":
            ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(m)
        else:  # geometric mean of the token ratios
            ratio = torch.exp((seq_log_ratio / lengths.clamp(min=1)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(m)
        keep = m * ((ratio >= lower) & (ratio <= upper)).to(m.dtype)
        metrics["rollout_corr/rs_masked_fraction"] = 1.0 - float(keep.sum() / m.sum().clamp(min=1))
        rows = m.sum(-1) > 0
        metrics["rollout_corr/rs_rejected_seq_fraction"] = float(((keep.sum(-1) == 0) & rows).sum() / rows.sum().clamp(min=1))
    metrics["rollout_corr/kl"] = _masked_mean(-log_ratio, m)  # k1 of KL(behaviour || old)
    metrics["rollout_corr/k3_kl"] = _masked_mean(torch.exp(log_ratio.clamp(max=LOG_RATIO_CLAMP)) - log_ratio - 1, m)
    return Correction(weights=w * keep, keep=keep, metrics=metrics)
