"""actor_loss / critic_loss: the whole per-micro-batch objective against loop references."""

import math

import pytest
import torch

from algo_reference import LOSSES, MODES, make_batch, ref_aggregate, ref_kl, ref_policy_loss, ref_weights
from verl_lite.algorithms import (
    COV_SELECTION_LOSSES,
    NormalizationPlan,
    actor_loss,
    critic_loss,
    select_cov_tokens,
)
from algo_reference import loss_config


def _cfg(name, mode, **kw):
    return loss_config(
        policy_loss=name, loss_agg_mode=mode, clip_ratio_low=0.18, clip_ratio_high=0.3,
        clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=2.0, kl_cov_ratio=0.1,
        use_kl_loss=True, kl_loss_coef=0.07, kl_loss_type="low_var_kl", entropy_coeff=0.013, **kw,
    )


def _data(b, cfg):
    data = {"response_mask": b.mask, "old_log_probs": b.old, "advantages": b.adv, "ref_log_probs": b.ref,
            "is_weights": b.is_weights}
    if cfg.policy_loss.loss_mode in COV_SELECTION_LOSSES:
        data["cov_mask"] = select_cov_tokens(cfg.policy_loss.loss_mode, b.adv, b.old, b.mask, cfg, seed=5)
    return data


def _loop_sum(per_token, mask, scale):
    return sum(x * scale for row_x, row_m in zip(per_token, mask.tolist()) for x, v in zip(row_x, row_m) if v)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_actor_loss_matches_reference(name, mode):
    b = make_batch(11)
    cfg = _cfg(name, mode)
    data = _data(b, cfg)
    plan = NormalizationPlan.from_mask(b.mask, mode)
    total, metrics = actor_loss({"log_probs": b.logp, "entropy": b.entropy}, data, plan, cfg)

    pg, _, pg_metrics = ref_policy_loss(name, b, cfg, use_is=True, cov=data.get("cov_mask"))
    w = ref_weights(b.mask, mode)
    ref_pg = sum(w[i][t] * pg[i][t] for i in range(len(w)) for t in range(len(w[0])))
    kl = torch.tensor([[ref_kl(a, r, "low_var_kl") for a, r in zip(ra, rr)]
                       for ra, rr in zip(b.logp.tolist(), b.ref.tolist())], dtype=torch.float64)
    ref_kl_term = ref_aggregate(kl, b.mask, mode)
    ref_ent = ref_aggregate(b.entropy, b.mask, mode)
    ref_total = ref_pg + 0.07 * ref_kl_term - 0.013 * ref_ent
    assert math.isclose(total.item(), ref_total, rel_tol=1e-12, abs_tol=1e-13)
    assert math.isclose(metrics["pg_loss"].item(), ref_pg, rel_tol=1e-12, abs_tol=1e-13)
    assert math.isclose(metrics["kl_loss"].item(), ref_kl_term, rel_tol=1e-12, abs_tol=1e-13)
    assert math.isclose(metrics["entropy"].item(), ref_ent, rel_tol=1e-12, abs_tol=1e-13)
    assert math.isclose(metrics["loss"].item(), ref_total, rel_tol=1e-12, abs_tol=1e-13)
    N = int(b.mask.sum().item())
    for key, per_token in pg_metrics.items():  # token means, whatever the loss mode
        assert math.isclose(metrics[key].item(), _loop_sum(per_token, b.mask, 1.0 / N), rel_tol=1e-12, abs_tol=1e-13), key


def test_terms_are_off_when_disabled():
    b = make_batch(2)
    cfg = loss_config(policy_loss="gpg", loss_agg_mode="token-sum")
    plan = NormalizationPlan.from_mask(b.mask, "token-sum")
    total, metrics = actor_loss({"log_probs": b.logp}, {"response_mask": b.mask, "old_log_probs": b.old,
                                                          "advantages": b.adv}, plan, cfg)
    assert "kl_loss" not in metrics and "entropy" not in metrics
    assert math.isclose(total.item(), _loop_sum((-b.logp * b.adv).tolist(), b.mask, 1.0), rel_tol=1e-12)


def test_actor_loss_clear_errors():
    b = make_batch(0)
    plan = NormalizationPlan.from_mask(b.mask, "token-mean")
    data = {"response_mask": b.mask, "old_log_probs": b.old, "advantages": b.adv}
    with pytest.raises(ValueError, match="ref_log_probs"):
        actor_loss({"log_probs": b.logp}, data, plan, loss_config(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy"):
        actor_loss({"log_probs": b.logp}, data, plan, loss_config(entropy_coeff=0.01))
    with pytest.raises(ValueError, match="select_cov_tokens"):
        actor_loss({"log_probs": b.logp}, data, plan, loss_config(policy_loss="kl_cov"))
    assert loss_config(policy_loss="nope").problems("a")[0].startswith("a.policy_loss.loss_mode='nope' is unknown")
    assert loss_config(loss_agg_mode="mean").problems("a")[0].startswith("a.loss_agg_mode='mean' is unknown")


@pytest.mark.parametrize("mode", MODES)
def test_critic_loss_matches_reference(mode):
    b = make_batch(6)
    g = torch.Generator().manual_seed(1)
    old_values = b.values + 0.4 * torch.randn(b.values.shape, generator=g, dtype=torch.float64)
    returns = torch.randn(b.values.shape, generator=g, dtype=torch.float64)
    values = b.values.clone().requires_grad_(True)
    plan = NormalizationPlan.from_mask(b.mask, mode)
    c = 0.2
    total, metrics = critic_loss({"values": values}, {"response_mask": b.mask, "old_values": old_values,
                                                       "returns": returns}, plan, cliprange_value=c)
    total.backward()
    w = ref_weights(b.mask, mode)
    v, vo, R = b.values.tolist(), old_values.tolist(), returns.tolist()
    ref, clipped, grad = 0.0, 0.0, [[0.0] * len(w[0]) for _ in w]
    N = int(b.mask.sum().item())
    for i in range(len(w)):
        for t in range(len(w[0])):
            if not b.mask[i, t]:
                continue
            vc = min(max(v[i][t], vo[i][t] - c), vo[i][t] + c)
            l1, l2 = (v[i][t] - R[i][t]) ** 2, (vc - R[i][t]) ** 2
            ref += w[i][t] * 0.5 * max(l1, l2)
            clipped += (l2 > l1) / N
            grad[i][t] = 0.0 if l2 > l1 else w[i][t] * (v[i][t] - R[i][t])
    assert math.isclose(total.item(), ref, rel_tol=1e-12)
    assert math.isclose(metrics["vf_loss"].item(), ref, rel_tol=1e-12)
    assert math.isclose(metrics["vf_clipfrac"].item(), clipped, rel_tol=1e-12, abs_tol=1e-15)
    assert 0 < clipped < 1
    torch.testing.assert_close(values.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
