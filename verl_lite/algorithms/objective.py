"""THE per-micro-batch objectives the engine calls (its `loss_fn`; docs/algorithms.md, sections 1 and 6).

    actor:  contribution = agg(pg) + kl_loss_coef * agg(kl) - entropy_coeff * agg(H)   [+ distillation, if on]
    critic: contribution = agg(0.5 max((v - R)^2, (v_clip - R)^2))

agg(l) = plan.aggregate(l, mask) over this micro-batch's rows; contributions and metrics (loss terms as plan
contributions, per-token statistics as token means) sum over micro-batches and DP ranks to the mini-batch's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .aggregation import AGG_MODES, NormalizationPlan
from .distillation import combine_with_task, distillation_term
from .kl import KL_TYPES, kl_penalty
from .policy_loss import POLICY_LOSSES, ClipRange, PolicyLossConfig, get_policy_loss
from .rollout_correction import rollout_correction
from .value_loss import clipped_value_loss

COV_MASK_KEY = "cov_mask"  # data key of select_cov_tokens' mask (clip_cov / kl_cov)
IS_WEIGHTS_KEY = "is_weights"  # data key of optional importance-sampling weights
ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"  # data key of the behaviour policy's log-probs (rollout_correction)


@dataclass
class ActorLossConfig(ClipRange):
    """The actor section's loss keys (verl's names; ``config.schema.ActorConfig`` extends it): the loss takes it
    as it is, and ``problems`` states its rules."""

    clip_ratio: float = 0.2  # PPO clip range epsilon (both sides unless clip_ratio_low/high)
    clip_ratio_low: Optional[float] = 0.2  # lower clip range (verl: 0.2, so clip_ratio alone changes neither); None = clip_ratio
    clip_ratio_high: Optional[float] = 0.2  # upper clip range (verl: 0.2); None = clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip constant (> 1)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"  # token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_scale_factor: Optional[float] = None  # H for seq-mean-token-sum-norm; None = max_response_length
    entropy_coeff: float = 0.0  # entropy bonus coefficient (0 = off)
    use_kl_loss: bool = False  # KL(pi || ref) as a loss term (GRPO style); needs the reference model
    kl_loss_coef: float = 0.001  # coefficient of the KL loss
    kl_loss_type: str = "low_var_kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3), each also as k+ (verl's); no "full"
    tis_imp_ratio_cap: float = -1.0  # > 0: truncated IS weights min(pi_old / pi_rollout, cap) on the policy loss; -1 = off

    def problems(self, key: str = "actor") -> list[str]:
        """The loss's rules: aggregation mode, policy loss and its parameters, clipping, the KL loss."""
        out = [f"{key}.loss_agg_mode={self.loss_agg_mode!r} is unknown; choose one of {list(AGG_MODES)}"
               ] if self.loss_agg_mode not in AGG_MODES else []
        if self.policy_loss.loss_mode not in POLICY_LOSSES:
            out.append(f"{key}.policy_loss.loss_mode={self.policy_loss.loss_mode!r} is unknown; choose one of "
                       f"{sorted(POLICY_LOSSES)}")
        if self.use_kl_loss and self.kl_loss_type not in KL_TYPES:
            out.append(f"{key}.kl_loss_type={self.kl_loss_type!r} is unknown; choose one of {list(KL_TYPES)}")
        if self.use_kl_loss and not self.kl_loss_coef >= 0:
            out.append(f"{key}.kl_loss_coef={self.kl_loss_coef} must be >= 0 (a negative coefficient rewards "
                       f"drifting from the reference)")
        out += self.clip_range_problems(key)
        if not self.clip_ratio_c > 1:
            out.append(f"{key}.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip lower bound)")
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            out.append(f"{key}.loss_scale_factor={self.loss_scale_factor} must be > 0 or null (= data.max_response_length)")
        pl = self.policy_loss
        out += [f"{key}.policy_loss.{name}={getattr(pl, name)} must be > 0"
                for name in ("clip_cov_ratio", "kl_cov_ratio", "tau_pos", "tau_neg") if not getattr(pl, name) > 0]
        if not pl.clip_cov_lb < pl.clip_cov_ub:
            out.append(f"{key}.policy_loss.clip_cov_lb={pl.clip_cov_lb} must be < clip_cov_ub={pl.clip_cov_ub}")
        if self.tis_imp_ratio_cap != -1 and not self.tis_imp_ratio_cap > 0:
            out.append(f"{key}.tis_imp_ratio_cap={self.tis_imp_ratio_cap} must be > 0 (the truncation cap) or -1 (off)")
        return out


def actor_loss(
    outputs: dict[str, torch.Tensor],
    data: dict[str, torch.Tensor],
    plan: NormalizationPlan,
    cfg: ActorLossConfig,
    correction: dict | None = None,
    distillation=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the actor objective, aggregated by ``plan`` (built from ``cfg.loss_agg_mode``).

    outputs: "log_probs" [b, W] (autograd), optionally "entropy" [b, W].
    data:    "response_mask", "advantages"; "old_log_probs" (absent: old = sg(log_probs), this forward);
             "ref_log_probs" if use_kl_loss; optional "is_weights"; "cov_mask" for clip_cov / kl_cov;
             "rollout_log_probs" with ``correction``.
    correction: algorithm.rollout_correction's settings when the old log-probs are this forward's or (bypass_mode)
             the rollout's: IS weights / rejection from this forward against the rollout's log-probs. Bypass
             (docs/algorithms.md, "Rollout correction"): rejected tokens leave the policy loss's mask; ppo_clip
             reports the IS weights only, reinforce is the gpg loss with the IS weights w (-A sg(w) log pi).
    distillation: the ``distillation.distillation_loss`` section when distillation is on: its term is combined
             with this objective by ``distillation.combine_with_task``.
    Returns (contribution scalar, metrics of detached scalars that sum across shards).
    """
    log_probs = outputs["log_probs"]
    mask = data["response_mask"]
    pg_fn = get_policy_loss(cfg.policy_loss.loss_mode)
    # One epoch, one mini-batch per RL step: the old (proximal) policy IS the current one, so
    # old = sg(log_probs): every ratio is 1 in value and the gradient is the policy gradient.
    in_forward = "old_log_probs" not in data
    old_log_probs = log_probs.detach() if in_forward else data["old_log_probs"]
    is_weights, metrics, pg_mask = data.get(IS_WEIGHTS_KEY), {}, mask
    if correction is not None:  # behaviour -> this forward's policy, here
        if ROLLOUT_LOG_PROBS_KEY not in data:
            raise ValueError(f"rollout_correction needs data[{ROLLOUT_LOG_PROBS_KEY!r}] (the rollout's log-probs).")
        settings = {k: v for k, v in correction.items() if k not in ("bypass_mode", "loss_type")}
        corr = rollout_correction(log_probs.detach(), data[ROLLOUT_LOG_PROBS_KEY], mask, **settings,
                                  num_tokens=plan.num_tokens, num_seqs=plan.num_seqs)
        if correction.get("bypass_mode"):
            pg_mask = corr.keep
            if correction.get("loss_type") == "reinforce":
                pg_fn, is_weights = POLICY_LOSSES["gpg"], corr.weights
        elif corr.weights is not None:
            is_weights = corr.weights
        metrics.update({k: torch.as_tensor(v).detach() for k, v in corr.metrics.items()})
    pg, pg_metrics = pg_fn(old_log_probs, log_probs, data["advantages"], pg_mask, cfg, is_weights,
                           data.get(COV_MASK_KEY))
    pg_contribution = plan.aggregate(pg, pg_mask)
    total = pg_contribution
    metrics["pg_loss"] = pg_contribution.detach()
    for name, per_token in pg_metrics.items():
        metrics[name] = plan.token_mean(per_token, mask).detach()

    if cfg.use_kl_loss:
        if "ref_log_probs" not in data:
            raise ValueError("use_kl_loss=True needs data['ref_log_probs'] (the reference policy's log-probs).")
        kl = kl_penalty(log_probs, data["ref_log_probs"], cfg.kl_loss_type)
        kl_contribution = plan.aggregate(kl, mask)
        total = total + cfg.kl_loss_coef * kl_contribution
        metrics["kl_loss"] = kl_contribution.detach()

    entropy = outputs.get("entropy")
    if cfg.entropy_coeff != 0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs outputs['entropy'] (ask the engine for 'entropy').")
    if entropy is not None:
        entropy_contribution = plan.aggregate(entropy, mask)
        if cfg.entropy_coeff != 0:
            total = total - cfg.entropy_coeff * entropy_contribution
        metrics["entropy"] = entropy_contribution.detach()
        metrics["entropy_token_mean"] = plan.token_mean(entropy, mask).detach()

    if distillation is not None:
        distill, distill_metrics = distillation_term(outputs, data, plan, distillation, old_log_probs, is_weights)
        total = combine_with_task(total, distill, distillation)
        metrics.update(distill_metrics)

    metrics["loss"] = total.detach()
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
        "vf_loss": contribution.detach(),
        "vf_clipfrac": plan.token_mean(per_token["vf_clipfrac"], mask).detach(),
        "vpred_mean": plan.token_mean(values.detach(), mask).detach(),
    }
    return contribution, metrics
