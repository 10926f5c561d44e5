"""The algorithm's rules: its names (from the registries of this package) and the ranges of its parameters.

One line per problem, naming the key and the fix; ``verl_lite.config.validate`` collects them with the rest of
the run config before any worker starts.
"""

from __future__ import annotations

from .advantages import ADVANTAGE_ESTIMATORS, ESTIMATOR_NEEDS
from .aggregation import AGG_MODES
from .kl import KL_CTRL_TYPES, KL_TYPES
from .rollout_correction import IS_LEVELS, RS_LEVELS

FILTER_GROUPS_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")  # DAPO's dynamic sampling signal


def needs(estimator: str) -> frozenset:
    """What an estimator needs (a critic, groups of samples, ...); nothing for an unknown name."""
    return ESTIMATOR_NEEDS.get(estimator, frozenset())


def choice_problem(key: str, value, choices) -> list[str]:
    return [] if value in choices else [f"{key}={value!r} is unknown; choose one of {list(choices)}"]


def kl_coefficient_problem(key: str, value) -> list[str]:
    return [] if value >= 0 else [f"{key}={value} must be >= 0 (a negative coefficient rewards drifting from the reference)"]


def algorithm_problems(alg, n: int | None, n_key: str) -> list[str]:
    """The ``algorithm`` section: estimator, in-reward KL and its controller, gamma/lambda, DAPO's dynamic
    sampling; ``n`` (None: not a valid size) = samples per prompt, set by ``n_key``."""
    out = choice_problem("algorithm.adv_estimator", alg.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
    grouped = [(f"algorithm.adv_estimator={alg.adv_estimator!r}", "groups" in needs(alg.adv_estimator)),
               ("algorithm.filter_groups.enable=true", alg.filter_groups.enable)]
    out += [f"{setting} compares samples of the same prompt; set {n_key} >= 2 (got {n})"
            for setting, grouped_here in grouped if grouped_here and n is not None and n < 2]
    if alg.use_kl_in_reward:
        out += choice_problem("algorithm.kl_penalty", alg.kl_penalty, KL_TYPES)
    out += choice_problem("algorithm.kl_ctrl.type", alg.kl_ctrl.type, KL_CTRL_TYPES)
    if alg.use_kl_in_reward:
        kc = alg.kl_ctrl
        out += kl_coefficient_problem("algorithm.kl_ctrl.kl_coef", kc.kl_coef)
        if kc.type == "adaptive":
            out += [f"algorithm.kl_ctrl.{name}={getattr(kc, name)} must be > 0 (the adaptive controller divides by it)"
                    for name in ("target_kl", "horizon") if not getattr(kc, name) > 0]
    if not 0.0 <= alg.gamma <= 1.0 or not 0.0 <= alg.lam <= 1.0:
        out.append(f"algorithm.gamma={alg.gamma} and algorithm.lam={alg.lam} must lie in [0, 1]")
    fg = alg.filter_groups
    if fg.enable:
        out += choice_problem("algorithm.filter_groups.metric", fg.metric, FILTER_GROUPS_METRICS)
        if not isinstance(fg.max_num_gen_batches, int) or fg.max_num_gen_batches < 1:
            out.append(f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 1: every "
                       f"step needs a bound on its generation rounds (verl's 0 = unbounded could loop forever)")
    return out


def rollout_correction_problems(rc, tis_cap: float) -> list[str]:
    """``algorithm.rollout_correction``: the levels of its IS weights and rejection, their bounds, and that the
    actor's older ``tis_imp_ratio_cap`` is not also on (two weightings of the same ratio)."""
    K = "algorithm.rollout_correction"
    out = []
    if rc.rollout_is is not None:
        out += choice_problem(f"{K}.rollout_is", rc.rollout_is, list(IS_LEVELS))
        if not rc.rollout_is_threshold > 0:
            out.append(f"{K}.rollout_is_threshold={rc.rollout_is_threshold} must be > 0 (the truncation cap)")
        if tis_cap > 0:
            out.append(f"{K}.rollout_is and actor_rollout_ref.actor.tis_imp_ratio_cap={tis_cap} weight the same ratio "
                       f"twice; keep one (set tis_imp_ratio_cap=-1)")
    if rc.rollout_rs is not None:
        out += choice_problem(f"{K}.rollout_rs", rc.rollout_rs, list(RS_LEVELS))
        lower = rc.rollout_rs_threshold_lower
        if not rc.rollout_rs_threshold > 1:
            out.append(f"{K}.rollout_rs_threshold={rc.rollout_rs_threshold} must be > 1 (upper bound of the ratio)")
        elif lower is not None and not 0 <= lower < rc.rollout_rs_threshold:
            out.append(f"{K}.rollout_rs_threshold_lower={lower} must lie in [0, rollout_rs_threshold)")
    if rc.bypass_mode:
        out.append(f"{K}.bypass_mode=true (old log-probs = the rollout's, no recompute) is not built: the old "
                   f"log-probs are recomputed by the actor; set it false")
    return out
