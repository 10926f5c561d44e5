"""Batch operations and DP sharding round trips (no Ray)."""

import pytest
import torch

from verl_lite.controller.dispatch import collect_from_owners, make_layouts, per_rank_args, shard_by_plan, shard_evenly
from verl_lite.protocol import Batch


def _batch(n=8, w=5):
    g = torch.Generator().manual_seed(0)
    return Batch.from_dict(
        {"x": torch.randn(n, w, generator=g), "k": torch.arange(n)},
        {"uid": [f"u{i // 2}" for i in range(n)], "prompt_ids": [list(range(i + 1)) for i in range(n)]},
    )


def test_select_chunk_concat_union_keep_rows_aligned():
    b = _batch()
    s = b.select([5, 1, 3])
    assert s["k"].tolist() == [5, 1, 3] and s["uid"] == ["u2", "u0", "u1"]
    assert torch.equal(s["x"], b["x"][[5, 1, 3]])
    pieces = b.chunk(4)
    assert [p["k"].tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    back = Batch.concat(pieces)
    assert torch.equal(back["x"], b["x"]) and back["prompt_ids"] == b["prompt_ids"]
    u = b.union(Batch.from_dict({"y": b["k"] * 2}, {"score": list(range(8))}))
    assert u["y"].tolist() == [2 * i for i in range(8)] and u["uid"] == b["uid"]
    with pytest.raises(ValueError, match="3 equal pieces"):
        b.chunk(3)
    with pytest.raises(ValueError, match="rows"):
        Batch.from_dict({"x": torch.zeros(3)}, {"uid": ["a"]})


def test_concat_pads_ragged_widths():
    a = Batch.from_dict({"m": torch.ones(2, 3), "r": torch.ones(2, 3, 4, 2, dtype=torch.uint8)})
    b = Batch.from_dict({"m": torch.ones(1, 5), "r": torch.ones(1, 5, 4, 2, dtype=torch.uint8)})
    c = Batch.concat([a, b])
    assert c["m"].shape == (3, 5) and c["m"].sum().item() == 2 * 3 + 5
    # [n, W, ...] columns (routing: [n, tokens, layers, k]) pad their second dim the same way
    assert c["r"].shape == (3, 5, 4, 2) and c["r"].dtype == torch.uint8 and int(c["r"].sum()) == (2 * 3 + 5) * 8


def test_gather_pads_ragged_widths_of_any_rank():
    b = _batch(4)
    shards = shard_evenly(b, 2)
    outs = [{"r": torch.ones(2, width, 3, dtype=torch.uint8) * (d + 1)} for d, width in enumerate((2, 4))]
    got = shards.gather(outs)["r"]
    assert got.shape == (4, 4, 3) and got[:2, :2].eq(1).all() and got[:2, 2:].eq(0).all() and got[2:].eq(2).all()


@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 1), (2, 3), (4, 2)])
def test_shard_by_plan_covers_each_row_once_and_gathers_back(dp, mbs):
    b = _batch(8)
    lengths = [3, 9, 4, 7, 2, 8, 5, 6]
    shards = shard_by_plan(b, lengths, dp, micro_batch_size=mbs)
    assert sorted(r for rows in shards.rows for r in rows) == list(range(8))
    counts = {len(m) for m in shards.micro_batches}
    assert len(counts) == 1, "every DP rank must run the same number of micro-batches"
    for piece, rows, mbs_local in zip(shards.pieces, shards.rows, shards.micro_batches):
        assert piece["k"].tolist() == rows
        assert sorted(i for mb in mbs_local for i in mb) == list(range(len(rows)))
    # each rank returns its rows' x + 1; gather must restore the original order
    outs = [{"y": p["x"] + 1} for p in shards.pieces]
    assert torch.equal(shards.gather(outs)["y"], b["x"] + 1)


def test_dispatch_sends_piece_to_all_peers_and_collects_owners_only():
    # 4 ranks = DP2 x TP2: ranks (0,1) are DP rank 0, (2,3) DP rank 1; TP rank 0 owns outputs
    reports = [{"dp_rank": r // 2, "dp_size": 2, "is_output_owner": r % 2 == 0} for r in range(4)]
    layouts = make_layouts(reports)
    assert per_rank_args(["a", "b"], layouts) == ["a", "a", "b", "b"]
    assert collect_from_owners(["r0", "r1", "r2", "r3"], layouts) == ["r0", "r2"]
    bad = [dict(r, is_output_owner=True) for r in reports]
    with pytest.raises(RuntimeError, match="exactly one output owner"):
        make_layouts(bad)
    shards = shard_evenly(_batch(8), 2)
    assert [p["k"].tolist() for p in shards.pieces] == [[0, 1, 2, 3], [4, 5, 6, 7]]
