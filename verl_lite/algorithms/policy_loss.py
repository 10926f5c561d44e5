"""Policy losses, as PER-TOKEN losses (never aggregated here), each with the signature

    fn(old_log_prob, log_prob, advantages, response_mask, cfg: ActorLossConfig,
       is_weights=None, cov_mask=None) -> (per_token_loss [n, W], metrics: dict[str, Tensor [n, W]])

The caller aggregates the loss through a `NormalizationPlan` and the detached metrics as token means
(objective.py). Notation (docs/algorithms.md, "Notation" and section 2): A = advantages, delta = log_prob -
old_log_prob, r = exp(clamp(delta, -20, 20)), eps_lo / eps_hi = clip_ratio_low / _high, sg = stop-gradient; IS
weights multiply the loss. clip_cov / kl_cov read `cov_mask`, selected once per mini-batch by `select_cov_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}
# what a loss needs besides (old) log-probs and advantages: "cov_mask" (select_cov_tokens' selection, computed
# before dispatch from the old log-probs, so the trainer always runs the old-log-prob pass)
LOSS_NEEDS: dict[str, frozenset[str]] = {}
COV_SELECTION_LOSSES = ("clip_cov", "kl_cov")
RATIO_LOG_CLAMP = 20.0


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss`` section: which policy loss, and the parameters of the losses that have them."""

    loss_mode: str = "vanilla"  # a name in verl_lite.algorithms' policy-loss registry (vanilla, gspo, ...)
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of the mini-batch's tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance window lower bound
    clip_cov_ub: float = 5.0  # clip_cov: covariance window upper bound
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty
    tau_pos: float = 1.0  # sapo: gate temperature for A > 0
    tau_neg: float = 1.05  # sapo: gate temperature for A <= 0


class ClipRange:
    """The PPO clip range of a config with ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (a null side
    is ``clip_ratio``): eps_lo / eps_hi of the losses, and the rule that each is > 0."""

    @property
    def eps_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def clip_range_problems(self, key: str) -> list[str]:
        return [f"{key}.{name}={getattr(self, name)} must be > 0" for name in ("clip_ratio", "clip_ratio_low",
                "clip_ratio_high") if getattr(self, name) is not None and not getattr(self, name) > 0]


def register_policy_loss(name: str, needs: tuple[str, ...] = ()) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register `fn` under `name` (re-registering another function is an error);
    ``needs`` lists what it needs (see LOSS_NEEDS)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"Policy loss {name!r} is already registered to {POLICY_LOSSES[name]}.")
        POLICY_LOSSES[name] = fn
        LOSS_NEEDS[name] = frozenset(needs)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"Unknown policy loss {name!r}. Registered: {', '.join(sorted(POLICY_LOSSES))}.")
    return POLICY_LOSSES[name]


def _row_mean(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """sum_t m x / max(n_i, 1) per row, padding ignored even if non-finite -> [n]."""
    valid = response_mask != 0
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=-1)
    return total / valid.sum(dim=-1).clamp(min=1).to(x.dtype)


def _ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    delta = torch.clamp(log_prob - old_log_prob, min=-RATIO_LOG_CLAMP, max=RATIO_LOG_CLAMP)
    return delta, torch.exp(delta)


def _ppo_terms(ratio: torch.Tensor, advantages: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(-A r, -A clip(r, 1-eps_lo, 1+eps_hi)): the two terms of PPO's clipped objective."""
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)


def _apply_is_weights(loss: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    return loss if is_weights is None else loss * is_weights.detach()


def _require_cov_mask(name: str, cov_mask: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    if cov_mask is None:
        raise ValueError(
            f"policy loss {name!r} needs `cov_mask`: compute it ONCE over the whole mini-batch with "
            f"verl_lite.algorithms.select_cov_tokens(...) before dispatch and carry it with the data."
        )
    if cov_mask.shape != ref.shape:
        raise ValueError(f"cov_mask shape {tuple(cov_mask.shape)} != log_prob shape {tuple(ref.shape)}.")
    return (cov_mask != 0).to(ref.dtype)


@register_policy_loss("vanilla")
def vanilla_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """PPO clip with asymmetric range and dual clip.

    c1 = max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi));  l = min(c1, -A c) if A < 0 else c1.
    """
    delta, ratio = _ratio(old_log_prob, log_prob)
    loss1, loss2 = _ppo_terms(ratio, advantages, cfg)
    clipped1 = torch.maximum(loss1, loss2)
    loss3 = -advantages * cfg.clip_ratio_c
    clipped2 = torch.minimum(loss3, clipped1)
    loss = torch.where(advantages < 0, clipped2, clipped1)
    dt = log_prob.dtype
    metrics = {
        "pg_clipfrac": (loss2 > loss1).to(dt),
        "pg_clipfrac_lower": ((clipped1 > loss3) & (advantages < 0)).to(dt),
        "ppo_kl": -delta.detach(),
    }
    return _apply_is_weights(loss, is_weights), metrics


@register_policy_loss("gspo")
def gspo_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """GSPO: token ratio s_i,t = exp(logp - sg(logp) + sg(mean_t delta_i)) (log clamped <= 10),
    then PPO clip without dual clip: l = max(-A s, -A clip(s, 1-eps_lo, 1+eps_hi)).
    The value of s_i,t is the sequence ratio; its gradient is the token's own d logp."""
    delta = log_prob - old_log_prob
    seq_log_ratio = _row_mean(delta, response_mask).detach()
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.unsqueeze(-1), max=10.0)
    loss1, loss2 = _ppo_terms(torch.exp(log_s), advantages, cfg)
    loss = torch.maximum(loss1, loss2)
    metrics = {"pg_clipfrac": (loss2 > loss1).to(log_prob.dtype), "ppo_kl": -delta.detach()}
    return _apply_is_weights(loss, is_weights), metrics


@register_policy_loss("gpg")
def gpg_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """GPG: l = -A logp (plain policy gradient, no ratio)."""
    loss = -log_prob * advantages
    return _apply_is_weights(loss, is_weights), {"ppo_kl": (old_log_prob - log_prob).detach()}


@register_policy_loss("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """CISPO: l = -sg(clip(r, 1-eps_lo, 1+eps_hi)) A logp."""
    delta, ratio = _ratio(old_log_prob, log_prob)
    clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = -clipped.detach() * advantages * log_prob
    metrics = {"pg_clipfrac": (ratio != clipped).to(log_prob.dtype), "ppo_kl": -delta.detach()}
    return _apply_is_weights(loss, is_weights), metrics


@register_policy_loss("sapo")
def sapo_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """SAPO: l = -A sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos if A > 0 else tau_neg."""
    delta, ratio = _ratio(old_log_prob, log_prob)
    tau = torch.where(
        advantages > 0,
        torch.tensor(cfg.policy_loss.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.tensor(cfg.policy_loss.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * advantages
    return _apply_is_weights(loss, is_weights), {"ppo_kl": -delta.detach()}


@register_policy_loss("geo_mean")
def geo_mean_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """GMPO (geometric-mean policy optimisation), as a per-token loss (docs/algorithms.md, section 2.6).

    Token clip in log space: d_c = sgn(A) min(sgn(A) delta, sgn(A) clamp(delta, -eps_lo, eps_hi)).
    Sequence loss: L_i = -mean_t(A) exp(mean_t d_c)  [x geometric mean of the row's IS weights].
    l_i,t = L_i on every valid token of row i (seq-mean-token-mean gives GMPO's (1/B) sum_i L_i).
    """
    delta = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    delta_clamped = torch.clamp(delta, min=-cfg.eps_low, max=cfg.eps_high)
    delta_min = sgn * torch.minimum(sgn * delta, sgn * delta_clamped)
    seq_ratio = torch.exp(_row_mean(delta_min, response_mask))
    seq_adv = _row_mean(advantages, response_mask)
    seq_loss = -seq_adv * seq_ratio
    if is_weights is not None:
        seq_loss = seq_loss * torch.exp(_row_mean(torch.log(is_weights.detach() + 1e-10), response_mask))
    loss = seq_loss.unsqueeze(-1).expand_as(log_prob)
    clipped = delta != delta_clamped
    dt = log_prob.dtype
    metrics = {
        "pg_clipfrac": (clipped & (advantages > 0)).to(dt),
        "pg_clipfrac_lower": (clipped & (advantages < 0)).to(dt),
        "ppo_kl": -delta.detach(),
    }
    return loss, metrics


@register_policy_loss("clip_cov", needs=("cov_mask",))
def clip_cov_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """Clip-Cov: PPO clip (no dual clip), and the selected tokens (cov_mask) get loss 0.

    l = max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi)) (1 - sel)."""
    selected = _require_cov_mask("clip_cov", cov_mask, log_prob)
    delta, ratio = _ratio(old_log_prob, log_prob)
    loss1, loss2 = _ppo_terms(ratio, advantages, cfg)
    loss = torch.maximum(loss1, loss2) * (1 - selected)
    metrics = {
        "pg_clipfrac": (loss2 > loss1).to(log_prob.dtype),
        "cov_selected_frac": selected.detach(),
        "ppo_kl": -delta.detach(),
    }
    return _apply_is_weights(loss, is_weights), metrics


@register_policy_loss("kl_cov", needs=("cov_mask",))
def kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, cov_mask=None):
    """KL-Cov: l = -A r + sel * ppo_kl_coef * |delta| (no clip)."""
    selected = _require_cov_mask("kl_cov", cov_mask, log_prob)
    delta, ratio = _ratio(old_log_prob, log_prob)
    loss = -advantages * ratio + selected * cfg.policy_loss.ppo_kl_coef * delta.abs()
    metrics = {
        "cov_selected_frac": selected.detach(),
        "ppo_kl": -delta.detach(),
        "ppo_kl_abs": delta.detach().abs(),
    }
    return _apply_is_weights(loss, is_weights), metrics


def clipped_by_ppo_range(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                         cfg) -> torch.Tensor:
    """Tokens whose PPO term is already clipped: -A clip(r, 1-eps_lo, 1+eps_hi) > -A r (bool [n, W])."""
    loss1, loss2 = _ppo_terms(_ratio(old_log_prob, log_prob)[1], advantages, cfg)
    return loss2 > loss1


@torch.no_grad()
def select_cov_tokens(
    loss_name: str,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg,
    seed: int = 0,
    log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token selection of clip_cov / kl_cov (verl's), computed ONCE over a whole mini-batch (docs/algorithms.md,
    section 2.8). ``log_probs``: the CURRENT policy's (None = ``old_log_probs``, on-policy).
    cov_i,t = (A_i,t - mean A) (logp_i,t - mean logp), means over the mini-batch's N valid tokens.
      kl_cov:   the top max(1, floor(kl_cov_ratio N)) tokens by cov (ties: lower flat index first).
      clip_cov: of the valid tokens not ``clipped_by_ppo_range`` with clip_cov_lb < cov < clip_cov_ub,
                min(max(1, floor(clip_cov_ratio N)), #candidates) chosen uniformly, seeded by `seed`.
    Returns a bool mask [n, W]; every shard's `cov_mask` is its rows of this mask.
    """
    if loss_name not in COV_SELECTION_LOSSES:
        raise ValueError(f"select_cov_tokens is for {COV_SELECTION_LOSSES}, got {loss_name!r}.")
    current = old_log_probs if log_probs is None else log_probs
    if current.shape != old_log_probs.shape:
        raise ValueError(f"log_probs shape {tuple(current.shape)} != old_log_probs shape {tuple(old_log_probs.shape)}.")
    valid = response_mask != 0
    selected = torch.zeros_like(valid)
    num_valid = int(valid.sum().item())
    if num_valid == 0:
        return selected
    adv = advantages[valid].double()
    logp = current[valid].double()
    cov = (adv - adv.mean()) * (logp - logp.mean())
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if loss_name == "kl_cov":
        k = max(1, int(num_valid * cfg.policy_loss.kl_cov_ratio))
        order = torch.sort(cov, descending=True, stable=True).indices[:k]
        chosen = flat_valid[order]
    else:
        k = max(1, int(cfg.policy_loss.clip_cov_ratio * num_valid))
        clipped = clipped_by_ppo_range(old_log_probs, current, advantages, cfg)[valid]
        candidates = torch.nonzero((cov > cfg.policy_loss.clip_cov_lb) & (cov < cfg.policy_loss.clip_cov_ub) & ~clipped, as_tuple=True)[0]
        generator = torch.Generator().manual_seed(int(seed))
        perm = torch.randperm(len(candidates), generator=generator)
        chosen = flat_valid[candidates[perm[: min(k, len(candidates))]]]
    selected.view(-1)[chosen.to(selected.device)] = True
    return selected
