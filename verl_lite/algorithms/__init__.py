"""Pure RL math on tensors (no torch.distributed): advantages, policy losses, the
normalization plan, KL, value loss and the per-micro-batch objectives. See docs/algorithms.md."""

from .advantages import (ADVANTAGE_ESTIMATORS, ESTIMATOR_NEEDS, compute_advantage, estimator_needs,
                         get_advantage_estimator, masked_whiten, register_advantage_estimator)
from .aggregation import AGG_MODES, NormalizationPlan, check_agg_mode
from .kl import KL_TYPES, AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller, kl_penalty
from .objective import COV_MASK_KEY, IS_WEIGHTS_KEY, ActorLossConfig, actor_loss, critic_loss
from .dapo import groups_with_signal, overlong_penalty
from .importance import truncated_is_weights
from .rollout_correction import rollout_correction
from .policy_loss import (COV_SELECTION_LOSSES, LOSS_NEEDS, POLICY_LOSSES, PolicyLossConfig, get_policy_loss,
                          register_policy_loss, select_cov_tokens)
from .value_loss import clipped_value_loss, explained_variance

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "COV_MASK_KEY", "COV_SELECTION_LOSSES", "ESTIMATOR_NEEDS", "LOSS_NEEDS",
    "IS_WEIGHTS_KEY", "KL_TYPES", "POLICY_LOSSES", "ActorLossConfig", "AdaptiveKLController", "FixedKLController",
    "NormalizationPlan", "PolicyLossConfig", "actor_loss", "apply_kl_penalty", "check_agg_mode", "clipped_value_loss",
    "estimator_needs", "explained_variance", "groups_with_signal", "overlong_penalty", "compute_advantage",
    "critic_loss", "get_advantage_estimator", "get_kl_controller", "get_policy_loss", "kl_penalty", "masked_whiten",
    "register_advantage_estimator", "register_policy_loss", "rollout_correction", "select_cov_tokens",
    "truncated_is_weights",
]
