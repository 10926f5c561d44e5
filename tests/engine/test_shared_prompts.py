"""Prompts shared by several sequences of a micro-batch are packed once (``engine/packing.py``).

- The pack: every sequence reads back its own tokens, positions and labels through its virtual
  rows; responses unpack exactly as from the unshared pack (values and gradients); the pack is
  smaller; the token count the loss normalisation sees is unchanged; prompts of one token, lone
  prompts and CP > 1 are packed as before.
- The core attention on such a pack (SDPA, and the flash path against flash-attn's varlen contract in
  plain torch) equals each sequence attended alone, outputs and the gradients of q, k and v.
- The engine (one launch, TP2 with sequence parallelism: row-sharded activations between the shared
  pack's segments): forward log-probs and entropy, and the gradient of one train step over two
  micro-batches, equal the engine's own with sharing off. The gradient's agreement with a float64
  reference in every layout is tests/parity (whose problem has groups of shared prompts).
"""

from __future__ import annotations

import pytest
import torch

from verl_lite.engine.packing import pack_micro_batch, unpack_response

from .conftest import spawn_ranks

# (prompt index, response length): prompts 0 and 1 are shared, prompt 2 once, prompt 3 has one token
PLAN = [(0, 4), (1, 3), (0, 6), (2, 5), (1, 1), (0, 2), (3, 3), (1, 0)]
PROMPT_LENGTHS = (5, 2, 7, 1)


def _sequences(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (n,), generator=g) for n in PROMPT_LENGTHS]
    seqs = [torch.cat([prompts[p], torch.randint(1, 64, (r,), generator=g)]) for p, r in PLAN]
    return seqs, [r for _, r in PLAN]


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_every_sequence_reads_its_tokens_positions_and_labels(multiple):
    seqs, resp = _sequences()
    plain = pack_micro_batch(seqs, resp, multiple=multiple)
    shared = pack_micro_batch(seqs, resp, multiple=multiple, share_prompts=True)
    layout = shared.shared
    assert layout is not None and plain.shared is None
    assert shared.num_local_tokens < plain.num_local_tokens
    assert shared.num_real_local_tokens == plain.num_real_local_tokens == sum(len(s) for s in seqs)
    assert shared.num_local_tokens % multiple == 0
    owners = torch.zeros(shared.num_local_tokens, dtype=torch.long)
    for i, s in enumerate(seqs):
        rows = layout.virtual_rows[layout.virtual_bounds[i]: layout.virtual_bounds[i + 1]]
        assert torch.equal(shared.input_ids[0, rows], s)
        assert torch.equal(layout.positions[rows], torch.arange(len(s)))
        assert torch.equal(shared.labels[0, rows[:-1]], s[1:])
        assert bool(shared.real_mask[0, rows].all())
        owners[rows] += 1
    # a row is read by its group's sequences (prefix rows) or by one sequence; padding by none
    assert torch.equal(owners > 0, shared.real_mask[0])
    assert int(owners.max()) == 3  # prompt 0's prefix, read by its three sequences
    # every real row's output comes from a slot that reads it, and the inverse map agrees
    real = layout.slot_of_row >= 0
    assert torch.equal(real, shared.real_mask[0])
    assert torch.equal(layout.virtual_rows[layout.slot_of_row[real]], torch.nonzero(real).squeeze(-1))
    assert torch.equal(layout.row_of_slot[layout.slot_of_row[real]], torch.nonzero(real).squeeze(-1))


def test_responses_unpack_as_from_the_unshared_pack_values_and_gradients():
    seqs, resp = _sequences()
    plain = pack_micro_batch(seqs, resp)
    shared = pack_micro_batch(seqs, resp, share_prompts=True)
    width = max(resp)
    weights = torch.randn(len(seqs), width, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # a per-token value that depends only on the row's sequence position and token: equal in both packs
    def per_token(pack, positions):
        return (pack.input_ids[0].double() * 0.01 + positions.double()).requires_grad_(True)

    plain_pos = torch.cat([torch.arange(p) for p in plain.padded_lengths])
    a, b = per_token(plain, plain_pos), per_token(shared, shared.shared.positions)
    out_a, out_b = unpack_response(a, plain, width), unpack_response(b, shared, width)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    (out_a * weights).sum().backward()
    (out_b * weights).sum().backward()
    # response token t of sequence i is scored at its position L - R - 1 + t, a row of its own segment:
    # that row's gradient is the token's weight, every other row's is 0
    expected = torch.zeros_like(b.grad)
    layout = shared.shared
    for i, (s, r) in enumerate(zip(seqs, resp)):
        for t in range(r):
            expected[layout.virtual_rows[layout.virtual_bounds[i] + len(s) - r - 1 + t]] += weights[i, t]
    torch.testing.assert_close(b.grad, expected, rtol=0, atol=0)
    assert torch.allclose(a.grad.sum(), b.grad.sum())


def test_nothing_to_share_packs_as_before():
    seqs, resp = _sequences()
    lone = [seqs[i] for i in (0, 1, 3, 6)]  # one sequence per prompt
    lone_resp = [resp[i] for i in (0, 1, 3, 6)]
    assert pack_micro_batch(lone, lone_resp, share_prompts=True).shared is None
    one_token = [seqs[6], torch.cat([seqs[6][:1], seqs[6][1:].flip(0)])]  # a shared prompt of one token
    assert pack_micro_batch(one_token, [3, 3], share_prompts=True).shared is None
    cp = pack_micro_batch(seqs, resp, multiple=4, cp_size=2, cp_rank=0, share_prompts=True)
    assert cp.shared is None  # context parallelism splits sequences, not shared packs


@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
def test_attention_over_shared_prompts_equals_each_sequence_alone_values_and_gradients(kernel):
    """The core attention on a pack with shared prompts (SDPA, and the flash path on flash-attn's varlen
    contract in plain torch) against each sequence attended alone from its own copy of every row:
    outputs on every pack row and the gradients of q, k and v (a shared key's summed over its readers)."""
    from .conftest import attention_module, dense_causal_attention
    from .test_attention_select import varlen_reference

    seqs, resp = _sequences()
    pack = pack_micro_batch(seqs, resp, multiple=2, share_prompts=True)
    layout, rows, hn = pack.shared, pack.num_local_tokens, 8
    g = torch.Generator().manual_seed(1)
    q0, k0, v0 = (torch.randn(rows, h, hn, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    weights = torch.randn(rows, 4 * hn, generator=g, dtype=torch.float64)
    module = attention_module(hn)
    if kernel == "flash":
        module.backend, module._flash = "flash", varlen_reference
        q0, k0, v0, weights = q0.bfloat16(), k0.bfloat16(), v0.bfloat16(), weights.bfloat16()
    cu = pack.cu_seqlens.clone()
    cu.shared_prompts = layout
    psp = type("PSP", (), dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
                                cu_seqlens_kv_padded=None))()
    q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
    out = module(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=psp)
    (out.double() * weights.double()).sum().backward()

    qr, kr, vr = (x.double().clone().requires_grad_(True) for x in (q0, k0, v0))
    virtual = dense_causal_attention(*(x.index_select(0, layout.virtual_rows) for x in (qr, kr, vr)),
                                     layout.virtual_bounds, hn**-0.5)
    real = layout.slot_of_row >= 0
    ref = torch.where(real[:, None], virtual[layout.slot_of_row.clamp(min=0)], 0.0)
    (ref * weights.double()).sum().backward()
    tol = dict(rtol=0, atol=1e-12) if kernel == "sdpa" else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for mine, theirs in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol)
    assert float(kr.grad[~real].abs().sum()) == 0.0  # padding rows are read by no sequence


def _model(root):
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    return make_tiny_hf_model(root / "model", "qwen2", vocab_size=64, hidden_size=32, num_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                              tie_word_embeddings=False, seed=5, init_std=0.15)


def _engine_runs(rank, world, model_dir):
    from verl_lite.engine.engine import MegatronEngine, SequenceBatch
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    from .conftest import use_layout

    par = MegatronConfig.layout(tp=2, sequence_parallel=True)
    use_layout(rank, world, par)
    seqs, resp = _sequences()
    width = max(resp)
    mask = torch.zeros(len(seqs), width)
    for i, r in enumerate(resp):
        mask[i, :r] = 1
    batch = SequenceBatch(seqs, resp, {"mask": mask}, response_width=width)

    def loss(outputs, data):
        return (-(outputs["log_probs"] * data["mask"]).sum() + 0.1 * (outputs["entropy"] * data["mask"]).sum()) / 20.0, {}

    out = {}
    engine = MegatronEngine(EngineConfig(model_path=model_dir, megatron=par, optim=OptimConfig(lr=1e-2)))
    assert engine.share_prompts
    for share in (False, True):
        engine.load_hf(model_dir)  # both runs start from the same weights and a fresh optimizer
        engine.share_prompts = share
        rows = sum(mb.packed.num_local_tokens for mb in engine._pack(batch, [list(range(len(seqs)))]))
        infer = engine.infer(batch, [list(range(len(seqs)))])
        engine.train_step(batch, [[0, 1, 2, 3], [4, 5, 6, 7]], loss)
        grads = {n: t.detach().clone() for n, t in engine.export_hf("main_grad")}
        out[share] = dict(rows=rows, infer=infer, grads=grads)
    return out


def test_engine_with_shared_prompts_equals_the_unshared_engine(tmp_path):
    model_dir = _model(tmp_path)
    out = spawn_ranks(_engine_runs, 2, str(model_dir))[0]
    plain, shared = out[False], out[True]
    assert shared["rows"] < plain["rows"]
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(shared["infer"][name], plain["infer"][name], rtol=0, atol=1e-6)
    num = sum(float((shared["grads"][n] - plain["grads"][n]).norm() ** 2) for n in plain["grads"]) ** 0.5
    den = sum(float(plain["grads"][n].norm() ** 2) for n in plain["grads"]) ** 0.5
    assert den > 0 and num / den < 1e-5, num / den
