"""Micro-batch planning: equal counts on every DP rank, every trajectory once, budgets honoured."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_lite.controller.planning import partition_over_dp, plan_micro_batches


def _flat(plan):
    return sorted(i for rank in plan for mb in rank for i in mb)


@settings(max_examples=60, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 6),
    mbs=st.integers(1, 4),
    vpp=st.sampled_from([1, 2]),
    seed=st.integers(0, 10_000),
)
def test_fixed_size_plan_properties(dp, per_rank, mbs, vpp, seed):
    rnd = random.Random(seed)
    lengths = [rnd.randint(1, 40) for _ in range(dp * per_rank)]
    plan = plan_micro_batches(lengths, dp, micro_batch_size=mbs, vpp_multiple=vpp)
    assert len(plan) == dp
    assert _flat(plan) == list(range(len(lengths)))
    counts = {len(r) for r in plan}
    assert len(counts) == 1 and counts.pop() % vpp == 0
    assert all(sum(len(mb) for mb in r) == per_rank for r in plan)
    assert all(len(mb) <= mbs for r in plan for mb in r)


@settings(max_examples=60, deadline=None)
@given(dp=st.sampled_from([1, 2, 3]), per_rank=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_token_budget_plan_properties(dp, per_rank, seed):
    rnd = random.Random(seed)
    lengths = [rnd.randint(1, 30) for _ in range(dp * per_rank)]
    budget = max(lengths) + rnd.randint(0, 40)
    plan = plan_micro_batches(lengths, dp, max_tokens_per_micro_batch=budget)
    assert _flat(plan) == list(range(len(lengths)))
    assert len({len(r) for r in plan}) == 1
    assert all(sum(lengths[i] for i in mb) <= budget for r in plan for mb in r)
    assert all(mb for r in plan for mb in r)  # never empty: every rank has >= count trajectories here


def test_dp_partition_is_balanced_and_equal_size():
    lengths = [100, 90, 10, 5, 50, 45, 3, 2]
    groups = partition_over_dp(lengths, 2)
    assert [len(g) for g in groups] == [4, 4]
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert abs(loads[0] - loads[1]) <= 10


def test_errors_are_clear():
    with pytest.raises(ValueError, match="do not divide"):
        plan_micro_batches([1, 2, 3], 2, micro_batch_size=1)
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([1, 2], 1)
    with pytest.raises(ValueError, match="raise the token budget"):
        plan_micro_batches([5, 50], 1, max_tokens_per_micro_batch=10)


def test_count_padding_splits_instead_of_emptying():
    lengths = [10, 10, 10, 10, 1, 1, 1, 1]
    plan = plan_micro_batches(lengths, 2, max_tokens_per_micro_batch=100)
    # one rank may need 1 micro-batch; counts equal and none empty
    assert len({len(r) for r in plan}) == 1
    assert all(mb for r in plan for mb in r)
