"""Micro-batch planning: which trajectories go to which DP rank and micro-batch. The controller plans once per
mini-batch and sends every DP rank its share, so all ranks agree on the micro-batches by construction::

    plan = plan_micro_batches(lengths, dp_size, micro_batch_size=2)
    plan[dp_rank] -> [[i, j], [k, l], ...]      # micro-batches of trajectory indices

1. DP partition: ``dp_size`` groups of EQUAL size, balanced by token count: greedy, heaviest unit first, into the
   lightest group that still has room for all of it.
2. Micro-batches per rank: ``micro_batch_size`` trajectories each, or a token budget ``max_tokens_per_micro_batch``
   (first-fit-decreasing, then balanced). The count is then made the same on every rank (the maximum, rounded up
   to ``vpp_multiple``) by splitting the largest micro-batches.

A *unit* is one trajectory, or with ``prompts`` (for an engine that packs a shared prompt once, engine/packing.py)
the trajectories of one prompt, placed together where they fit (else member by member); over DP the partition by
prompt is kept only where its heaviest rank packs no more tokens than the partition by trajectory's. A rank's
trajectories stay in ascending order. Planning never changes the math (``NormalizationPlan``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from verl_lite.engine.packing import prompt_groups


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = [int(x) for x in lengths]
    if not out:
        raise ValueError("plan_micro_batches: got no trajectories (lengths is empty)")
    if any(x <= 0 for x in out):
        raise ValueError(f"plan_micro_batches: every length must be positive, got {out}")
    return out


def prompt_units(indices: Sequence[int], lengths: Sequence[int],
                 groups: Sequence[tuple[int, int]] | None) -> list[tuple[list[int], int]]:
    """``(members, tokens)`` units, heaviest first: the trajectories among ``indices`` of one prompt group
    (``prompt_groups``; each alone without groups), weighing the sum of their lengths."""
    by_group: dict[int, list[int]] = {}
    for i in indices:
        by_group.setdefault(groups[i][0] if groups is not None else i, []).append(i)
    units = [(members, sum(lengths[i] for i in members)) for members in by_group.values()]
    return sorted(units, key=lambda u: (-u[1], u[0][0]))


def packed_tokens(indices: Sequence[int], lengths: Sequence[int], groups: Sequence[tuple[int, int]] | None) -> int:
    """The tokens an engine that packs a shared prompt once packs for the trajectories ``indices``: their
    lengths, less (m - 1) x the prompt's shared tokens for each prompt group with m >= 2 of them there."""
    return sum(tokens - (len(members) - 1) * groups[members[0]][1] if len(members) > 1 else tokens
               for members, tokens in prompt_units(indices, lengths, groups))


def partition_over_dp(lengths: Sequence[int], dp_size: int,
                      prompts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Trajectory indices in ``dp_size`` equal-size groups with balanced token sums (module docstring, step 1)."""
    return _partition_over_dp(_check_lengths(lengths), dp_size, prompt_groups(prompts))


def _partition_over_dp(lengths: list[int], dp_size: int, groups: list[tuple[int, int]] | None) -> list[list[int]]:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    n = len(lengths)
    if n % dp_size:
        raise ValueError(f"{n} trajectories do not divide over dp_size={dp_size}; make the mini-batch's "
                         f"trajectory count a multiple of the data-parallel size")
    by_trajectory = _partition(prompt_units(range(n), lengths, None), lengths, dp_size)
    if groups is None or dp_size == 1:
        return by_trajectory
    by_prompt = _partition(prompt_units(range(n), lengths, groups), lengths, dp_size)
    heaviest = {name: max(packed_tokens(g, lengths, groups) for g in parts)
                for name, parts in (("prompt", by_prompt), ("trajectory", by_trajectory))}
    return by_prompt if heaviest["prompt"] <= heaviest["trajectory"] else by_trajectory


def _partition(units: list[tuple[list[int], int]], lengths: list[int], dp_size: int) -> list[list[int]]:
    """The greedy placement of ``units`` (heaviest first); one no group has room for goes longest member first."""
    per_rank = len(lengths) // dp_size
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size

    def place(members: list[int], tokens: int) -> bool:
        open_ranks = [r for r in range(dp_size) if len(groups[r]) + len(members) <= per_rank]
        if not open_ranks:
            return False
        r = min(open_ranks, key=lambda q: (loads[q], q))
        groups[r].extend(members)
        loads[r] += tokens
        return True

    for members, tokens in units:
        if not place(members, tokens):
            for i in sorted(members, key=lambda k: (-lengths[k], k)):
                place([i], lengths[i])
    return [sorted(g) for g in groups]


def _split_fixed(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[k : k + micro_batch_size] for k in range(0, len(indices), micro_batch_size)]


def _split_token_budget(indices: list[int], lengths: list[int], budget: int,
                        groups: list[tuple[int, int]] | None = None) -> list[list[int]]:
    """First-fit-decreasing of ``prompt_units`` into bins of at most ``budget`` tokens, then rebalanced; a unit
    weighs all its trajectories' tokens as if nothing were shared, and one over the budget goes member by member."""
    too_long = [i for i in indices if lengths[i] > budget]
    if too_long:
        raise ValueError(f"trajectories {too_long} have lengths {[lengths[i] for i in too_long]} > "
                         f"max_tokens_per_micro_batch={budget}; raise the token budget to at least the longest "
                         f"sequence ({max(lengths[i] for i in too_long)})")
    units = []
    for members, tokens in prompt_units(indices, lengths, groups):
        units.extend([(members, tokens)] if tokens <= budget else [([i], lengths[i]) for i in members])
    units.sort(key=lambda u: (-u[1], u[0][0]))
    loads: list[int] = []
    for _, tokens in units:
        for b, load in enumerate(loads):
            if load + tokens <= budget:
                loads[b] += tokens
                break
        else:
            loads.append(tokens)
    return _rebalance(units, len(loads), budget)


def _rebalance(units: list[tuple[list[int], int]], k: int, budget: int | None) -> list[list[int]]:
    """Greedy LPT of the units (heaviest first) into ``k`` bins, one more bin while it overflows the budget."""
    while True:
        bins: list[list[int]] = [[] for _ in range(k)]
        lightest = [(0, 0, q) for q in range(k)]  # (load, members, bin) of every bin: a heap, lightest first
        for members, tokens in units:
            load, count, b = heapq.heappop(lightest)
            bins[b].extend(members)
            heapq.heappush(lightest, (load + tokens, count + len(members), b))
        if budget is None or max(load for load, _, _ in lightest) <= budget:
            return [sorted(b) for b in bins]
        k += 1  # LPT can be worse than FFD on awkward inputs; one more bin always eventually fits


def _pad_count(mbs: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """Split the heaviest multi-trajectory micro-batches until there are ``target`` of them."""
    mbs = [list(m) for m in mbs]
    while len(mbs) < target:
        splittable = [k for k, m in enumerate(mbs) if len(m) > 1]
        if not splittable:
            mbs.append([])  # fewer trajectories than micro-batches on this rank: unavoidable
            continue
        k = max(splittable, key=lambda q: (sum(lengths[i] for i in mbs[q]), -q))
        m = sorted(mbs[k], key=lambda i: (-lengths[i], i))
        halves, loads = ([], []), [0, 0]
        for i in m:  # balanced two-way split
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(i)
            loads[side] += lengths[i]
        mbs[k : k + 1] = [sorted(halves[0]), sorted(halves[1])]
    return mbs


def plan_micro_batches(lengths: Sequence[int], dp_size: int, micro_batch_size: int | None = None,
                       max_tokens_per_micro_batch: int | None = None, vpp_multiple: int = 1,
                       prompts: Sequence[Sequence[int]] | None = None) -> list[list[list[int]]]:
    """``plan[r]``: DP rank r's micro-batches of indices into ``lengths`` (each trajectory's tokens), the same count
    on every rank, every trajectory once. Exactly one of ``micro_batch_size`` and ``max_tokens_per_micro_batch``;
    ``vpp_multiple``: the pipeline size under virtual PP (megatron needs a multiple of it)."""
    lengths = _check_lengths(lengths)
    if (micro_batch_size is None) == (max_tokens_per_micro_batch is None):
        raise ValueError("plan_micro_batches: give exactly one of micro_batch_size (fixed trajectories per "
                         "micro-batch) or max_tokens_per_micro_batch (token budget)")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    if vpp_multiple < 1:
        raise ValueError(f"vpp_multiple must be >= 1, got {vpp_multiple}")

    if prompts is not None and len(prompts) != len(lengths):
        raise ValueError(f"plan_micro_batches: {len(prompts)} prompts for {len(lengths)} trajectories")
    groups = prompt_groups(prompts)  # the prompts are read here only
    shares = _partition_over_dp(lengths, dp_size, groups)
    if micro_batch_size is not None:
        per_rank = [_split_fixed(s, micro_batch_size) for s in shares]
    else:
        per_rank = [_split_token_budget(s, lengths, max_tokens_per_micro_batch, groups) for s in shares]
    count = -(-max(len(m) for m in per_rank) // vpp_multiple) * vpp_multiple
    return [_pad_count(m, lengths, count) for m in per_rank]
