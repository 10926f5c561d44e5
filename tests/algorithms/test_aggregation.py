"""NormalizationPlan against the weight table of Contract 1 (plain-loop reference)."""

import math

import pytest
import torch

from algo_reference import MODES, make_batch, ref_aggregate, ref_weights
from verl_lite.algorithms import AGG_MODES, NormalizationPlan


def test_modes_are_the_contract_table():
    assert tuple(AGG_MODES) == MODES


def test_plan_counts_whole_minibatch():
    b = make_batch(0)
    plan = NormalizationPlan.from_mask(b.mask, "seq-mean-token-mean")
    assert plan.num_tokens == int(sum(sum(1 for x in row if x) for row in b.mask.tolist()))
    assert plan.num_seqs == b.mask.shape[0]  # the fully masked row counts in B
    assert plan.horizon == b.mask.shape[1]
    assert NormalizationPlan.from_mask(b.mask, "token-mean", horizon=77).horizon == 77.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_and_aggregate_match_reference(mode, seed):
    b = make_batch(seed)
    plan = NormalizationPlan.from_mask(b.mask, mode, horizon=13.0 if seed == 2 else None)
    kw = {"horizon": 13.0} if seed == 2 else {}
    w = plan.token_weights(b.mask)
    ref = ref_weights(b.mask, mode, **kw)
    assert torch.allclose(w, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-15)
    got = plan.aggregate(b.entropy, b.mask).item()
    assert math.isclose(got, ref_aggregate(b.entropy, b.mask, mode, **kw), rel_tol=1e-13, abs_tol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_shard_weights_use_global_constants(mode):
    """A shard of rows gets the mini-batch's N, B, H, and its own rows' n_i."""
    b = make_batch(3)
    plan = NormalizationPlan.from_mask(b.mask, mode)
    shard = b.mask[2:5]
    ref = ref_weights(shard, mode, horizon=b.mask.shape[1], num_tokens=plan.num_tokens, num_seqs=plan.num_seqs)
    assert torch.allclose(plan.token_weights(shard), torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-15)


def test_padding_values_never_leak():
    b = make_batch(4)
    per_token = b.entropy.clone()
    per_token[b.mask == 0] = float("nan")
    for mode in MODES:
        plan = NormalizationPlan.from_mask(b.mask, mode)
        assert torch.isfinite(plan.aggregate(per_token, b.mask))


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        NormalizationPlan.from_mask(torch.ones(2, 3), "seq-mean")


def test_token_mean_with_no_tokens_is_an_error():
    with pytest.raises(ValueError, match="N = 0"):
        NormalizationPlan.from_mask(torch.zeros(3, 4), "token-mean")
    # other modes are well defined (all weights 0) and metrics do not divide by zero
    plan = NormalizationPlan.from_mask(torch.zeros(3, 4), "seq-mean-token-mean")
    assert plan.aggregate(torch.ones(3, 4), torch.zeros(3, 4)).item() == 0.0
    assert plan.token_mean(torch.ones(3, 4), torch.zeros(3, 4)).item() == 0.0


def test_empty_shard_contributes_zero():
    b = make_batch(5)
    for mode in MODES:
        plan = NormalizationPlan.from_mask(b.mask, mode)
        assert plan.aggregate(b.entropy[:0], b.mask[:0]).item() == 0.0


def test_shape_mismatch_is_an_error():
    plan = NormalizationPlan.from_mask(torch.ones(2, 3), "token-sum")
    with pytest.raises(ValueError, match="shape"):
        plan.aggregate(torch.ones(2, 4), torch.ones(2, 3))
