"""Dispatch by DP rank, collection from owners (Contract 4). Every worker reports its :class:`RankLayout` (DP rank,
DP size, whether its outputs are collected: last PP stage, TP rank 0, CP rank 0). The controller cuts the batch
into one piece per DP rank (:func:`shard_by_plan` by a micro-batch plan, :func:`shard_evenly` in equal pieces),
sends it to every rank of that DP rank, keeps one owner's result per DP rank and restores the batch's row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from verl_lite.controller.planning import plan_micro_batches
from verl_lite.protocol import Batch


@dataclass(frozen=True)
class RankLayout:
    rank: int
    dp_rank: int
    dp_size: int
    is_output_owner: bool


def make_layouts(reports: Sequence[dict]) -> list[RankLayout]:
    """Check the workers' self-reports (rank order) and return them as layouts."""
    layouts = [RankLayout(rank, int(r["dp_rank"]), int(r["dp_size"]), bool(r["is_output_owner"]))
               for rank, r in enumerate(reports)]
    dp_sizes = {lay.dp_size for lay in layouts}
    if len(dp_sizes) != 1:
        raise RuntimeError(f"workers disagree on the DP size: {sorted(dp_sizes)}")
    dp_size = dp_sizes.pop()
    for d in range(dp_size):
        owners = [lay.rank for lay in layouts if lay.dp_rank == d and lay.is_output_owner]
        if len(owners) != 1:
            raise RuntimeError(f"DP rank {d} must have exactly one output owner, found ranks {owners}")
    return layouts


def per_rank_args(pieces: Sequence[Any], layouts: Sequence[RankLayout]) -> list[Any]:
    """Piece ``pieces[d]`` for every rank of DP rank d (world-rank order)."""
    if len(pieces) != layouts[0].dp_size:
        raise ValueError(f"got {len(pieces)} pieces for DP size {layouts[0].dp_size}")
    return [pieces[lay.dp_rank] for lay in layouts]


def collect_from_owners(results: Sequence[Any], layouts: Sequence[RankLayout]) -> list[Any]:
    """The owners' results, indexed by DP rank."""
    out: list[Any] = [None] * layouts[0].dp_size
    for lay, res in zip(layouts, results):
        if lay.is_output_owner:
            out[lay.dp_rank] = res
    return out


@dataclass
class Shards:
    """A batch cut per DP rank: ``pieces[d]`` rows are ``batch.select(rows[d])``; ``micro_batches[d]``
    index into ``pieces[d]`` (local indices); the same micro-batch count on every DP rank."""

    pieces: list[Batch]
    rows: list[list[int]]
    micro_batches: list[list[list[int]]]

    def gather(self, outputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-DP-rank row outputs back into the original row order (widths right-padded to the max)."""
        n = sum(len(r) for r in self.rows)
        out: dict[str, torch.Tensor] = {}
        for key in outputs[0]:
            parts = [o[key] for o in outputs]
            width = max(p.shape[1] for p in parts) if parts[0].dim() >= 2 else None
            full = torch.zeros((n, width, *parts[0].shape[2:]) if width is not None else (n, *parts[0].shape[1:]),
                               dtype=parts[0].dtype)
            for rows, part in zip(self.rows, parts):
                if width is not None:
                    full[rows, : part.shape[1]] = part
                else:
                    full[rows] = part
            out[key] = full
        return out


def shard_by_plan(batch: Batch, lengths: Sequence[int], dp_size: int, **plan_options) -> Shards:
    """Plan micro-batches over DP ranks (``plan_micro_batches(..., **plan_options)``); cut the batch to match."""
    plan = plan_micro_batches(lengths, dp_size, **plan_options)
    pieces, rows, local_mbs = [], [], []
    for rank_plan in plan:
        order = [i for mb in rank_plan for i in mb]
        position = {g: k for k, g in enumerate(order)}
        pieces.append(batch.select(order))
        rows.append(order)
        local_mbs.append([[position[g] for g in mb] for mb in rank_plan])
    return Shards(pieces, rows, local_mbs)


def shard_evenly(batch: Batch, dp_size: int) -> Shards:
    """Contiguous equal pieces (one micro-batch each), for work without a micro-batch plan (generation)."""
    n = len(batch)
    if n % dp_size:
        raise ValueError(f"{n} rows do not divide over DP size {dp_size}")
    size = n // dp_size
    rows = [list(range(d * size, (d + 1) * size)) for d in range(dp_size)]
    return Shards([batch.select(r) for r in rows], rows, [[list(range(size))] for _ in rows])
