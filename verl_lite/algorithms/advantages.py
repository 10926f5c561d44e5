"""Advantage estimators, by name (run on the driver, on the whole RL-step batch).

All inputs are response-aligned [n, W] tensors; `index` holds one prompt uid per row (any
hashable values: list, numpy array, tensor) and defines the groups g. s_i = sum_t r_i,t is the
outcome score of row i. Outcome estimators return (adv, adv) with adv = a_i * m_i,t. Every
estimator returns tensors that are 0 on masked positions. Formulas: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
# What an estimator needs besides the rewards, read by pre-flight validation and the trainer:
#   "critic"            values from a value model (the trainer runs the critic role)
#   "baseline_rollout"  reward_baselines: the score of one greedy response per prompt
#   "groups"            several samples per prompt (rollout.n >= 2) sharing a uid
ESTIMATOR_NEEDS: dict[str, frozenset[str]] = {}
ESTIMATOR_REQUIREMENTS = ("critic", "baseline_rollout", "groups")
GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8


def register_advantage_estimator(name: str, needs: tuple[str, ...] = ()):
    """Decorator: register ``fn`` under ``name``; ``needs`` lists its ESTIMATOR_REQUIREMENTS."""
    if unknown := set(needs) - set(ESTIMATOR_REQUIREMENTS):
        raise ValueError(f"unknown estimator requirements {sorted(unknown)}; choose from {ESTIMATOR_REQUIREMENTS}")

    def decorator(fn):
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not fn:
            raise ValueError(f"Advantage estimator {name!r} is already registered.")
        ADVANTAGE_ESTIMATORS[name] = fn
        ESTIMATOR_NEEDS[name] = frozenset(needs)
        return fn

    return decorator


def estimator_needs(name: str) -> frozenset[str]:
    """The requirements of a registered estimator (see ESTIMATOR_NEEDS)."""
    get_advantage_estimator(name)
    return ESTIMATOR_NEEDS[name]


def get_advantage_estimator(name: str) -> Callable:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"Unknown advantage estimator {name!r}. Registered: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}."
        )
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single entry point: (advantages [n, W], returns [n, W]) of estimator `name`."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [n, W]."
        )
    fn = get_advantage_estimator(name)
    with torch.no_grad():
        return fn(
            token_level_rewards,
            response_mask,
            index=index,
            values=values,
            reward_baselines=reward_baselines,
            gamma=gamma,
            lam=lam,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8), mean and UNBIASED var over the (at least 2) valid entries of the batch."""
    valid = mask != 0
    count = int(valid.sum().item())
    if count < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 valid tokens in the batch, got {count}: the unbiased "
            "variance is undefined. Use a larger batch or an estimator without whitening."
        )
    x = values[valid]
    mean = x.mean()
    var = (x - mean).square().sum() / (count - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def group_ids(index, n: int) -> tuple[torch.Tensor, int]:
    """Map per-row uids (any hashables) to dense group ids 0..G-1 in first-seen order."""
    if index is None:
        raise ValueError("this advantage estimator groups rows by prompt: pass `index` (one uid per row).")
    if isinstance(index, torch.Tensor) or hasattr(index, "tolist"):
        index = index.tolist()
    index = list(index)
    if len(index) != n:
        raise ValueError(f"index has {len(index)} entries but the batch has {n} rows.")
    ids: dict = {}
    dense = [ids.setdefault(uid, len(ids)) for uid in index]
    return torch.tensor(dense, dtype=torch.long), len(ids)


def _group_stats(scores: torch.Tensor, index):
    """Per-group (count, mean, unbiased std) of the groups of ``index`` gathered back to rows; singleton groups:
    mean 0, std 1."""
    gid, num_groups = group_ids(index, scores.shape[0])
    gid = gid.to(scores.device)
    counts = torch.bincount(gid, minlength=num_groups).to(scores.dtype)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, gid, (scores - mean[gid]).square())
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return counts[gid], mean[gid], std[gid]


def _mask(response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (response_mask != 0).to(dtype)


def _outcome(a: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = a.unsqueeze(-1) * _mask(response_mask, a.dtype)
    return adv, adv


@register_advantage_estimator("gae", needs=("critic",))
def gae_advantage(token_level_rewards, response_mask, *, values=None, gamma=1.0, lam=1.0, **_):
    """GAE, backwards over t; observation tokens (m = 0) carry next value and lastgaelam through.

    delta_t = r_t + gamma V_next - V_t;  A_t = delta_t + gamma lam A_next  (on m_t = 1)
    returns = A + V; advantages = masked_whiten(A) over the batch; both 0 where m = 0.
    """
    if values is None:
        raise ValueError("gae needs `values` (the critic's values, [n, W]).")
    m = _mask(response_mask, values.dtype)
    n, width = values.shape
    next_value = torch.zeros(n, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(width)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last_gae = gae_t * m[:, t] + (1 - m[:, t]) * last_gae
        adv[:, t] = last_gae
    returns = (adv + values) * m
    return masked_whiten(adv, m) * m, returns


@register_advantage_estimator("grpo", needs=("groups",))
def grpo_advantage(token_level_rewards, response_mask, *, index=None, norm_adv_by_std_in_grpo=True, **_):
    """a_i = (s_i - mean_g) / (std_g + 1e-6) (unbiased std); Dr.GRPO (norm off): s_i - mean_g."""
    scores = token_level_rewards.sum(dim=-1)
    _, mean, std = _group_stats(scores, index)
    a = scores - mean
    if norm_adv_by_std_in_grpo:
        a = a / (std + GRPO_EPS)
    return _outcome(a, response_mask)


@register_advantage_estimator("grpo_passk", needs=("groups",))
def grpo_passk_advantage(token_level_rewards, response_mask, *, index=None, norm_adv_by_std_in_grpo=True, **_):
    """Only the group's best row gets r_max - r_2nd [/ (std_g + 1e-6)]; others 0. Groups need >= 2 rows."""
    scores = token_level_rewards.sum(dim=-1)
    gid, num_groups = group_ids(index, scores.shape[0])
    a = torch.zeros_like(scores)
    for g in range(num_groups):
        rows = torch.nonzero(gid == g, as_tuple=True)[0].to(scores.device)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group (rollout.n >= 2); a group has {len(rows)}.")
        group = scores[rows]
        top = torch.topk(group, 2)
        value = top.values[0] - top.values[1]
        if norm_adv_by_std_in_grpo:
            value = value / (group.std() + GRPO_EPS)
        a[rows[top.indices[0]]] = value
    return _outcome(a, response_mask)


@register_advantage_estimator("rloo", needs=("groups",))
def rloo_advantage(token_level_rewards, response_mask, *, index=None, **_):
    """a_i = k/(k-1) (s_i - mean_g) for a group of k > 1; singleton: s_i."""
    scores = token_level_rewards.sum(dim=-1)
    counts, mean, _ = _group_stats(scores, index)
    a = torch.where(counts > 1, counts / (counts - 1).clamp(min=1) * (scores - mean), scores)
    return _outcome(a, response_mask)


@register_advantage_estimator("opo", needs=("groups",))
def opo_advantage(token_level_rewards, response_mask, *, index=None, **_):
    """a_i = s_i - sum_g n_j s_j / sum_g n_j (length-weighted baseline); singleton (or all
    rows of the group empty): baseline 0."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = _mask(response_mask, scores.dtype).sum(dim=-1)
    gid, num_groups = group_ids(index, scores.shape[0])
    gid = gid.to(scores.device)
    counts = torch.bincount(gid, minlength=num_groups)
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, lengths * scores)
    total_len = torch.zeros_like(weighted).index_add_(0, gid, lengths)
    baseline = torch.where((counts > 1) & (total_len > 0), weighted / total_len.clamp(min=1), torch.zeros_like(weighted))
    return _outcome(scores - baseline[gid], response_mask)


@register_advantage_estimator("gpg", needs=("groups",))
def gpg_advantage(token_level_rewards, response_mask, *, index=None, **_):
    """a_i = alpha (s_i - mean_g), alpha = n / max(#{s_i != 0}, 1) over the batch (f_norm = 1)."""
    scores = token_level_rewards.sum(dim=-1)
    _, mean, _ = _group_stats(scores, index)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores).item()), 1)
    return _outcome(alpha * (scores - mean), response_mask)


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(token_level_rewards, response_mask, *, gamma=1.0, **_):
    """G_t = r_t + gamma G_{t+1} on m_t = 1; on m_t = 0, G is carried unchanged and returns_t = 0.
    advantages = masked_whiten(G) * m over the batch."""
    m = _mask(response_mask, token_level_rewards.dtype)
    n, width = token_level_rewards.shape
    running = torch.zeros(n, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(width)):
        running = m[:, t] * (token_level_rewards[:, t] + gamma * running) + (1 - m[:, t]) * running
        returns[:, t] = running * m[:, t]
    return masked_whiten(returns, m) * m, returns


@register_advantage_estimator("reinforce_plus_plus_baseline", needs=("groups",))
def reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, *, index=None, **_):
    """a_i = s_i - mean_g (singleton mean 0), tiled over tokens, then masked_whiten * m over the batch."""
    scores = token_level_rewards.sum(dim=-1)
    _, mean, _ = _group_stats(scores, index)
    m = _mask(response_mask, scores.dtype)
    adv = (scores - mean).unsqueeze(-1) * m
    adv = masked_whiten(adv, m) * m
    return adv, adv


@register_advantage_estimator("remax", needs=("baseline_rollout",))
def remax_advantage(token_level_rewards, response_mask, *, reward_baselines=None, **_):
    """returns_t = sum_{t' >= t} r_t' m_t' ; advantages = (returns - b_i) m (b_i: the greedy sample's score)."""
    if reward_baselines is None:
        raise ValueError("remax needs `reward_baselines` [n] (the score of a greedy rollout of the same prompt).")
    m = _mask(response_mask, token_level_rewards.dtype)
    returns = (token_level_rewards * m).flip(-1).cumsum(-1).flip(-1)
    adv = (returns - reward_baselines.reshape(-1, 1).to(returns.dtype)) * m
    return adv, returns * m
