"""Advantage estimators against plain-loop references (ragged masks with observation holes,
a fully masked row, singleton groups)."""

import numpy as np
import pytest
import torch

from algo_reference import make_batch, ref_advantage, ref_whiten
from verl_lite.algorithms import ADVANTAGE_ESTIMATORS, compute_advantage, masked_whiten

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg")


def _passk_batch(seed):
    b = make_batch(seed)
    b.index = [f"g{i // 2}" for i in range(len(b.index))]  # groups of two, no singleton
    return b


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_registry_has_all_estimators():
    assert set(ESTIMATORS) | {"grpo_passk"} <= set(ADVANTAGE_ESTIMATORS)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimator_matches_reference(name, seed):
    b = make_batch(seed)
    assert any(b.index.count(u) == 1 for u in b.index)  # a singleton group is present
    gamma, lam = (0.9, 0.8) if seed == 1 else (1.0, 1.0)
    baselines = torch.randn(b.mask.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    adv, ret = compute_advantage(
        name, b.rewards, b.mask, index=b.index, values=b.values, reward_baselines=baselines, gamma=gamma, lam=lam
    )
    ref_adv, ref_ret = ref_advantage(name, b, gamma=gamma, lam=lam, baselines=baselines)
    torch.testing.assert_close(adv, _t(ref_adv), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, _t(ref_ret), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_and_passk_std_switch(norm):
    b = make_batch(3)
    adv, _ = compute_advantage("grpo", b.rewards, b.mask, index=b.index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, _t(ref_advantage("grpo", b, norm=norm)[0]), rtol=1e-12, atol=1e-12)
    b = _passk_batch(3)
    adv, _ = compute_advantage("grpo_passk", b.rewards, b.mask, index=b.index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, _t(ref_advantage("grpo_passk", b, norm=norm)[0]), rtol=1e-12, atol=1e-12)
    assert (adv.abs().sum(-1) > 0).sum() <= len(set(b.index))


def test_singleton_group_grpo_is_raw_score():
    """Singleton group: mean 0, std 1 -> a = s / (1 + 1e-6)."""
    rewards = torch.tensor([[0.0, 2.0], [1.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    adv, _ = compute_advantage("grpo", rewards, mask, index=[7, 8, 8])
    assert adv[0, 0].item() == pytest.approx(2.0 / (1 + 1e-6), rel=1e-15)
    assert adv[1, 0].item() == pytest.approx((1 - 2) / (2 ** 0.5 + 1e-6), rel=1e-12)


def test_index_types_are_equivalent():
    b = make_batch(4)
    codes = {u: k for k, u in enumerate(dict.fromkeys(b.index))}
    as_int = [codes[u] for u in b.index]
    results = [
        compute_advantage("grpo", b.rewards, b.mask, index=idx)[0]
        for idx in (b.index, np.array(b.index, dtype=object), torch.tensor(as_int), np.array(as_int))
    ]
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_masked_whiten_matches_reference():
    b = make_batch(5)
    got = masked_whiten(b.values, b.mask)
    ref = _t(ref_whiten(b.values.tolist(), b.mask.tolist()))
    torch.testing.assert_close(got[b.mask > 0], ref[b.mask > 0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(b.values, torch.zeros_like(b.mask))


def test_clear_errors():
    b = make_batch(0)
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", b.rewards, b.mask)
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", b.rewards, b.mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", b.rewards, b.mask)
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_advantage("grpo_passk", b.rewards, b.mask, index=b.index)  # has a singleton group
    with pytest.raises(ValueError, match="Registered"):
        compute_advantage("ppo", b.rewards, b.mask)
    with pytest.raises(ValueError, match="index has"):
        compute_advantage("rloo", b.rewards, b.mask, index=b.index[:-1])
