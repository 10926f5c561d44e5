"""PackedCoreAttention in one process (no CP) against a dense float64 per-sequence reference.

CP (2 and 4 ranks) is checked in test_model_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .conftest import attention_module, dense_causal_attention


def _thd_params(bounds, padded_bounds=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(bounds, dtype=torch.int32)
    cu_p = torch.tensor(padded_bounds, dtype=torch.int32) if padded_bounds is not None else None
    layout = padded_bounds or bounds
    mx = max(b - a for a, b in zip(layout[:-1], layout[1:]))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p, cu_seqlens_kv_padded=cu_p,
        max_seqlen_q=mx, max_seqlen_kv=mx,
    )


def _qkv(t, n_heads, n_kv, hn, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, hn, generator=gen, dtype=dtype) for h in (n_heads, n_kv, n_kv)]


@pytest.fixture(params=["matmul", "sdpa"])
def causal_kernel(request, monkeypatch):
    """Both CPU kernels of the batched causal attention: two matmuls (sequences of at most
    ``SHORT_CAUSAL_MAX_LEN`` positions, the default for these tests' short ones) and torch SDPA."""
    import verl_lite.engine.attention as attention

    if request.param == "sdpa":
        monkeypatch.setattr(attention, "SHORT_CAUSAL_MAX_LEN", 0)
    return request.param


@pytest.mark.parametrize("n_heads,n_kv", [(4, 2), (4, 4), (6, 1)])
def test_thd_matches_per_sequence_reference_values_and_grads(n_heads, n_kv, causal_kernel):
    hn = 8
    bounds = [0, 3, 3, 11, 12, 17]  # includes an empty and a length-1 sequence
    q, k, v = _qkv(bounds[-1] + 2, n_heads, n_kv, hn)  # 2 trailing rows past cu[-1] -> zeros
    w = torch.randn(q.shape[0], n_heads * hn, dtype=torch.float64)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = dense_causal_attention(*ref, bounds, hn**-0.5)
    (ref_out * w).sum().backward()
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention_module(hn)(*mine, None, attn_mask_type=None, attention_bias=None, packed_seq_params=_thd_params(bounds))
    (out * w).sum().backward()
    assert out.shape == (q.shape[0], n_heads * hn)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    assert torch.equal(out[bounds[-1]:], torch.zeros_like(out[bounds[-1]:]))
    for a, b, name in zip(mine, ref, "qkv"):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=f"grad of {name}")


def test_thd_uses_padded_boundaries_when_given():
    """cu_seqlens_q_padded defines the sequences (as in megatron's RoPE); padding sits at the end of
    each sequence, so real tokens see exactly their own prefix."""
    hn = 4
    real = [0, 3, 8]
    padded = [0, 4, 12]
    q, k, v = _qkv(12, 2, 1, hn, seed=1)
    out = attention_module(hn)(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=_thd_params(real, padded))
    ref = dense_causal_attention(q, k, v, padded, hn**-0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # the real tokens of sequence 2 (rows 4..8) equal attention over that sequence alone
    alone = dense_causal_attention(q[4:9], k[4:9], v[4:9], [0, 5], hn**-0.5)
    torch.testing.assert_close(out[4:9], alone, rtol=0, atol=1e-12)


def test_thd_never_attends_across_the_whole_pack(monkeypatch, causal_kernel):
    """No attention call sees more keys than the longest sequence and none takes a mask: no [T, T]
    mask over the pack (at CP=1 one batched call over [b, max_len]), with either kernel."""
    import verl_lite.engine.attention as attention

    seen = []
    real_sdpa, real_matmul = F.scaled_dot_product_attention, attention.causal_matmul_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(("sdpa", k.shape[-2], None if attn_mask is None else tuple(attn_mask.shape)))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def spy_matmul(q, k, v, scale):
        seen.append(("matmul", k.shape[-2], None))
        return real_matmul(q, k, v, scale)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "causal_matmul_attention", spy_matmul)
    bounds = [0, 5, 9, 16]
    q, k, v = _qkv(16, 2, 2, 4, dtype=torch.float32)
    attention_module(4)(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=_thd_params(bounds))
    assert [kernel for kernel, _, _ in seen] == [causal_kernel]
    assert all(s <= 7 for _, s, _ in seen)
    assert all(m is None for _, _, m in seen)


@pytest.mark.parametrize("length,n_heads,n_kv", [(1, 4, 2), (9, 6, 3), (64, 4, 1), (65, 2, 2)])
def test_causal_kernels_agree_with_float64_reference(length, n_heads, n_kv, monkeypatch):
    """``causal_matmul_attention`` (values and q/k/v gradients) against the dense per-sequence reference, float64,
    GQA; ``_causal_attention`` takes it up to ``SHORT_CAUSAL_MAX_LEN`` positions and ``MATMUL_ATTENTION_MAX_SCORES`` scores,
    SDPA beyond and in 16-bit."""
    import verl_lite.engine.attention as attention

    b, hn = 3, 8
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(b, n_heads, length, hn, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, n_kv, length, hn, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    w = torch.randn(b, n_heads, length, hn, generator=gen, dtype=torch.float64)
    out = attention.causal_matmul_attention(q, k, v, hn**-0.5)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for i in range(b):
        rows = lambda x: x[i].transpose(0, 1)  # noqa: E731  [heads, L, hn] -> [L, heads, hn]
        ref_q, ref_k, ref_v = (rows(x).detach().clone().requires_grad_() for x in (q, k, v))
        ref = dense_causal_attention(ref_q, ref_k, ref_v, [0, length], hn**-0.5)  # [L, heads * hn]
        torch.testing.assert_close(out[i].transpose(0, 1).reshape(length, -1), ref, rtol=0, atol=1e-12)
        ref_grads = torch.autograd.grad((ref * rows(w).reshape(length, -1)).sum(), (ref_q, ref_k, ref_v))
        for mine, theirs in zip(grads, ref_grads):
            torch.testing.assert_close(rows(mine), theirs, rtol=0, atol=1e-12)
    calls = []
    monkeypatch.setattr(attention, "causal_matmul_attention", lambda *a: calls.append("matmul") or out)
    attention._causal_attention(q, k, v, hn**-0.5)
    assert calls == (["matmul"] if length <= attention.SHORT_CAUSAL_MAX_LEN else [])
    attention._causal_attention(q.detach().bfloat16(), k.detach().bfloat16(), v.detach().bfloat16(), hn**-0.5)
    monkeypatch.setattr(attention, "MATMUL_ATTENTION_MAX_SCORES", b * n_heads * length * length - 1)
    attention._causal_attention(q, k, v, hn**-0.5)  # one score more than the bound: SDPA
    assert calls == (["matmul"] if length <= attention.SHORT_CAUSAL_MAX_LEN else [])


def test_bshd_causal_and_explicit_mask():
    hn, s, b, n_heads, n_kv = 8, 7, 3, 4, 2
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(s, b, n_heads, hn, generator=gen, dtype=torch.float64)
    k = torch.randn(s, b, n_kv, hn, generator=gen, dtype=torch.float64)
    v = torch.randn(s, b, n_kv, hn, generator=gen, dtype=torch.float64)
    attn = attention_module(hn)
    out = attn(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=None)
    assert out.shape == (s, b, n_heads * hn)
    for i in range(b):
        ref = dense_causal_attention(q[:, i], k[:, i], v[:, i], [0, s], hn**-0.5)
        torch.testing.assert_close(out[:, i], ref, rtol=0, atol=1e-12)
    # megatron convention: True = masked out; the mask replaces causality. Left padding of 2 in row 0.
    masked = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s).clone()
    masked[0, :, :, :2] = True
    masked[0, :, :2, :2] = torch.eye(2, dtype=torch.bool).logical_not()  # pad rows attend to themselves
    out = attn(q, k, v, masked, attn_mask_type=None, attention_bias=None, packed_seq_params=None)
    ref = dense_causal_attention(q[2:, 0], k[2:, 0], v[2:, 0], [0, s - 2], hn**-0.5)
    torch.testing.assert_close(out[2:, 0], ref, rtol=0, atol=1e-12)


def test_zigzag_positions_partition_each_sequence():
    from verl_lite.engine.attention import zigzag_positions

    for cp in (1, 2, 4):
        L = 8 * cp
        parts = [zigzag_positions(L, cp, r) for r in range(cp)]
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(L))
        if cp > 1:
            c = L // (2 * cp)
            assert parts[0][:c].tolist() == list(range(c))
            assert parts[0][c:].tolist() == list(range(L - c, L))
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        zigzag_positions(6, 2, 0)


def test_bad_inputs_raise_clear_errors():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from verl_lite.engine.attention import PackedCoreAttention

    with pytest.raises(ValueError, match="attention_dropout"):
        PackedCoreAttention(SimpleNamespace(attention_dropout=0.1, kv_channels=4), 1, AttnMaskType.causal)
    q, k, v = _qkv(6, 2, 2, 4)
    attn = attention_module(4)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(q, k, v, torch.zeros(1, 1, 6, 6, dtype=torch.bool), attn_mask_type=None, attention_bias=None,
             packed_seq_params=_thd_params([0, 6]))
    with pytest.raises(ValueError, match="GLOBAL"):
        attn(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=_thd_params([0, 9]))
