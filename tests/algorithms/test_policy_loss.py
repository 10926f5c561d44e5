"""Policy losses against plain-loop references: per-token values, per-token metrics, and the
gradient of the plan-aggregated loss w.r.t. log-probs for every aggregation mode."""

import math

import pytest
import torch

from algo_reference import LOSSES, MODES, make_batch, ref_clip_cov_candidates, ref_policy_grad, ref_policy_loss
from algo_reference import ref_clipped_by_range, ref_select_kl_cov, ref_select_kl_cov_current, ref_verl_clip_cov
from verl_lite.algorithms import (
    COV_SELECTION_LOSSES,
    POLICY_LOSSES,
    NormalizationPlan,
    get_policy_loss,
    register_policy_loss,
    select_cov_tokens,
)
from algo_reference import loss_config

CFG = loss_config(
    clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5,
    clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=2.0, kl_cov_ratio=0.15, ppo_kl_coef=0.7,
)


def _cov(name, b):
    if name not in COV_SELECTION_LOSSES:
        return None
    return select_cov_tokens(name, b.adv, b.old, b.mask, CFG, seed=3, log_probs=b.logp)


def _valid_only(x, mask):
    return torch.where(mask > 0, x, torch.zeros_like(x))


def test_registry_has_all_losses():
    assert set(LOSSES) <= set(POLICY_LOSSES)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("use_is", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_per_token_loss_and_metrics_match_reference(name, use_is, seed):
    b = make_batch(seed, row_constant_adv=(seed == 1))
    cov = _cov(name, b)
    loss, metrics = get_policy_loss(name)(b.old, b.logp, b.adv, b.mask, CFG, b.is_weights if use_is else None, cov)
    ref_loss, _, ref_metrics = ref_policy_loss(name, b, CFG, use_is, cov)
    torch.testing.assert_close(_valid_only(loss, b.mask), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-12, atol=1e-13)
    assert set(ref_metrics) == set(metrics), (set(ref_metrics), set(metrics))
    for key, ref in ref_metrics.items():
        torch.testing.assert_close(_valid_only(metrics[key], b.mask), torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_aggregated_gradient_matches_reference(name, mode):
    b = make_batch(7)
    cov = _cov(name, b)
    plan = NormalizationPlan.from_mask(b.mask, mode)
    logp = b.logp.clone().requires_grad_(True)
    loss, _ = get_policy_loss(name)(b.old, logp, b.adv, b.mask, CFG, b.is_weights, cov)
    plan.aggregate(loss, b.mask).backward()
    ref = torch.tensor(ref_policy_grad(name, b, CFG, mode, use_is=True, cov=cov), dtype=torch.float64)
    torch.testing.assert_close(logp.grad, ref, rtol=1e-12, atol=1e-14)


def test_losses_actually_clip():
    """The test data exercises the clipped branches (else the references would prove little)."""
    for seed in (1, 3, 7):
        b = make_batch(seed)
        _, m = get_policy_loss("vanilla")(b.old, b.logp, b.adv, b.mask, CFG)
        valid = b.mask > 0
        assert 0 < m["pg_clipfrac"][valid].sum() < valid.sum()
        assert m["pg_clipfrac_lower"][valid].sum() > 0


def test_kl_cov_selection_matches_reference():
    for seed in range(3):
        b = make_batch(seed)
        sel = select_cov_tokens("kl_cov", b.adv, b.old, b.mask, CFG)
        got = {tuple(x) for x in torch.nonzero(sel).tolist()}
        assert got == ref_select_kl_cov(b, CFG.policy_loss.kl_cov_ratio)


def test_clip_cov_selection_is_a_seeded_subset_of_candidates():
    for seed in range(3):
        b = make_batch(seed)
        cand, num_valid = ref_clip_cov_candidates(b, CFG.policy_loss.clip_cov_lb, CFG.policy_loss.clip_cov_ub)
        sel = select_cov_tokens("clip_cov", b.adv, b.old, b.mask, CFG, seed=11)
        got = {tuple(x) for x in torch.nonzero(sel).tolist()}
        assert len(cand) > 1
        assert got <= cand
        assert len(got) == min(max(1, int(CFG.policy_loss.clip_cov_ratio * num_valid)), len(cand))
        again = select_cov_tokens("clip_cov", b.adv, b.old, b.mask, CFG, seed=11)
        assert torch.equal(sel, again)


def test_kl_cov_selection_uses_the_current_log_probs():
    """verl's kl_cov ranks by cov of the CURRENT log-probs (off-policy they differ from the old)."""
    differs = 0
    for seed in range(4):
        b = make_batch(seed, n=16, width=12)
        sel = select_cov_tokens("kl_cov", b.adv, b.old, b.mask, CFG, log_probs=b.logp)
        got = {tuple(x) for x in torch.nonzero(sel).tolist()}
        assert got == ref_select_kl_cov_current(b, CFG.policy_loss.kl_cov_ratio)
        differs += got != ref_select_kl_cov(b, CFG.policy_loss.kl_cov_ratio)
    assert differs  # the data is off-policy enough for the old-log-prob ranking to pick other tokens


def _verl_clip_cov_check(b, cfg, seed):
    """Our selection + clip_cov loss vs verl's formula (ref_verl_clip_cov): the picked tokens, the
    per-token loss and the token-mean gradient w.r.t. the current log-probs."""
    picked, ref_loss, ref_grad = ref_verl_clip_cov(b, cfg, seed)
    sel = select_cov_tokens("clip_cov", b.adv, b.old, b.mask, cfg, seed=seed, log_probs=b.logp)
    assert {tuple(x) for x in torch.nonzero(sel).tolist()} == picked
    logp = b.logp.clone().requires_grad_(True)
    loss, _ = get_policy_loss("clip_cov")(b.old, logp, b.adv, b.mask, cfg, None, sel)
    NormalizationPlan.from_mask(b.mask, "token-mean").aggregate(loss, b.mask).backward()
    torch.testing.assert_close(_valid_only(loss.detach(), b.mask), torch.tensor(ref_loss, dtype=torch.float64),
                               rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(logp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    return picked


def test_clip_cov_matches_verl_off_policy_with_ratios_far_from_one():
    """clip_cov_ratio 0.2 (many picks), ratios up to e^1.3 and beyond: the selection skips tokens
    the PPO range already clips and uses the current log-probs, as verl does."""
    cfg = loss_config(clip_ratio=0.2, clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=2.0)
    wasted = 0
    for seed in range(6):
        b = make_batch(seed, n=16, width=12)
        clipped = ref_clipped_by_range(b, cfg)
        picked = _verl_clip_cov_check(b, cfg, seed)
        assert not picked & clipped
        old_rule, _ = ref_clip_cov_candidates(b, cfg.policy_loss.clip_cov_lb, cfg.policy_loss.clip_cov_ub)  # old log-probs, no skip
        wasted += len(old_rule & clipped)
    assert wasted  # the old rule would have spent picks on clipped tokens on this data


def test_clip_cov_matches_verl_at_the_default_ratio():
    """verl's defaults (clip_cov_ratio 2e-4 -> one pick, window (1, 5)) on a larger off-policy batch."""
    cfg = loss_config()
    assert (cfg.policy_loss.clip_cov_ratio, cfg.policy_loss.clip_cov_lb, cfg.policy_loss.clip_cov_ub) == (0.0002, 1.0, 5.0)
    picks = 0
    for seed in range(6):
        b = make_batch(100 + seed, n=64, width=16)
        b.adv.mul_(3.0)  # covariances reach the (1, 5) window
        picks += len(_verl_clip_cov_check(b, cfg, seed))
    assert picks == 6  # one pick per mini-batch, every time


def test_cov_losses_need_the_selection():
    b = make_batch(0)
    for name in COV_SELECTION_LOSSES:
        with pytest.raises(ValueError, match="select_cov_tokens"):
            get_policy_loss(name)(b.old, b.logp, b.adv, b.mask, CFG)


def test_unknown_loss_lists_registered():
    with pytest.raises(ValueError, match="vanilla"):
        get_policy_loss("ppo2")


def test_register_custom_loss_and_refuse_silent_override():
    @register_policy_loss("test_only_reinforce")
    def reinforce(old, logp, adv, mask, cfg, is_weights=None, cov_mask=None):
        return -adv * logp, {}

    assert get_policy_loss("test_only_reinforce") is reinforce
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("test_only_reinforce")(lambda *a, **k: None)
    del POLICY_LOSSES["test_only_reinforce"]


def test_dual_clip_bound_must_exceed_one():
    """The rule lives in the actor's config (pre-flight), not in the loss."""
    assert loss_config(clip_ratio_c=1.0).problems("actor") == [
        "actor.clip_ratio_c=1.0 must be > 1 (dual-clip lower bound)"]
    assert loss_config(clip_ratio_c=1.5).problems("actor") == []


def test_truncated_is_weights_match_a_loop():
    from verl_lite.algorithms import truncated_is_weights

    g = torch.Generator().manual_seed(0)
    old, rollout = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float64)
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    for i in range(3):
        for t in range(5):
            want = min(math.exp(old[i, t] - rollout[i, t]), 2.0) if mask[i, t] else 0.0
            assert abs(w[i, t].item() - want) < 1e-12
