"""KL estimators (per token), KL controllers and the in-reward KL penalty (docs/algorithms.md, section 4).

With d = logp - ref_logp: k1 / kl d, abs |d|, k2 / mse d^2 / 2, k3 / low_var_kl clamp(e^x - x - 1, -10, 10) with
x = clamp(-d, -20, 20). `X+` (e.g. `k3+`) has the value of X and the gradient of k2: k2 - sg(k2) + sg(X).
"""

from __future__ import annotations

import torch

BASE_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_TYPES = BASE_KL_TYPES + tuple(kind + "+" for kind in BASE_KL_TYPES)  # every valid `kind`


def _kl_value(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        x = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)
    if kind == "full":
        raise NotImplementedError("kl type 'full' (needs full-vocabulary log-probs) is not implemented.")
    valid = ", ".join(KL_TYPES)
    raise ValueError(f"Unknown KL type {kind!r}. Valid types: {valid}.")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (see module docstring)."""
    if not kind.endswith("+"):
        return _kl_value(logp, ref_logp, kind)
    base = kind[:-1]
    value = _kl_value(logp, ref_logp, base)
    if base in ("mse", "k2"):
        return value
    k2 = _kl_value(logp, ref_logp, "k2")
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """beta stays `kl_coef`."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController horizon must be > 0, got {horizon}.")
        if not target_kl > 0:
            raise ValueError(f"AdaptiveKLController target_kl must be > 0, got {target_kl}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CTRL_TYPES = ("fixed", "adaptive")


def get_kl_controller(type: str, kl_coef: float, target_kl: float, horizon: float):
    """Build a controller from verl's `algorithm.kl_ctrl` fields (their defaults: the config schema)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown kl_ctrl.type {type!r}. Valid: {', '.join(map(repr, KL_CTRL_TYPES))}.")


@torch.no_grad()
def apply_kl_penalty(
    scores: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl,
    kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """In-reward KL: token_level_rewards = scores - beta * kl(old_logp, ref_logp) * m, beta the controller's value
    before the update; then the controller is updated with current_kl (the mean over all n rows of each row's
    token-mean KL, an empty row 0; docs/algorithms.md, section 4) and n_steps = n.
    Returns (token_level_rewards, {"kl", "kl_coef"}).
    """
    m = (response_mask != 0).to(scores.dtype)
    kld = kl_penalty(old_logp, ref_logp, kind) * m
    beta = kl_ctrl.value
    rewards = scores - beta * kld
    row_kl = kld.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # an empty row: 0 / 1 = 0
    current_kl = float(row_kl.mean().item()) if row_kl.numel() else 0.0
    kl_ctrl.update(current_kl, n_steps=scores.shape[0])
    return rewards, {"kl": current_kl, "kl_coef": beta}
