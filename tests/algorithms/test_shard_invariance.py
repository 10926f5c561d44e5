"""Contract 1, property-based: for every loss x mode, ANY partition of a mini-batch into shards
(uneven, empty ones, rows shuffled across shards, each shard trimmed to its own padded width)
gives contributions and metrics that sum to the full mini-batch values, and the same gradient
w.r.t. log-probs and entropy (float64, <= 1e-12)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from algo_reference import LOSSES, MODES, make_batch
from verl_lite.algorithms import COV_SELECTION_LOSSES, NormalizationPlan, actor_loss, select_cov_tokens
from algo_reference import loss_config

TOL = 1e-12
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def minibatch_and_partition(draw):
    seed = draw(st.integers(0, 10_000))
    n = draw(st.integers(1, 9))
    width = draw(st.integers(1, 8))
    num_shards = draw(st.integers(1, 5))
    owner = draw(st.lists(st.integers(0, num_shards - 1), min_size=n, max_size=n))
    trim = draw(st.booleans())
    return seed, n, width, num_shards, owner, trim


def _cfg(name, mode):
    return loss_config(
        policy_loss=name, loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_cov_ratio=0.2, clip_cov_lb=-1.0, clip_cov_ub=3.0, kl_cov_ratio=0.2,
        use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3+", entropy_coeff=0.01,
    )


def _shards(owner, num_shards):
    return [torch.tensor([i for i, o in enumerate(owner) if o == s], dtype=torch.long) for s in range(num_shards)]


def _rows(tensor, rows, trim_to):
    out = tensor.index_select(0, rows)
    return out[:, :trim_to] if trim_to is not None else out


def _trim_width(mask_rows):
    """Engine micro-batches pad only to their own longest response: drop all-padding columns."""
    valid_cols = torch.nonzero(mask_rows.sum(0) > 0)
    return int(valid_cols.max().item()) + 1 if len(valid_cols) else 0


def _check(name, mode, draw):
    seed, n, width, num_shards, owner, trim = draw
    b = make_batch(seed, n=n, width=width)
    cfg = _cfg(name, mode)
    plan = NormalizationPlan.from_mask(b.mask, mode)  # once, from the whole mini-batch
    data = {"response_mask": b.mask, "old_log_probs": b.old, "advantages": b.adv, "ref_log_probs": b.ref,
            "is_weights": b.is_weights}
    if name in COV_SELECTION_LOSSES:
        data["cov_mask"] = select_cov_tokens(name, b.adv, b.old, b.mask, cfg, seed=seed)

    logp = b.logp.clone().requires_grad_(True)
    ent = b.entropy.clone().requires_grad_(True)
    full, full_metrics = actor_loss({"log_probs": logp, "entropy": ent}, data, plan, cfg)
    full.backward()
    ref_grad_lp, ref_grad_ent = logp.grad.clone(), ent.grad.clone()

    logp.grad, ent.grad = None, None
    total = torch.zeros((), dtype=torch.float64)
    metric_sums = {k: torch.zeros((), dtype=torch.float64) for k in full_metrics}
    for rows in _shards(owner, num_shards):
        trim_to = _trim_width(b.mask.index_select(0, rows)) if trim else None
        shard_data = {k: _rows(v, rows, trim_to) for k, v in data.items()}
        outputs = {"log_probs": _rows(logp, rows, trim_to), "entropy": _rows(ent, rows, trim_to)}
        contribution, metrics = actor_loss(outputs, shard_data, plan, cfg)
        if contribution.requires_grad:
            contribution.backward()
        total = total + contribution.detach()
        for k in metric_sums:
            metric_sums[k] = metric_sums[k] + metrics[k]

    torch.testing.assert_close(total, full.detach(), rtol=0, atol=TOL)
    for k, v in metric_sums.items():
        torch.testing.assert_close(v, full_metrics[k], rtol=0, atol=TOL, msg=k)
    zeros = torch.zeros_like(ref_grad_lp)
    torch.testing.assert_close(logp.grad if logp.grad is not None else zeros, ref_grad_lp, rtol=0, atol=TOL)
    torch.testing.assert_close(ent.grad if ent.grad is not None else zeros, ref_grad_ent, rtol=0, atol=TOL)
    assert ref_grad_lp.abs().sum() > 0  # the KL term alone makes it non-zero: the check is not vacuous


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(draw=minibatch_and_partition())
def test_actor_loss_shard_invariance(name, mode, draw):
    _check(name, mode, draw)


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(draw=minibatch_and_partition())
def test_plan_aggregate_shard_invariance(mode, draw):
    seed, n, width, num_shards, owner, trim = draw
    b = make_batch(seed, n=n, width=width)
    plan = NormalizationPlan.from_mask(b.mask, mode)
    values = b.entropy.clone().requires_grad_(True)
    full = plan.aggregate(values, b.mask)
    (ref_grad,) = torch.autograd.grad(full, values)
    total = torch.zeros((), dtype=torch.float64)
    for rows in _shards(owner, num_shards):
        total = total + plan.aggregate(values.index_select(0, rows), b.mask.index_select(0, rows))
    (grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, full, rtol=0, atol=TOL)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=TOL)
