"""Loss aggregation: the normalization plan of Contract 1 (docs/contracts.md).

L = sum_{i,t} w_i,t l_i,t, w_i,t fixed by ``loss_agg_mode`` from row i's own mask (m_i,t, n_i) and the mini-batch's
N (valid tokens), B (rows, fully masked ones included) and H. A ``NormalizationPlan`` freezes N, B, H before
dispatch, so the contributions of any shards of whole rows sum to L (weight table: docs/algorithms.md, section 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_agg_mode(mode: str) -> str:
    """Return `mode` if it is a known aggregation mode, else raise naming the valid ones."""
    if mode not in AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {mode!r}. Valid modes: {', '.join(AGG_MODES)}.")
    return mode


@dataclass(frozen=True)
class NormalizationPlan:
    """The mini-batch constants N, B, H of the aggregation weights (module docstring), for one of AGG_MODES."""

    mode: str
    num_tokens: int
    num_seqs: int
    horizon: float

    def __post_init__(self):
        check_agg_mode(self.mode)
        if self.num_tokens < 0 or self.num_seqs < 0:
            raise ValueError(f"NormalizationPlan needs num_tokens >= 0 and num_seqs >= 0, got {self}.")
        if not self.horizon > 0:
            raise ValueError(f"NormalizationPlan.horizon must be > 0, got {self.horizon}.")
        if self.mode == "token-mean" and self.num_tokens == 0:
            raise ValueError(
                "token-mean aggregation over a mini-batch with N = 0 valid tokens is undefined. "
                "The controller must reject (or skip) such a mini-batch before dispatch."
            )
        if self.mode.startswith("seq-mean") and self.num_seqs == 0:
            raise ValueError(f"{self.mode} aggregation over an empty mini-batch (B = 0) is undefined.")

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor, mode: str, horizon: float | None = None) -> "NormalizationPlan":
        """The plan of the WHOLE mini-batch's response mask [B, W]: N = valid tokens, B = rows, H = horizon or W."""
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be [num_seqs, width], got shape {tuple(response_mask.shape)}.")
        num_tokens = int((response_mask != 0).sum().item())
        num_seqs, width = response_mask.shape
        h = float(width) if horizon is None else float(horizon)
        return cls(mode=mode, num_tokens=num_tokens, num_seqs=int(num_seqs), horizon=h)

    def token_weights(self, response_mask: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """w_i,t for a shard [b, W'] whose rows are whole trajectories of the mini-batch."""
        dtype = dtype or (response_mask.dtype if response_mask.is_floating_point() else torch.get_default_dtype())
        m = (response_mask != 0).to(dtype)
        if self.mode == "token-mean":
            return m / self.num_tokens
        if self.mode == "token-sum":
            return m
        if self.mode == "seq-mean-token-sum":
            return m / self.num_seqs
        if self.mode == "seq-mean-token-sum-norm":
            return m / (self.num_seqs * self.horizon)
        # seq-mean-token-mean: each row's own token count; rows with n_i = 0 get weight 0.
        n = m.sum(dim=-1, keepdim=True)
        return m / (self.num_seqs * n.clamp(min=1))

    def aggregate(self, per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """sum_{i,t} w_i,t * l_i,t over this shard (a scalar; shards sum to L)."""
        return masked_weighted_sum(per_token, self.token_weights(response_mask, per_token.dtype), response_mask)

    def token_mean(self, per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """sum_{i,t} m_i,t l_i,t / N over this shard (a metric that sums across shards; N = 0, possible for
        modes other than token-mean, gives 0)."""
        weights = (response_mask != 0).to(per_token.dtype) / max(self.num_tokens, 1)
        return masked_weighted_sum(per_token, weights, response_mask)


def masked_weighted_sum(values: torch.Tensor, weights: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """sum(w * v) over valid tokens; padding never leaks in (even inf/nan there)."""
    if values.shape != response_mask.shape:
        raise ValueError(
            f"per-token tensor shape {tuple(values.shape)} != response_mask shape {tuple(response_mask.shape)}."
        )
    valid = response_mask != 0
    return torch.where(valid, values * weights, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
