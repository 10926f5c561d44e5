"""The ``algorithm`` section (verl's ``algorithm.*``): its fields, defaults and rules, stated once here; the names
it accepts come from this package's registries. ``problems`` returns one line per problem, naming the key and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .advantages import ADVANTAGE_ESTIMATORS, ESTIMATOR_NEEDS
from .distillation import DISTILLATION_LOSS_MODES, DISTILLATION_POLICY_LOSSES, uses_topk
from .kl import KL_CTRL_TYPES, KL_TYPES
from .policy_loss import ClipRange
from .rollout_correction import IS_LEVELS, LOSS_TYPES, RS_LEGACY, parse_is_threshold, rejection_rules

FILTER_GROUPS_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")  # DAPO's dynamic sampling signal


def _choice(key: str, value, choices) -> list[str]:
    return [] if value in choices else [f"{key}={value!r} is unknown; choose one of {list(choices)}"]


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # in-reward KL coefficient (initial value for adaptive)
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose samples all score the same, generate more."""

    enable: bool = False  # turn on dynamic sampling
    metric: str = "acc"  # per-sample value compared within a group: acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10  # generation rounds per step at most (> 0); then the step fails clearly


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the behaviour policy (the rollout's log-probs) and the trainer's old
    policy (verl's names and meaning, verl >= 0.8 as in 0.9.1; formulas in verl_lite/algorithms/rollout_correction.py,
    the vocabulary in docs/algorithms.md "Rollout correction")."""

    rollout_is: Optional[str] = None  # importance weights pi_old / pi_rollout on the policy loss: token | sequence | null (off)
    rollout_is_threshold: Union[float, str] = 2.0  # a number: truncation cap (TIS); "lower_upper" (e.g. "0.5_5.0"): IcePop, weights outside the bounds are 0
    rollout_is_batch_normalize: bool = False  # divide the IS weights by their mean over the step (token: valid tokens; sequence: rows)
    rollout_rs: Optional[str] = None  # rejection: a comma list of token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 (all must keep a token), or ours token | sequence | geometric | null (off)
    rollout_rs_threshold: Optional[Union[float, str]] = 2.0  # per rollout_rs option (one for all, or a comma list): k1 "lower_upper" on pi_rollout / pi_old or one number U = [1/U, U]; k2/k3 an upper bound; ours: upper bound (> 1) on pi_old / pi_rollout
    rollout_rs_threshold_lower: Optional[float] = None  # ours (token | sequence | geometric only): lower bound on pi_old / pi_rollout; null = 1 / rollout_rs_threshold
    rejected_in_denominator: Optional[bool] = None  # rejected tokens in the loss's denominators: false = dropped from the mask (verl's rule), true = weight 0 but counted (ours); null = false for verl's rollout_rs options, true for ours
    bypass_mode: bool = False  # true: old log-probs = the rollout's (no recompute; the PPO ratio is pi / pi_rollout)
    loss_type: str = "ppo_clip"  # with bypass_mode: ppo_clip (PPO-clip, old = the rollout's) | reinforce (-A w log pi, w the IS weights, no clip)

    def drops_rejected(self) -> bool:
        """Whether rejected tokens leave the loss's mask (verl's rule) rather than stay in its denominators."""
        if self.rollout_rs is None:
            return False
        if self.rejected_in_denominator is not None:
            return not self.rejected_in_denominator
        return self.rollout_rs not in RS_LEGACY

    def needs_whole_step(self) -> bool:
        """Whether the correction needs the whole step before the update (so the old log-probs are recomputed
        first): rejection that changes the loss's mask, or IS weights normalized over the step."""
        return (self.drops_rejected() and not self.bypass_mode) or (
            self.rollout_is is not None and self.rollout_is_batch_normalize)

    def problems(self, tis_cap: float, loss_mode: str = "vanilla") -> list[str]:
        """The levels of its IS weights and rejection, their thresholds (verl's parsing), bypass mode, and that
        the actor's older ``tis_imp_ratio_cap`` (``tis_cap``) is not also on (two weightings of the same ratio).
        ``loss_mode``: the actor's policy loss, which bypass mode constrains."""
        K = "algorithm.rollout_correction"
        out = []
        if self.rollout_is is not None:
            out += _choice(f"{K}.rollout_is", self.rollout_is, list(IS_LEVELS))
            try:
                parse_is_threshold(self.rollout_is_threshold)
            except ValueError as e:
                out.append(f"{K}.rollout_is_threshold={self.rollout_is_threshold!r}: {e}")
            if tis_cap > 0:
                out.append(f"{K}.rollout_is and actor_rollout_ref.actor.tis_imp_ratio_cap={tis_cap} weight the same "
                           f"ratio twice; keep one (set tis_imp_ratio_cap=-1)")
        if self.rollout_rs is not None:
            out += self._rejection_problems(K)
        elif self.rejected_in_denominator is not None:
            out.append(f"{K}.rejected_in_denominator={self.rejected_in_denominator} is read only with rollout_rs; "
                       f"set it null")
        if self.bypass_mode:
            out += self._bypass_problems(K, loss_mode)
        elif self.loss_type not in LOSS_TYPES:
            out += _choice(f"{K}.loss_type", self.loss_type, list(LOSS_TYPES))
        return out

    def _rejection_problems(self, K: str) -> list[str]:
        out = []
        lower = self.rollout_rs_threshold_lower
        if self.rollout_rs in RS_LEGACY:
            if isinstance(self.rollout_rs_threshold, str) or self.rollout_rs_threshold is None \
                    or not self.rollout_rs_threshold > 1:
                out.append(f"{K}.rollout_rs_threshold={self.rollout_rs_threshold!r} must be a number > 1 with "
                           f"rollout_rs={self.rollout_rs} (ours: the upper bound of pi_old / pi_rollout)")
            elif lower is not None and not 0 <= lower < self.rollout_rs_threshold:
                out.append(f"{K}.rollout_rs_threshold_lower={lower} must lie in [0, rollout_rs_threshold)")
            return out
        if lower is not None:
            out.append(f"{K}.rollout_rs_threshold_lower={lower} is ours, read only with rollout_rs=token|sequence|"
                       f"geometric; with verl's options give the bounds as rollout_rs_threshold='lower_upper'")
        try:
            rejection_rules(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as e:
            key = "rollout_rs" if "option" in str(e) and "unknown" in str(e) else "rollout_rs_threshold"
            out.append(f"{K}.{key}={getattr(self, key)!r}: {e}")
        return out

    def _bypass_problems(self, K: str, loss_mode: str) -> list[str]:
        out = _choice(f"{K}.loss_type", self.loss_type, list(LOSS_TYPES))
        if loss_mode != "vanilla":
            out.append(f"{K}.bypass_mode=true replaces the policy loss with PPO-clip in verl; "
                       f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} would not be used: set it vanilla")
        if self.rejected_in_denominator is not None:
            out.append(f"{K}.rejected_in_denominator is not read with bypass_mode=true (verl's rule there: token-mean "
                       f"keeps rejected tokens in N, per-row means drop them); set it null")
        if self.rollout_is is not None and self.rollout_is_batch_normalize:
            out.append(f"{K}.rollout_is_batch_normalize=true with bypass_mode=true is not built (verl normalizes per "
                       f"micro-batch there); set it false")
        return out


@dataclass
class DistillationLossConfig(ClipRange):
    """verl's ``distillation.distillation_loss`` (verl main, after 0.9.1; its names, defaults and meanings): which
    divergence to the teacher, and how it enters the actor's objective (formulas: algorithms/distillation.py)."""

    loss_mode: str = "k3"  # kl|k1|abs|mse|k2|low_var_kl|k3: reverse KL on the sampled token; forward_kl_topk: forward KL on the teacher's top-k
    topk: Optional[int] = 128  # forward_kl_topk: the teacher's top-k size
    use_task_rewards: bool = True  # true: the task reward's objective + distillation_loss_coef x the distillation term; false: the distillation term alone
    distillation_loss_coef: float = 1.0  # weight of the distillation term with use_task_rewards=true
    loss_max_clamp: Optional[float] = 10.0  # each token's divergence clamped to [-this, this]; null = no clamp
    log_prob_min_clamp: Optional[float] = -10.0  # forward_kl_topk: both top-k log-probs clamped below at this; null = no clamp
    use_policy_gradient: bool = True  # true: minus the divergence as a per-token reward (PPO-clip, advantage -d); false: the divergence as a loss
    policy_loss_mode: str = "vanilla"  # the policy loss of use_policy_gradient=true (verl: vanilla only)
    clip_ratio: float = 0.2  # that loss's clip range (both sides unless clip_ratio_low/high)
    clip_ratio_low: Optional[float] = 0.2  # its lower clip range; null = clip_ratio
    clip_ratio_high: Optional[float] = 0.2  # its upper clip range; null = clip_ratio

    clip_ratio_c = 3.0  # the dual-clip bound verl's vanilla loss uses when its config has none (not a key)

    def problems(self, key: str = "distillation.distillation_loss") -> list[str]:
        """The loss's rules (verl's, plus ranges verl leaves unchecked)."""
        out = _choice(f"{key}.loss_mode", self.loss_mode, DISTILLATION_LOSS_MODES)
        out += _choice(f"{key}.policy_loss_mode", self.policy_loss_mode, DISTILLATION_POLICY_LOSSES)
        if self.loss_mode in ("kl", "k1") and not self.use_policy_gradient:
            out.append(f"{key}.loss_mode={self.loss_mode} with use_policy_gradient=false: the gradient of k1 (s - T) "
                       f"does not depend on the teacher (verl refuses it too); set use_policy_gradient=true or "
                       f"loss_mode=k3")
        if uses_topk(self.loss_mode) and (not isinstance(self.topk, int) or self.topk < 1):
            out.append(f"{key}.topk={self.topk!r} must be an integer >= 1 with loss_mode={self.loss_mode}")
        if not self.distillation_loss_coef >= 0:
            out.append(f"{key}.distillation_loss_coef={self.distillation_loss_coef} must be >= 0 (a negative "
                       f"coefficient rewards moving away from the teacher)")
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            out.append(f"{key}.loss_max_clamp={self.loss_max_clamp} must be > 0 or null (no clamp)")
        if self.log_prob_min_clamp is not None and not self.log_prob_min_clamp < 0:
            out.append(f"{key}.log_prob_min_clamp={self.log_prob_min_clamp} must be < 0 (a log-prob) or null")
        return out + self.clip_range_problems(key)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # a name in verl_lite.algorithms' advantage registry
    gamma: float = 1.0  # discount (gae)
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (false = Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef x KL(pi_old || ref) from the token rewards
    kl_penalty: str = "kl"  # KL estimator for the in-reward penalty
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    @property
    def needs(self) -> frozenset:
        """What the estimator needs (a critic, groups of samples, ...); nothing for an unknown name."""
        return ESTIMATOR_NEEDS.get(self.adv_estimator, frozenset())

    def problems(self, n: int | None, n_key: str, tis_cap: float, loss_mode: str = "vanilla") -> list[str]:
        """Estimator, in-reward KL and its controller, gamma/lambda, DAPO's dynamic sampling and the rollout
        correction; ``n`` (None: not a valid size) = samples per prompt, set by ``n_key``; ``tis_cap`` = the
        actor's ``tis_imp_ratio_cap``, ``loss_mode`` its policy loss."""
        out = _choice("algorithm.adv_estimator", self.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
        grouped = [(f"algorithm.adv_estimator={self.adv_estimator!r}", "groups" in self.needs),
                   ("algorithm.filter_groups.enable=true", self.filter_groups.enable)]
        out += [f"{setting} compares samples of the same prompt; set {n_key} >= 2 (got {n})"
                for setting, grouped_here in grouped if grouped_here and n is not None and n < 2]
        if self.use_kl_in_reward:
            out += _choice("algorithm.kl_penalty", self.kl_penalty, KL_TYPES)
        out += _choice("algorithm.kl_ctrl.type", self.kl_ctrl.type, KL_CTRL_TYPES)
        if self.use_kl_in_reward:
            kc = self.kl_ctrl
            if not kc.kl_coef >= 0:
                out.append(f"algorithm.kl_ctrl.kl_coef={kc.kl_coef} must be >= 0 (a negative coefficient rewards "
                           f"drifting from the reference)")
            if kc.type == "adaptive":
                out += [f"algorithm.kl_ctrl.{name}={getattr(kc, name)} must be > 0 (the adaptive controller divides "
                        f"by it)" for name in ("target_kl", "horizon") if not getattr(kc, name) > 0]
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            out.append(f"algorithm.gamma={self.gamma} and algorithm.lam={self.lam} must lie in [0, 1]")
        fg = self.filter_groups
        if fg.enable:
            out += _choice("algorithm.filter_groups.metric", fg.metric, FILTER_GROUPS_METRICS)
            if not isinstance(fg.max_num_gen_batches, int) or fg.max_num_gen_batches < 1:
                out.append(f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 1: every "
                           f"step needs a bound on its generation rounds (verl's 0 = unbounded could loop forever)")
        return out + self.rollout_correction.problems(tis_cap, loss_mode)
