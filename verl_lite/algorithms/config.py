"""The ``algorithm`` section (verl's ``algorithm.*``): its fields, defaults and rules, stated once here; the names
it accepts come from this package's registries. ``problems`` returns one line per problem, naming the key and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .advantages import ADVANTAGE_ESTIMATORS, ESTIMATOR_NEEDS
from .kl import KL_CTRL_TYPES, KL_TYPES
from .rollout_correction import IS_LEVELS, RS_LEVELS

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
    policy (verl's names; formulas in verl_lite/algorithms/rollout_correction.py, docs/async.md)."""

    rollout_is: Optional[str] = None  # importance weights pi_old / pi_rollout on the policy loss: token | sequence | null (off)
    rollout_is_threshold: float = 2.0  # truncation cap of the importance weights (> 0)
    rollout_rs: Optional[str] = None  # rejection of tokens/sequences whose ratio leaves the bounds: token | sequence | geometric | null (off)
    rollout_rs_threshold: float = 2.0  # rejection upper bound of the ratio (> 1)
    rollout_rs_threshold_lower: Optional[float] = None  # rejection lower bound; null = 1 / rollout_rs_threshold
    bypass_mode: bool = False  # true: old log-probs = the rollout's (no recompute; the PPO ratio is pi / pi_rollout)

    def problems(self, tis_cap: float) -> list[str]:
        """The levels of its IS weights and rejection, their bounds, and that the actor's older
        ``tis_imp_ratio_cap`` (``tis_cap``) is not also on (two weightings of the same ratio)."""
        K = "algorithm.rollout_correction"
        out = []
        if self.rollout_is is not None:
            out += _choice(f"{K}.rollout_is", self.rollout_is, list(IS_LEVELS))
            if not self.rollout_is_threshold > 0:
                out.append(f"{K}.rollout_is_threshold={self.rollout_is_threshold} must be > 0 (the truncation cap)")
            if tis_cap > 0:
                out.append(f"{K}.rollout_is and actor_rollout_ref.actor.tis_imp_ratio_cap={tis_cap} weight the same "
                           f"ratio twice; keep one (set tis_imp_ratio_cap=-1)")
        if self.rollout_rs is not None:
            out += _choice(f"{K}.rollout_rs", self.rollout_rs, list(RS_LEVELS))
            lower = self.rollout_rs_threshold_lower
            if not self.rollout_rs_threshold > 1:
                out.append(f"{K}.rollout_rs_threshold={self.rollout_rs_threshold} must be > 1 (upper bound of the ratio)")
            elif lower is not None and not 0 <= lower < self.rollout_rs_threshold:
                out.append(f"{K}.rollout_rs_threshold_lower={lower} must lie in [0, rollout_rs_threshold)")
        if self.bypass_mode:
            out.append(f"{K}.bypass_mode=true (old log-probs = the rollout's, no recompute) is not built: the old "
                       f"log-probs are recomputed by the actor; set it false")
        return out


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

    def problems(self, n: int | None, n_key: str, tis_cap: float) -> list[str]:
        """Estimator, in-reward KL and its controller, gamma/lambda, DAPO's dynamic sampling and the rollout
        correction; ``n`` (None: not a valid size) = samples per prompt, set by ``n_key``; ``tis_cap`` = the
        actor's ``tis_imp_ratio_cap``."""
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
        return out + self.rollout_correction.problems(tis_cap)
