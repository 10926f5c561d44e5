"""THD packing, zig-zag split and reconstruction, checked against plain per-sequence loops."""

import pytest
import torch

from verl_lite.engine.packing import (
    assemble_response,
    pack_micro_batch,
    pack_response,
    pad_multiple,
    unpack_response,
    zigzag_positions,
)


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 50, (n,), generator=g) for n in lengths]


def test_pad_multiple_rules():
    assert pad_multiple(1) == 1
    assert pad_multiple(1, 2, sequence_parallel=False) == 1
    assert pad_multiple(1, 2, sequence_parallel=True) == 2
    assert pad_multiple(2, 2, sequence_parallel=False) == 4
    assert pad_multiple(2, 2, sequence_parallel=True) == 8
    assert pad_multiple(4) == 8


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions_partition_each_sequence(cp):
    p = 2 * cp * 3
    allpos = torch.cat([zigzag_positions(p, cp, r) for r in range(cp)])
    assert sorted(allpos.tolist()) == list(range(p))
    h = p // (2 * cp)
    r0 = zigzag_positions(p, cp, 0).tolist()
    assert r0[:h] == list(range(h)) and r0[h:] == list(range(p - h, p))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_labels_shift_across_chunk_boundaries(cp):
    lengths = [5, 9, 2, 13]  # none divides by 2*cp for cp>1
    resp = [3, 4, 1, 6]
    seqs = _seqs(lengths)
    m = pad_multiple(cp)
    packs = [pack_micro_batch(seqs, resp, multiple=m, cp_size=cp, cp_rank=r) for r in range(cp)]
    for pk in packs:
        assert pk.cu_seqlens.tolist()[-1] == sum(pk.padded_lengths)
        assert all(p % m == 0 and p >= n and p - n < m for p, n in zip(pk.padded_lengths, pk.lengths))
        assert pk.max_seqlen == max(pk.padded_lengths)
    # Real tokens over the CP group add up to sum L_i exactly.
    assert sum(pk.num_real_local_tokens for pk in packs) == sum(lengths)
    # Reassemble ids and labels via the response path: labels at response positions == response ids.
    width = max(resp) + 2
    lab = assemble_response([pk.labels[0].double() for pk in packs], packs[0], width)
    for i, (s, r) in enumerate(zip(seqs, resp)):
        assert lab[i, :r].long().tolist() == s[len(s) - r :].tolist()
        assert (lab[i, r:] == 0).all()
    ids = assemble_response([pk.input_ids[0].double() for pk in packs], packs[0], width)
    for i, (s, r) in enumerate(zip(seqs, resp)):  # position scoring response token t holds token L-R-1+t
        assert ids[i, :r].long().tolist() == s[len(s) - r - 1 : len(s) - 1].tolist()


@pytest.mark.parametrize("cp, shared", [(1, False), (1, True), (2, False), (4, False)])
def test_pack_response_puts_each_value_at_the_row_that_scores_its_token(cp, shared):
    """K values per response token ([b, W, K], e.g. token ids) packed onto each CP rank's rows: every rank's row
    that scores response token t of sequence i holds that token's values, every other row 0, and unpacking the
    ranks' packs gives the values back (0 past each response); with shared prompts (two sequences of one prompt)
    too."""
    lengths, resp, width, k = [5, 9, 2, 13, 11], [3, 4, 1, 6, 6], 8, 3
    seqs = _seqs(lengths)
    if shared:
        seqs[4][:5] = seqs[1][:5]  # sequences 1 and 4 share their 5-token prompt
    values = torch.randint(1, 1000, (len(seqs), width, k))
    packs = [pack_micro_batch(seqs, resp, multiple=pad_multiple(cp), cp_size=cp, cp_rank=r, share_prompts=shared)
             for r in range(cp)]
    assert (packs[0].shared is not None) == shared
    local = [pack_response(values, pk, width) for pk in packs]
    for pk, rows in zip(packs, local):
        assert rows.shape == (pk.num_local_tokens, k)
        assert not bool(((rows != 0).any(-1) & (pk.labels[0] == 0)).any())  # values only on rows with a label
    assert sum(int((rows != 0).any(-1).sum()) for rows in local) == sum(resp)  # each token once over the ranks
    back = assemble_response(local, packs[0], width) if cp > 1 else unpack_response(local[0], packs[0], width)
    valid = torch.arange(width)[None, :] < torch.tensor(resp)[:, None]
    assert torch.equal(back[valid], values[valid]) and not bool(back[~valid].any())


def test_only_local_shard_keeps_autograd():
    cp = 2
    seqs, resp = _seqs([7, 6]), [3, 4]
    packs = [pack_micro_batch(seqs, resp, multiple=4, cp_size=cp, cp_rank=r) for r in range(cp)]
    vals = [torch.randn(pk.num_local_tokens, dtype=torch.float64) for pk in packs]
    total = 0.0
    for r in range(cp):
        local = vals[r].clone().requires_grad_(True)
        shards = [local if q == r else vals[q] for q in range(cp)]
        assemble_response(shards, packs[r], 5).sum().backward()
        # expected: 1 at local positions p with L-R-1 <= p < L-1 of their sequence, else 0
        expected = []
        for n, p, rr in zip(packs[r].lengths, packs[r].padded_lengths, resp):
            pos = zigzag_positions(p, cp, r)
            expected.append(((pos >= n - rr - 1) & (pos < n - 1)).double())
        torch.testing.assert_close(local.grad, torch.cat(expected), rtol=0, atol=0)
        total += float(local.grad.sum())
    assert total == sum(resp)  # each response token's gradient counted once over the CP group


@pytest.mark.parametrize("multiple", [1, 4])
def test_cp1_unpack_matches_a_per_sequence_loop_values_and_grads(multiple):
    """The one-gather CP=1 path of unpack_response vs slicing each sequence by hand (incl. an
    empty response and padding), forward values and the gradient of a weighted sum."""
    seqs, resp = _seqs([7, 3, 9, 5]), [3, 0, 8, 1]
    pk = pack_micro_batch(seqs, resp, multiple=multiple)
    width = 9
    vals = torch.randn(pk.num_local_tokens, dtype=torch.float64)
    weights = torch.randn(len(seqs), width, dtype=torch.float64)
    local = vals.clone().requires_grad_(True)
    out = unpack_response(local, pk, width)
    (out * weights).sum().backward()
    ref = vals.clone().requires_grad_(True)
    rows, offset = [], 0
    for n, p, r in zip(pk.lengths, pk.padded_lengths, resp):
        piece = ref[offset + n - r - 1: offset + n - 1]
        rows.append(torch.cat([piece, piece.new_zeros(width - r)]))
        offset += p
    expected = torch.stack(rows)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(local.grad, ref.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exceeds the output width"):
        unpack_response(vals, pk, 7)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="response length"):
        pack_micro_batch([torch.arange(3)], [3])
    with pytest.raises(ValueError, match="at least one"):
        pack_micro_batch([], [])
    with pytest.raises(ValueError, match="2\\*CP"):
        pack_micro_batch([torch.arange(3)], [1], multiple=2, cp_size=2)
