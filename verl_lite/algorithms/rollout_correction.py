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

Metrics (token means over the step's valid tokens unless named otherwise): ``rollout_corr/is_weight_mean``,
``is_raw_weight_mean``, ``is_truncated_fraction``, ``is_weight_max`` / ``_min`` with IS on; ``rs_masked_fraction``
and ``rs_rejected_seq_fraction`` (rows with valid tokens that rejection removes whole, over all B rows) with RS on;
always ``kl``, ``k3_kl`` and ``rollout/logprob_diff_mean`` / ``_max`` (|o - b|). Computed per micro-batch (old
log-probs from the update's own forward), ``token_mean`` is the plan's shard-additive one, ``num_seqs`` the
mini-batch's B, and ``*_max`` / ``*_min`` reduce by max / min (``verl_lite.utils.metric_reduce``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_CLAMP = 20.0


@dataclass
class Correction:
    weights: torch.Tensor | None  # [n, W]: IS weight x keep mask (1 on kept tokens when rollout_is is off), 0 on
    # padding; None when neither rollout_is nor rollout_rs is on (metrics only: the loss is not reweighted)
    keep: torch.Tensor  # [n, W] float: 1 where rejection keeps the token (and it is valid)
    metrics: dict  # name -> 0-dim tensor (see the module docstring)


@torch.no_grad()
def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
                       rollout_is: str | None, rollout_is_threshold: float, rollout_rs: str | None,
                       rollout_rs_threshold: float, rollout_rs_threshold_lower: float | None,
                       token_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       num_seqs: int | None = None) -> Correction:
    """The weights, the rejection mask and the metrics of the module docstring, for rows that are whole
    trajectories. The settings are ``algorithm.rollout_correction``'s (their defaults live in the config schema
    only); ``rollout_is`` / ``rollout_rs`` None turn that part off. ``token_mean`` / ``num_seqs``: the
    denominators when these rows are a shard of the step (default: these rows are the whole step)."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r}; choose one of {list(IS_LEVELS)} or None")
    if rollout_rs is not None and rollout_rs not in RS_LEVELS:
        raise ValueError(f"rollout_rs={rollout_rs!r}; choose one of {list(RS_LEVELS)} or None")
    m = (response_mask != 0).to(old_log_probs.dtype)
    valid = m.bool()
    token_mean = token_mean or (lambda x: (x * m).sum() / m.sum().clamp(min=1))
    num_seqs = m.shape[0] if num_seqs is None else num_seqs

    def extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
        if not valid.any():
            return torch.tensor(float("-inf") if largest else float("inf"), dtype=x.dtype)
        return x[valid].max() if largest else x[valid].min()

    log_ratio = (old_log_probs - rollout_log_probs) * m
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)  # [n, 1]

    def ratio(level: str) -> torch.Tensor:
        """The ratio at ``level`` of each token (geometric: the geometric mean of its row's token ratios)."""
        if level == "token":
            return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        seq = seq_log_ratio if level == "sequence" else seq_log_ratio / m.sum(-1, keepdim=True).clamp(min=1)
        return torch.exp(seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(m)

    abs_diff = log_ratio.abs()
    metrics: dict = {"rollout/logprob_diff_mean": token_mean(abs_diff), "rollout/logprob_diff_max": extreme(abs_diff, True)}
    w = torch.ones_like(m) if rollout_is is None else ratio(rollout_is)
    if rollout_is is not None:
        metrics["rollout_corr/is_truncated_fraction"] = token_mean((w > rollout_is_threshold).to(m.dtype))
        metrics["rollout_corr/is_raw_weight_mean"] = token_mean(w)
        w = w.clamp(max=rollout_is_threshold)
        metrics["rollout_corr/is_weight_mean"] = token_mean(w)
        metrics["rollout_corr/is_weight_max"] = extreme(w, True)
        metrics["rollout_corr/is_weight_min"] = extreme(w, False)
    keep = m.clone()
    if rollout_rs is not None:
        upper = rollout_rs_threshold
        lower = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper
        rs_ratio = ratio(rollout_rs)
        keep = m * ((rs_ratio >= lower) & (rs_ratio <= upper)).to(m.dtype)
        metrics["rollout_corr/rs_masked_fraction"] = token_mean(m - keep)
        rejected_rows = (keep.sum(-1) == 0) & (m.sum(-1) > 0)
        metrics["rollout_corr/rs_rejected_seq_fraction"] = rejected_rows.sum().to(m.dtype) / max(num_seqs, 1)
    metrics["rollout_corr/kl"] = token_mean(-log_ratio)  # k1 of KL(behaviour || old)
    metrics["rollout_corr/k3_kl"] = token_mean(torch.exp(log_ratio.clamp(max=LOG_RATIO_CLAMP)) - log_ratio - 1)
    weights = w * keep if rollout_is is not None or rollout_rs is not None else None
    return Correction(weights=weights, keep=keep, metrics=metrics)
