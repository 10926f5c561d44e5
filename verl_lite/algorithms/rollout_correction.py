"""Off-policy correction between the behaviour policy and the trainer's old policy (verl's
``algorithm.rollout_correction``, verl >= 0.8's vocabulary as in verl 0.9.1's ``rollout_corr_helper``).

Per valid token, l = log pi_old - log pi_rollout (clamped to +-SAFETY_BOUND): IS weights (``rollout_is``: exp(l) per
token, or exp(row sum of l) on the whole row; TIS cap or IcePop bounds; optional batch normalization) multiply the
per-token policy loss without gradient; rejection (``rollout_rs``) zeroes tokens in ``Correction.keep`` (verl's
``modified_response_mask``); whether they stay in the loss's denominators is the caller's choice
(``rejected_in_denominator``). KL(behaviour || old) metrics, token means: ``kl`` = E[-l], ``k3_kl`` =
E[exp(l) - l - 1]. Every option, bound and metric: docs/algorithms.md, "Rollout correction".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # verl's rollout_rs options
RS_LEGACY = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}  # ours -> verl's option
LOSS_TYPES = ("ppo_clip", "reinforce")  # verl's bypass-mode loss_type
SAFETY_BOUND = 20.0
EPS = 1e-8  # verl's masked_mean denominator guard


# ------------------------------------------------------------------ settings (verl's strings, parsed once)
def parse_is_threshold(spec) -> tuple[float, Optional[float]]:
    """``rollout_is_threshold`` as (upper, lower): a number or number-like string = TIS cap (lower None);
    ``"lower_upper"`` = IcePop bounds. Raises ValueError naming what is wrong (verl's rules)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{spec!r} must be a number (TIS cap) or a 'lower_upper' string (IcePop bounds)")
    lower = None
    try:
        if isinstance(spec, str) and "_" in spec.strip():
            lower_text, upper_text = spec.strip().split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            upper = float(spec)
    except ValueError:
        raise ValueError(f"{spec!r} is not a number nor a 'lower_upper' pair of numbers") from None
    if not upper > 0:
        raise ValueError(f"{spec!r}: the upper bound must be > 0")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"{spec!r}: the lower bound must lie in (0, upper]")
    return upper, lower


@dataclass(frozen=True)
class RejectionRule:
    """One rejection option: verl's name and its bounds (k1: on the ratio pi_rollout / pi_old; k2/k3: an
    upper bound on the divergence, ``lower`` None)."""

    option: str
    upper: float
    lower: Optional[float] = None


def rejection_rules(rollout_rs: str, threshold, legacy_lower: Optional[float] = None) -> list[RejectionRule]:
    """``rollout_rs`` / ``rollout_rs_threshold`` as rules, by verl's parsing: a comma list of options (duplicates
    dropped), one threshold for all or one per option (comma list); k1 takes ``lower_upper`` or one number U
    (= [1/U, U]), k2/k3 one number. Ours (``RS_LEGACY``) take a number U > 1 on pi_old / pi_rollout and
    ``legacy_lower`` (default 1 / U). Raises ValueError naming what is wrong."""
    if rollout_rs in RS_LEGACY:
        upper = float(threshold)
        lower = 1.0 / upper if legacy_lower is None else float(legacy_lower)
        return [RejectionRule(RS_LEGACY[rollout_rs], upper=math.inf if lower == 0 else 1.0 / lower, lower=1.0 / upper)]
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"{rollout_rs!r}: unknown option(s) {unknown}; choose from {list(RS_OPTIONS)} (a comma "
                         f"list keeps a token only when every option keeps it) or ours {list(RS_LEGACY)}")
    if threshold is None or isinstance(threshold, bool):
        raise ValueError("a threshold is needed for every rollout_rs option")
    specs = [p.strip() for p in str(threshold).split(",") if p.strip()] if isinstance(threshold, str) else [str(threshold)]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{threshold!r}: give one threshold for all options or one per option ({len(options)})")
    rules = []
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        try:
            if option.endswith("k1"):
                lower_text, upper_text = spec.split("_", 1) if "_" in spec else (None, spec)
                upper = float(upper_text)
                lower = 1.0 / upper if lower_text is None else float(lower_text)
            elif "_" in spec:
                raise ValueError(f"{option} takes one upper bound, not a 'lower_upper' pair ({spec!r})")
            else:
                upper, lower = float(spec), None
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(str(e) if "takes one" in str(e) else f"{spec!r} for {option} is not a number") from None
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"{spec!r} for {option}: bounds must be > 0 (and lower <= upper)")
        rules.append(RejectionRule(option, upper=upper, lower=lower))
    return rules


# ------------------------------------------------------------------ verl's reductions
def _masked_sum(x: torch.Tensor, m: torch.Tensor, axis=None) -> torch.Tensor:
    return (torch.where(m.bool(), x, 0.0) * m).sum(axis=axis)


def _masked_mean(x: torch.Tensor, m: torch.Tensor, axis=None) -> torch.Tensor:
    """verl's ``masked_mean``: sum / (count + 1e-8)."""
    return _masked_sum(x, m, axis) / (m.sum(axis=axis) + EPS)


def _clamped_stats(x: torch.Tensor, m: torch.Tensor, lo: float, hi: float):
    """(x clamped to [lo, hi], its masked mean, verl's std of it over the valid tokens: 0 for at most one)."""
    clamped = x.clamp(min=lo, max=hi)
    mean = _masked_mean(clamped, m)
    if not m.sum() > 1:
        return clamped, mean, 0.0
    var = _masked_mean(clamped.square(), m) - mean.square()
    return clamped, mean, torch.sqrt(torch.clamp(var, min=0.0)).item()


def _seq_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    masked = x.masked_fill(~m.bool(), float("-inf")).max(dim=-1).values
    return torch.where(masked == float("-inf"), torch.zeros_like(masked), masked)


# ------------------------------------------------------------------ the correction
@dataclass
class Correction:
    weights: torch.Tensor | None  # [n, W]: IS weight x keep (1 on kept tokens when rollout_is is off), 0 on
    # padding; None when neither rollout_is nor rollout_rs is on (metrics only: the loss is not reweighted)
    keep: torch.Tensor  # [n, W] float: 1 where rejection keeps the token and it is valid (verl's modified mask)
    metrics: dict  # name -> 0-dim tensor or float (see the module docstring)
    is_weights: torch.Tensor | None = None  # [n, W] verl's rollout_is_weights (no rejection); None: IS off


def _is_weights(log_ratio, m, level, upper, lower):
    """(applied weights, raw weights, the log-ratio verl's metrics read) of verl's compute_rollout_correction_weights."""
    if level == "token":
        metric_log_ratio = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        metric_log_ratio = _masked_sum(log_ratio, m, axis=-1).unsqueeze(-1)
        raw = torch.exp(metric_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * m
    if lower is None:
        applied = raw.clamp(max=upper)
    else:
        applied = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return applied, raw, metric_log_ratio


def _batch_norm_factor(w, m, level) -> torch.Tensor:
    if level == "token":
        return _masked_mean(w, m)
    seq_weights = _masked_mean(w, m, axis=-1)
    seq_mask = (m.sum(dim=-1) > 0).to(w.dtype)
    return (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(EPS)


def _rule_statistic(rule: RejectionRule, log_ratio, m):
    """(per-token statistic, per-row statistic or None, token keep bool) of one option, verl's formulas."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}[rule.option[-2:]]
    scope = rule.option[:-3]
    per_seq = None if scope == "token" else {"seq_sum": lambda: _masked_sum(token, m, axis=-1),
                                            "seq_mean": lambda: _masked_mean(token, m, axis=-1),
                                            "seq_max": lambda: _seq_max(token, m)}[scope]()
    stat = token if per_seq is None else per_seq
    if rule.lower is not None:
        keep = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
    else:
        keep = stat <= rule.upper
    if per_seq is not None:
        return per_seq.unsqueeze(-1).expand_as(m), per_seq, keep.unsqueeze(-1).expand_as(m.bool())
    return token, None, keep


@torch.no_grad()
def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
                       rollout_is: str | None, rollout_is_threshold, rollout_rs: str | None,
                       rollout_rs_threshold, rollout_rs_threshold_lower: float | None = None,
                       rollout_is_batch_normalize: bool = False, num_tokens: int | None = None,
                       num_seqs: int | None = None) -> Correction:
    """The weights, the rejection mask and the metrics of the module docstring, for rows that are whole
    trajectories. The settings are ``algorithm.rollout_correction``'s (their defaults live in the config schema
    only); ``rollout_is`` / ``rollout_rs`` None turn that part off. ``num_tokens`` / ``num_seqs``: the step's N
    and B when these rows are a shard of it (then ours metrics only, and no batch normalization, which needs
    the whole step); default: these rows are the whole step."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r}; choose one of {list(IS_LEVELS)} or None")
    whole = num_tokens is None and num_seqs is None
    if rollout_is_batch_normalize and rollout_is is not None and not whole:
        raise ValueError("rollout_is_batch_normalize needs the whole step's weights (a shard was given)")
    m = (response_mask != 0).to(old_log_probs.dtype)
    valid = m.bool()
    n_tok = int(m.sum()) if num_tokens is None else num_tokens
    n_seq = m.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return _masked_sum(x, m) / max(n_tok, 1)

    def extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
        if not valid.any():
            return torch.tensor(float("-inf") if largest else float("inf"), dtype=x.dtype)
        return x[valid].max() if largest else x[valid].min()

    log_ratio = old_log_probs - rollout_log_probs
    masked_log_ratio = torch.where(valid, log_ratio, 0.0)
    metrics: dict = {"rollout/logprob_diff_mean": token_mean(masked_log_ratio.abs()),
                     "rollout/logprob_diff_max": extreme(masked_log_ratio.abs(), True)}
    is_weights = is_parts = factor = None
    w = torch.ones_like(m)
    if rollout_is is not None:
        upper, lower = parse_is_threshold(rollout_is_threshold)
        applied, raw, metric_log_ratio = _is_weights(log_ratio, m, rollout_is, upper, lower)
        is_parts = (rollout_is, upper, lower, applied, raw, metric_log_ratio)
        metrics["rollout_corr/is_truncated_fraction"] = token_mean((raw > upper).to(m.dtype))
        metrics["rollout_corr/is_raw_weight_mean"] = token_mean(raw)
        metrics["rollout_corr/is_weight_mean"] = token_mean(applied)
        metrics["rollout_corr/is_weight_max"] = extreme(applied, True)
        metrics["rollout_corr/is_weight_min"] = extreme(applied, False)
        is_weights = applied
        if rollout_is_batch_normalize:
            factor = _batch_norm_factor(applied, m, rollout_is)
            is_weights = applied / factor if factor > EPS else applied
        w = is_weights
    keep = m.clone()
    rules = [] if rollout_rs is None else rejection_rules(rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower)
    rule_stats = [(rule, _rule_statistic(rule, log_ratio, m)) for rule in rules]
    for _, (_, _, keep_bool) in rule_stats:
        keep = keep * keep_bool.to(m.dtype)
    if rules:
        metrics["rollout_corr/rs_masked_fraction"] = token_mean(m - keep)
        rejected_rows = (keep.sum(-1) == 0) & (m.sum(-1) > 0)
        metrics["rollout_corr/rs_rejected_seq_fraction"] = rejected_rows.sum().to(m.dtype) / max(n_seq, 1)
    # verl's kl / k3_kl (their masked_mean's 1e-8 guard; N = the step's, so shards add up)
    metrics["rollout_corr/kl"] = (-masked_log_ratio).sum() / (n_tok + EPS)
    metrics["rollout_corr/k3_kl"] = _masked_sum(torch.exp(log_ratio) - log_ratio - 1, m) / (n_tok + EPS)
    if whole and valid.any():
        metrics.update(verl_metrics(old_log_probs, rollout_log_probs, m, is_parts, factor, rule_stats))
    weights = w * keep if rollout_is is not None or rules else None
    return Correction(weights=weights, keep=keep, metrics=metrics, is_weights=is_weights)


# ------------------------------------------------------------------ verl's metrics (whole step)
def verl_metrics(old_log_probs, rollout_log_probs, m, is_parts, factor, rule_stats) -> dict[str, float]:
    """Every metric verl 0.9.1's ``compute_rollout_correction_and_rejection_mask`` logs, with its names
    (``rollout_corr/`` prefix) and formulas, for the whole step's rows (at least one valid token), from what
    ``rollout_correction`` computed: ``is_parts`` = (level, upper, lower, *_is_weights(...)) (None: IS off),
    ``factor`` = _batch_norm_factor(...) (None: off), ``rule_stats`` = [(rule, _rule_statistic(rule, ...))]."""
    out: dict[str, float] = {}
    if is_parts is not None:
        level, upper, lower, applied, raw, metric_log_ratio = is_parts
        out.update(_is_metrics(applied, raw, metric_log_ratio, m, level, upper, lower))
        if lower is not None:
            out["rollout_is_oob_ratio"] = _masked_mean(((raw < lower) | (raw > upper)).float(), m).item()
        if factor is not None:
            out["rollout_is_batch_norm_factor"] = factor.item() if factor > EPS else 1.0
    if rule_stats:
        out.update(_rs_metrics(m, rule_stats))
    out.update(_offpolicy_metrics(old_log_probs, rollout_log_probs, m))
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def _is_metrics(w, raw, metric_log_ratio, m, level, upper, lower) -> dict[str, float]:
    out: dict[str, float] = {}
    lower_metric = 1.0 / upper if lower is None else lower
    log_upper = torch.log(torch.tensor(upper))
    log_lower = torch.log(torch.tensor(lower_metric))
    out["rollout_is_mean"] = _masked_mean(w, m).item()
    if level == "sequence":
        out["rollout_is_max"] = torch.exp(torch.clamp(metric_log_ratio.max(), max=SAFETY_BOUND)).item()
        out["rollout_is_min"] = torch.exp(metric_log_ratio.min()).item()
        out["rollout_is_ratio_fraction_high"] = (metric_log_ratio > log_upper).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (metric_log_ratio < log_lower).float().mean().item()
    else:
        out["rollout_is_ratio_fraction_high"] = _masked_mean((raw > upper).float(), m).item()
        out["rollout_is_ratio_fraction_low"] = _masked_mean((raw < lower_metric).float(), m).item()
        out["rollout_is_max"] = w.masked_fill(~m.bool(), float("-inf")).max().item()
        out["rollout_is_min"] = w.masked_fill(~m.bool(), float("inf")).min().item()
    clamped, mean_clamped, out["rollout_is_std"] = _clamped_stats(w, m, 0.0, upper)
    normalized = clamped / (mean_clamped + EPS)
    second_moment = _masked_mean(normalized.square(), m).item()  # 0 when IcePop zeroes every weight (verl raises)
    out["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else 0.0
    seq_mean = _masked_mean(w, m, axis=-1)
    out["rollout_is_seq_mean"] = seq_mean.mean().item()
    out["rollout_is_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = seq_mean.max().item()
    out["rollout_is_seq_min"] = seq_mean.min().item()
    out["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
    raw_seq_mean = _masked_mean(raw, m, axis=-1)
    out["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
    out["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower_metric).float().mean().item()
    return out


def _rs_metrics(m, rule_stats) -> dict[str, float]:
    out: dict[str, float] = {}
    valid = m.bool()
    seq_valid = m.sum(dim=-1) > 0
    combined = torch.ones_like(m)
    for rule, (stat, per_seq, keep_bool) in rule_stats:
        k1 = rule.lower is not None
        hi = math.log(rule.upper) if k1 else rule.upper
        lo = math.log(rule.lower) if k1 else 0.0
        out.update(_rs_option_metrics(rule.option, stat, per_seq, m, seq_valid, hi, lo, k1))
        keep = keep_bool.to(m.dtype)
        combined = combined * keep
        seq_keep = (~((~keep_bool) & valid)).all(dim=-1)
        out[f"rollout_rs_{rule.option}_masked_fraction"] = _masked_mean(1 - keep, m).item()
        seq_valid_f = seq_valid.float()
        out[f"rollout_rs_{rule.option}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(m.dtype)) * seq_valid_f).sum() / seq_valid_f.sum()).item() if seq_valid_f.sum() > 0
            else 0.0)
    out["rollout_rs_masked_fraction"] = _masked_mean(1 - combined, m).item()
    final_keep = (combined > 0.5) & valid
    out["rollout_rs_seq_masked_fraction"] = (~final_keep & valid).any(dim=-1).float().mean().item()
    return out


def _rs_option_metrics(name, stat, per_seq, m, seq_valid, hi, lo, apply_lower) -> dict[str, float]:
    p = f"rollout_rs_{name}"
    valid = m.bool()
    v = (per_seq if per_seq is not None else _masked_mean(stat, m, axis=-1))[seq_valid]  # per valid row
    seq = dict.fromkeys(("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                         "seq_fraction_low"), 0.0)
    if v.numel() > 0:
        seq = {"seq_mean": v.mean().item(), "seq_std": v.std().item() if v.numel() > 1 else 0.0,
               "seq_max": v.max().item(), "seq_min": v.min().item(), "seq_max_deviation": v.abs().max().item(),
               "seq_fraction_high": (v > hi).float().mean().item()}
        if apply_lower:
            seq["seq_fraction_low"] = (v < lo).float().mean().item()
    out = {f"{p}_mean": _masked_mean(stat, m).item()}
    if per_seq is not None and v.numel() > 0:  # a sequence option: its extremes and fractions are the rows'
        out.update({f"{p}_{k}": seq.get(f"seq_{k}", 0.0) for k in ("max", "min", "fraction_high", "fraction_low")})
    else:
        out[f"{p}_max"] = stat.masked_fill(~valid, float("-inf")).max().item()
        out[f"{p}_min"] = stat.masked_fill(~valid, float("inf")).min().item()
        out[f"{p}_fraction_high"] = _masked_mean((stat > hi).float(), m).item()
        out[f"{p}_fraction_low"] = _masked_mean((stat < lo).float(), m).item() if apply_lower else 0.0
    out[f"{p}_std"] = _clamped_stats(stat, m, lo if apply_lower else 0.0, hi)[2]
    return out | {f"{p}_{k}": x for k, x in seq.items()}


def _offpolicy_metrics(old_log_probs, rollout_log_probs, m) -> dict[str, float]:
    mean_old = _masked_mean(old_log_probs, m, axis=-1)
    mean_rollout = _masked_mean(rollout_log_probs, m, axis=-1)
    log_ratio = old_log_probs - rollout_log_probs
    log_ppl_diff = mean_rollout - mean_old
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_sum = _masked_sum(log_ratio, m, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-mean_old).mean().item(),
        "training_log_ppl": (-mean_old).mean().item(),
        "kl": _masked_mean(rollout_log_probs - old_log_probs, m).item(),
        "k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1, m).item(),
        "rollout_ppl": torch.exp(-mean_rollout).mean().item(),
        "rollout_log_ppl": (-mean_rollout).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
        "chi2_token": (_masked_mean(rho.square(), m) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq_sum).mean() - 1.0).item(),
    }
