"""THE per-micro-batch objectives the engine calls (its `loss_fn`).

    actor:  contribution = agg(pg) + kl_loss_coef * agg(kl) - entropy_coeff * agg(H)
    critic: contribution = agg(0.5 max((v - R)^2, (v_clip - R)^2))

where agg(l) = plan.aggregate(l, mask) = sum_{i,t} w_i,t l_i,t over this micro-batch's rows.
Contributions of all micro-batches and all DP ranks sum to the mini-batch objective L
(Contract 1). Every metric is likewise a scalar that sums across shards to the mini-batch
value: loss terms are reported as plan contributions, per-token statistics as
sum(x m) / N (token means). Under CP every rank holds full rows (autograd only through its
own chunks), computes the same contribution, and the engine counts the value once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import NormalizationPlan, check_agg_mode
from .kl import kl_penalty
from .policy_loss import COV_SELECTION_LOSSES, PolicyLossConfig, get_policy_loss
from .rollout_correction import rollout_correction
from .value_loss import clipped_value_loss

COV_MASK_KEY = "cov_mask"  # data key of select_cov_tokens' mask (clip_cov / kl_cov)
IS_WEIGHTS_KEY = "is_weights"  # data key of optional importance-sampling weights
ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"  # data key of the behaviour policy's log-probs (rollout_correction)


@dataclass
class ActorLossConfig(PolicyLossConfig):
    """Actor objective config; field names follow verl's `actor` section."""

    policy_loss: str  # verl: policy_loss.loss_mode
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    # algorithm.rollout_correction's {rollout_is, ..., rollout_rs_threshold_lower} when the old log-probs are this
    # forward's (no recompute): the IS weights / rejection and their metrics are computed here, per micro-batch
    rollout_correction: dict | None = None

    def __post_init__(self):
        check_agg_mode(self.loss_agg_mode)
        get_policy_loss(self.policy_loss)


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.detach()


def actor_loss(
    outputs: dict[str, torch.Tensor],
    data: dict[str, torch.Tensor],
    plan: NormalizationPlan,
    cfg: ActorLossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the actor objective.

    outputs: "log_probs" [b, W] (autograd), optionally "entropy" [b, W].
    data:    "response_mask", "advantages"; "old_log_probs" (absent: old = sg(log_probs), this forward);
             "ref_log_probs" if use_kl_loss;
             optional "is_weights"; "cov_mask" for clip_cov / kl_cov; "rollout_log_probs" with
             cfg.rollout_correction (absent old log-probs only: the weights and metrics come from this forward).
    Returns (contribution scalar, metrics of detached scalars that sum across shards).
    """
    if plan.mode != cfg.loss_agg_mode:
        raise ValueError(
            f"NormalizationPlan mode {plan.mode!r} != cfg.loss_agg_mode {cfg.loss_agg_mode!r}: build the plan "
            "with the actor's loss_agg_mode."
        )
    log_probs = outputs["log_probs"]
    mask = data["response_mask"]
    pg_fn = get_policy_loss(cfg.policy_loss)
    cov_mask = data.get(COV_MASK_KEY)
    if cfg.policy_loss in COV_SELECTION_LOSSES and cov_mask is None:
        raise ValueError(
            f"policy_loss={cfg.policy_loss!r} needs data[{COV_MASK_KEY!r}] computed once per mini-batch with "
            "select_cov_tokens (the controller does this before dispatch)."
        )
    # One epoch, one mini-batch per RL step: the old (proximal) policy IS the current one, so
    # old = sg(log_probs): every ratio is 1 in value and the gradient is the policy gradient.
    in_forward = "old_log_probs" not in data
    old_log_probs = log_probs.detach() if in_forward else data["old_log_probs"]
    is_weights, metrics = data.get(IS_WEIGHTS_KEY), {}
    if in_forward and cfg.rollout_correction is not None:  # behaviour -> old correction from this forward
        if ROLLOUT_LOG_PROBS_KEY not in data:
            raise ValueError(f"rollout_correction needs data[{ROLLOUT_LOG_PROBS_KEY!r}] (the rollout's log-probs).")
        corr = rollout_correction(old_log_probs, data[ROLLOUT_LOG_PROBS_KEY], mask, **cfg.rollout_correction,
                                  token_mean=lambda x: plan.token_mean(x, mask), num_seqs=plan.num_seqs)
        if corr.weights is not None:
            is_weights = corr.weights
        metrics.update({k: _scalar(v) for k, v in corr.metrics.items()})
    pg, pg_metrics = pg_fn(old_log_probs, log_probs, data["advantages"], mask, cfg, is_weights, cov_mask)
    pg_contribution = plan.aggregate(pg, mask)
    total = pg_contribution
    metrics["pg_loss"] = _scalar(pg_contribution)
    for name, per_token in pg_metrics.items():
        metrics[name] = _scalar(plan.token_mean(per_token, mask))

    if cfg.use_kl_loss:
        if "ref_log_probs" not in data:
            raise ValueError("use_kl_loss=True needs data['ref_log_probs'] (the reference policy's log-probs).")
        kl = kl_penalty(log_probs, data["ref_log_probs"], cfg.kl_loss_type)
        kl_contribution = plan.aggregate(kl, mask)
        total = total + cfg.kl_loss_coef * kl_contribution
        metrics["kl_loss"] = _scalar(kl_contribution)

    entropy = outputs.get("entropy")
    if cfg.entropy_coeff != 0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs outputs['entropy'] (ask the engine for 'entropy').")
    if entropy is not None:
        entropy_contribution = plan.aggregate(entropy, mask)
        if cfg.entropy_coeff != 0:
            total = total - cfg.entropy_coeff * entropy_contribution
        metrics["entropy"] = _scalar(entropy_contribution)
        metrics["entropy_token_mean"] = _scalar(plan.token_mean(entropy, mask))

    metrics["loss"] = _scalar(total)
    return total, metrics


def critic_loss(
    outputs: dict[str, torch.Tensor],
    data: dict[str, torch.Tensor],
    plan: NormalizationPlan,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the critic objective agg(0.5 max((v-R)^2, (v_clip-R)^2)).

    outputs: "values" [b, W]; data: "response_mask", "old_values", "returns".
    """
    values = outputs["values"]
    mask = data["response_mask"]
    loss, per_token = clipped_value_loss(values, data["returns"], data["old_values"], cliprange_value)
    contribution = plan.aggregate(loss, mask)
    metrics = {
        "vf_loss": _scalar(contribution),
        "vf_clipfrac": _scalar(plan.token_mean(per_token["vf_clipfrac"], mask)),
        "vpred_mean": _scalar(plan.token_mean(values.detach(), mask)),
    }
    return contribution, metrics
