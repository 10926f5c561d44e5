"""KL estimators, straight-through variants, controllers and the in-reward penalty."""

import math

import pytest
import torch

from algo_reference import make_batch, ref_kl
from verl_lite.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller, kl_penalty

KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@pytest.mark.parametrize("kind", KINDS)
def test_values_match_reference(kind):
    b = make_batch(0)
    logp = torch.cat([b.logp, torch.tensor([[30.0, -30.0] + [0.0] * (b.logp.shape[1] - 2)], dtype=torch.float64)])
    ref_lp = torch.cat([b.ref, torch.zeros(1, b.ref.shape[1], dtype=torch.float64)])  # +-30: k3 clamps
    got = kl_penalty(logp, ref_lp, kind)
    ref = [[ref_kl(a, r, kind) for a, r in zip(ra, rr)] for ra, rr in zip(logp.tolist(), ref_lp.tolist())]
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("kind", KINDS)
def test_straight_through_value_of_x_gradient_of_k2(kind):
    b = make_batch(1)
    logp = b.logp.clone().requires_grad_(True)
    value = kl_penalty(logp, b.ref, kind + "+")
    torch.testing.assert_close(value.detach(), kl_penalty(b.logp, b.ref, kind), rtol=0, atol=1e-15)
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (b.logp - b.ref), rtol=1e-14, atol=1e-15)  # d k2 / d logp


def test_unknown_and_full_types():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(x, x, "k4")
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(x, x, "full")


def test_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(0.1, target_kl=0.2, horizon=1000)
    ctl.update(0.3, n_steps=50)  # error = clip(0.5, +-0.2) = 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 50 / 1000), rel=1e-15)
    ctl.update(0.19, n_steps=50)  # error = -0.05
    assert ctl.value == pytest.approx(0.1 * 1.01 * (1 - 0.05 * 0.05), rel=1e-14)
    assert isinstance(get_kl_controller("adaptive", 0.1, 0.2, 10), AdaptiveKLController)
    with pytest.raises(ValueError, match="adaptive"):
        get_kl_controller("pid", 0.1, 0.1, 10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_apply_kl_penalty_matches_reference(kind):
    b = make_batch(2)
    scores = b.rewards.clone()
    ctl = AdaptiveKLController(0.3, target_kl=0.05, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, b.old, b.ref, b.mask, ctl, kind)
    m, s, o, r = b.mask.tolist(), scores.tolist(), b.old.tolist(), b.ref.tolist()
    ref_rewards, row_means = [], []
    for i in range(len(m)):
        row, kls = [], []
        for t in range(len(m[0])):
            k = ref_kl(o[i][t], r[i][t], kind) if m[i][t] else 0.0
            row.append(s[i][t] - 0.3 * k)
            if m[i][t]:
                kls.append(k)
        ref_rewards.append(row)
        row_means.append(sum(kls) / (len(kls) + 1e-8))  # verl: masked_mean(kld, mask, axis=-1), 0 for an empty row
    assert b.mask[1].sum() == 0  # the batch has an all-masked row
    current = sum(row_means) / len(row_means)  # verl: torch.mean over ALL rows
    torch.testing.assert_close(rewards, torch.tensor(ref_rewards, dtype=torch.float64), rtol=1e-13, atol=1e-14)
    assert metrics["kl"] == pytest.approx(current, rel=1e-7)
    assert metrics["kl_coef"] == 0.3
    err = max(min(current / 0.05 - 1, 0.2), -0.2)
    assert ctl.value == pytest.approx(0.3 * (1 + err * len(m) / 100), rel=1e-9)
    assert not math.isnan(ctl.value)


def test_adaptive_beta_counts_an_all_masked_row_as_verl_does():
    """verl's apply_kl_penalty: current_kl = torch.mean(masked_mean(kld, mask, axis=-1)) over ALL rows (an
    all-masked row gives 0), so the adaptive beta moves as verl's does (error inside the +-0.2 clip)."""
    b = make_batch(5)
    assert b.mask[1].sum() == 0 and b.mask[0].sum() > 0
    kld = (b.old - b.ref) * b.mask  # kind "kl"
    verl_kl = float(((kld.sum(-1) / (b.mask.sum(-1) + 1e-8))).mean())
    target = abs(verl_kl) * 1.1 + 1e-3
    ctl = AdaptiveKLController(0.2, target_kl=target, horizon=50)
    _, metrics = apply_kl_penalty(b.rewards.clone(), b.old, b.ref, b.mask, ctl, "kl")
    assert metrics["kl"] == pytest.approx(verl_kl, rel=1e-7)
    err = verl_kl / target - 1
    assert -0.2 < err < 0.2
    assert ctl.value == pytest.approx(0.2 * (1 + err * b.mask.shape[0] / 50), rel=1e-9)


def test_kl_types_lists_every_accepted_kind():
    from verl_lite.algorithms.kl import KL_TYPES

    x = torch.zeros(1, 1, dtype=torch.float64)
    assert set(KINDS) | {k + "+" for k in KINDS} == set(KL_TYPES)
    for kind in KL_TYPES:
        kl_penalty(x, x, kind)
