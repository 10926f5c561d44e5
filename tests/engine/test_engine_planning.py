"""Micro-batch planning: equal counts on every DP rank, every trajectory once, budgets honoured."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_lite.controller.planning import packed_tokens, partition_over_dp, plan_micro_batches, prompt_groups


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


def _prompt_major(num_prompts: int, samples: int, rnd: random.Random, prompt_len=(2, 9), response_len=(1, 30)):
    """A prompt-major RL batch: ``samples`` consecutive trajectories per prompt."""
    prompts, lengths = [], []
    for p in range(num_prompts):
        prompt = [p + 1] * rnd.randint(*prompt_len)
        for _ in range(samples):
            prompts.append(prompt)
            lengths.append(len(prompt) + rnd.randint(*response_len))
    return prompts, lengths


@settings(max_examples=60, deadline=None)
@given(dp=st.sampled_from([1, 2, 3, 4]), num_prompts=st.integers(1, 8), samples=st.sampled_from([1, 2, 4, 8]),
       budget_slack=st.integers(0, 200), mbs=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_plans_with_prompts_keep_their_properties(dp, num_prompts, samples, budget_slack, mbs, seed):
    rnd = random.Random(seed)
    prompts, lengths = _prompt_major(num_prompts, samples, rnd)
    if len(lengths) % dp:
        return
    budget = max(lengths) + budget_slack
    for plan in (plan_micro_batches(lengths, dp, micro_batch_size=mbs, prompts=prompts),
                 plan_micro_batches(lengths, dp, max_tokens_per_micro_batch=budget, prompts=prompts)):
        assert _flat(plan) == list(range(len(lengths)))
        assert len({len(r) for r in plan}) == 1
        assert all(sum(len(mb) for mb in r) == len(lengths) // dp for r in plan)
    assert all(sum(lengths[i] for i in mb) <= budget for r in plan for mb in r)  # the budget, sharing or not


def test_a_prompts_samples_stay_on_one_rank_and_in_one_micro_batch_where_they_fit():
    rnd = random.Random(0)
    # 8 prompts x 4 samples over DP 2, long prompts: whole prompts (4 each) pack fewer tokens per rank
    prompts, lengths = _prompt_major(8, 4, rnd, prompt_len=(20, 40), response_len=(1, 10))
    shares = partition_over_dp(lengths, 2, prompts)
    assert [len(s) for s in shares] == [16, 16]
    for p in range(8):
        members = set(range(4 * p, 4 * p + 4))
        assert any(members <= set(s) for s in shares), p
    without = partition_over_dp(lengths, 2)  # trajectory by trajectory: the prompts are split
    assert not all(any(set(range(4 * p, 4 * p + 4)) <= set(s) for s in without) for p in range(8))
    groups = prompt_groups(prompts)
    assert max(packed_tokens(s, lengths, groups) for s in shares) < max(packed_tokens(s, lengths, groups) for s in without)
    budget = max(sum(lengths[4 * p: 4 * p + 4]) for p in range(8))
    plan = plan_micro_batches(lengths, 2, max_tokens_per_micro_batch=budget, prompts=prompts)
    for p in range(8):
        members = set(range(4 * p, 4 * p + 4))
        assert any(members <= set(mb) for r in plan for mb in r), p
    fixed = plan_micro_batches(lengths, 2, micro_batch_size=4, prompts=prompts)
    assert sorted(tuple(mb) for r in fixed for mb in r) == [tuple(range(4 * p, 4 * p + 4)) for p in range(8)]


def test_whole_prompts_are_not_kept_where_they_would_unbalance_the_ranks():
    # two prompts of 2 tokens (1 shared row per extra sample), one with long responses, one with short:
    # a rank per prompt would be far heavier than balancing trajectory by trajectory
    prompts = [[1, 2]] * 4 + [[3, 4]] * 4
    lengths = [60, 62, 64, 66, 4, 5, 6, 7]
    shares = partition_over_dp(lengths, 2, prompts)
    assert shares == partition_over_dp(lengths, 2)
    assert max(packed_tokens(s, lengths, prompt_groups(prompts)) for s in shares) < 252 - 3


def test_packed_tokens_counts_a_shared_prompt_once_per_group():
    prompts = [[1, 2, 3]] * 3 + [[4, 5]] + [[6]] * 2
    lengths = [5, 6, 7, 4, 3, 3]
    groups = prompt_groups(prompts)
    assert packed_tokens(range(6), lengths, groups) == 28 - 2 * 2  # prompt 1-2-3: 2 of 3 rows shared twice
    assert packed_tokens([0, 3], lengths, groups) == 9  # nothing shared
    assert packed_tokens(range(6), lengths, None) == 28


def test_prompt_groups_read_each_prompt_once_into_ids():
    import torch

    prompts = [[1, 2, 3], torch.tensor([1, 2, 3]), [6], [6], [1, 2], [1, 2, 3]]
    groups = prompt_groups(prompts)
    assert [shared for _, shared in groups] == [2, 2, 0, 0, 1, 2]
    ids = [g for g, _ in groups]
    assert ids[0] == ids[1] == ids[5] and len({ids[0], ids[2], ids[3], ids[4]}) == 4  # a 1-token prompt is alone
    assert prompt_groups(None) is None


def test_a_prompt_with_more_samples_than_a_rank_holds_is_split():
    prompts = [[1, 2, 3]] * 6 + [[4, 5]] * 2
    lengths = [10, 11, 12, 13, 14, 15, 5, 6]
    shares = partition_over_dp(lengths, 2, prompts)
    assert sorted(i for s in shares for i in s) == list(range(8)) and [len(s) for s in shares] == [4, 4]
    with pytest.raises(ValueError, match="prompts for"):
        plan_micro_batches(lengths, 2, micro_batch_size=2, prompts=prompts[:3])
