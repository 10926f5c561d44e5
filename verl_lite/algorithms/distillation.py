"""On-policy distillation losses (verl's ``distillation.distillation_loss``): a per-token divergence d between the
student's log-prob s and the frozen teacher's T of each sampled token (or the teacher's top k), clamped to
+-``loss_max_clamp``, aggregated by the caller's ``NormalizationPlan`` like every loss (Contract 1). Each function
below states its formula; modes, defaults and refusals: docs/algorithms.md, "Distillation".
"""

from __future__ import annotations

import torch

from .kl import kl_penalty

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk",)
DISTILLATION_LOSS_MODES = ESTIMATOR_MODES + TOPK_MODES
DISTILLATION_POLICY_LOSSES = ("vanilla",)

TEACHER_LOG_PROBS_KEY = "teacher_log_probs"  # data [b, W]: the teacher's log-prob of each sampled token
TEACHER_TOPK_LOG_PROBS_KEY = "teacher_topk_log_probs"  # data [b, W, K]: the teacher's top-k log-probs
TEACHER_TOPK_IDS_KEY = "teacher_topk_ids"  # data [b, W, K]: their token ids
STUDENT_TOPK_LOG_PROBS_KEY = "log_probs_at"  # outputs [b, W, K]: log_softmax(student)[teacher_topk_ids]
TEACHER_KEYS = (TEACHER_LOG_PROBS_KEY, TEACHER_TOPK_LOG_PROBS_KEY, TEACHER_TOPK_IDS_KEY)


def uses_topk(loss_mode: str) -> bool:
    """Whether ``loss_mode`` needs the teacher's top-k (and the student's log-probs at those ids)."""
    return loss_mode in TOPK_MODES


def teacher_keys(loss_mode: str) -> tuple[str, ...]:
    """The data the teacher's pass gives ``loss_mode``: its log-prob of each sampled token, or its top-k
    log-probs and their ids."""
    return (TEACHER_TOPK_LOG_PROBS_KEY, TEACHER_TOPK_IDS_KEY) if uses_topk(loss_mode) else (TEACHER_LOG_PROBS_KEY,)


def reverse_kl_estimate(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                        loss_mode: str) -> torch.Tensor:
    """Per-token reverse-KL estimate on the sampled token, ``kl.kl_penalty(s, sg(T), loss_mode)``: k1 s - T, abs
    |s - T|, k2 (s - T)^2 / 2, k3 e^x - x - 1 with x = T - s (with kl_penalty's clamps)."""
    if loss_mode not in ESTIMATOR_MODES:
        raise ValueError(f"{loss_mode!r} is not a sampled-token estimator; choose one of {list(ESTIMATOR_MODES)}")
    return kl_penalty(student_log_probs, teacher_log_probs.detach(), loss_mode)


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    log_prob_min_clamp: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token forward KL on the teacher's top-k ids v_1..v_K, from [b, W, K] log-probs at those ids:
    max(0, sum_k p_k (log p_k - log q_k)), p the teacher's, q the student's softmax, both log-probs first clamped
    below at ``log_prob_min_clamp``; not renormalized (verl's rule), hence the clamp at 0. Returns (loss [b, W],
    student_mass = sum_k q_k, teacher_mass = sum_k p_k), the masses taken before the clamp."""
    if student_topk_log_probs.shape != teacher_topk_log_probs.shape:
        raise ValueError(f"student top-k log-probs {tuple(student_topk_log_probs.shape)} and teacher top-k "
                         f"log-probs {tuple(teacher_topk_log_probs.shape)} must have the same shape [b, W, K]")
    teacher = teacher_topk_log_probs.detach()
    student_mass = student_topk_log_probs.detach().exp().sum(dim=-1)
    teacher_mass = teacher.exp().sum(dim=-1)
    student = student_topk_log_probs
    if log_prob_min_clamp is not None:
        student = student.clamp_min(log_prob_min_clamp)
        teacher = teacher.clamp_min(log_prob_min_clamp)
    loss = (teacher.exp() * (teacher - student)).sum(dim=-1)
    return loss.clamp_min(0.0), student_mass, teacher_mass


def per_token_distillation(outputs: dict[str, torch.Tensor], data: dict[str, torch.Tensor],
                           cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """d [b, W] of ``cfg.loss_mode`` after the ``loss_max_clamp`` clamp, and per-token statistics to report.
    outputs: "log_probs" (estimators) or "log_probs_at" (top-k: the student at the teacher's ids); data: the
    teacher's tensors."""
    stats: dict[str, torch.Tensor] = {}
    if uses_topk(cfg.loss_mode):
        for source, key in ((outputs, STUDENT_TOPK_LOG_PROBS_KEY), (data, TEACHER_TOPK_LOG_PROBS_KEY)):
            if key not in source:
                raise ValueError(f"distillation loss_mode={cfg.loss_mode!r} needs {key!r} (the teacher's top-k "
                                 f"log-probs and the student's log-probs at those ids)")
        loss, stats["student_mass"], stats["teacher_mass"] = forward_kl_topk(
            outputs[STUDENT_TOPK_LOG_PROBS_KEY], data[TEACHER_TOPK_LOG_PROBS_KEY], cfg.log_prob_min_clamp)
    else:
        if TEACHER_LOG_PROBS_KEY not in data:
            raise ValueError(f"distillation loss_mode={cfg.loss_mode!r} needs data[{TEACHER_LOG_PROBS_KEY!r}] "
                             f"(the teacher's log-probs of the sampled tokens)")
        loss = reverse_kl_estimate(outputs["log_probs"], data[TEACHER_LOG_PROBS_KEY], cfg.loss_mode)
    stats["abs_loss"] = loss.detach().abs()
    if cfg.loss_max_clamp is not None:
        loss = loss.clamp(min=-cfg.loss_max_clamp, max=cfg.loss_max_clamp)
    return loss, stats


def distillation_term(outputs: dict[str, torch.Tensor], data: dict[str, torch.Tensor], plan, cfg,
                      old_log_probs: torch.Tensor, is_weights: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """D, this micro-batch's share of the distillation term aggregated by ``plan``: with use_policy_gradient the
    vanilla PPO-clip loss (the section's clip ratios) with advantage -sg(d), else d itself; and its metrics
    (detached scalars that sum across shards). ``old_log_probs`` / ``is_weights``: the policy loss's."""
    from .policy_loss import get_policy_loss

    mask = data["response_mask"]
    per_token, stats = per_token_distillation(outputs, data, cfg)
    metrics = {f"distillation/{name}": plan.token_mean(value, mask).detach() for name, value in stats.items()}
    metrics["distillation/kl"] = plan.token_mean(per_token.detach(), mask)
    if cfg.use_policy_gradient:
        pg_fn = get_policy_loss(cfg.policy_loss_mode)
        pg, pg_metrics = pg_fn(old_log_probs, outputs["log_probs"], -per_token.detach(), mask, cfg, is_weights)
        contribution = plan.aggregate(pg, mask)
        metrics.update({f"distillation/{k}": plan.token_mean(v, mask).detach() for k, v in pg_metrics.items()})
    else:
        contribution = plan.aggregate(per_token, mask)
    metrics["distillation/loss"] = contribution.detach()
    return contribution, metrics


def combine_with_task(task_contribution: torch.Tensor, distill_contribution: torch.Tensor, cfg) -> torch.Tensor:
    """The actor's objective from P (policy loss, KL loss, entropy bonus: verl's ``ppo_loss``) and the distillation
    term D: P + distillation_loss_coef * D with use_task_rewards, else D alone (P unused)."""
    if not cfg.use_task_rewards:
        return distill_contribution
    return task_contribution + cfg.distillation_loss_coef * distill_contribution
