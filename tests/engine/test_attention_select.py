"""The THD attention kernel: which one runs where, and the flash-attn varlen path (CP included).

flash-attn needs an NVIDIA GPU. On CPU the selection logic is checked (it picks SDPA and says
why), and the flash path's index construction, the part verl_lite owns, runs against
``varlen_reference``: a plain-torch implementation of flash-attn's documented varlen semantics
(per sequence, causal mask aligned to the bottom-right corner). The real kernel vs SDPA is the
GPU test at the end (skipped on CPU with the reason).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import attention_module, dense_causal_attention, spawn_ranks, use_layout, zigzag_split


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_varlen_func's contract in plain torch (float64 inside): sequence i is
    q[cu_q[i]:cu_q[i+1]] against k/v[cu_k[i]:cu_k[i+1]]; with ``causal`` query j sees keys
    <= j + (len_k - len_q) (bottom-right aligned); GQA by head groups. Returns [total_q, h, d]."""
    assert dropout_p == 0.0
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
    assert max_k == max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    rows = []
    for (qa, qb), (ka, kb) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        qi, ki, vi = (x.double().transpose(0, 1) for x in (q[qa:qb], k[ka:kb], v[ka:kb]))  # [h, l, d]
        rep = qi.shape[0] // ki.shape[0]
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        s = qi @ ki.transpose(1, 2) * softmax_scale
        if causal:
            lq, lk = qb - qa, kb - ka
            allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            s = s.masked_fill(~allowed, float("-inf"))
        rows.append((torch.softmax(s, -1) @ vi).transpose(0, 1).to(q.dtype))
    return torch.cat(rows)


def _psp(bounds):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(bounds, dtype=torch.int32)
    mx = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx)


# ---------------------------------------------------------------------------------- selection
@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without CUDA")
def test_cpu_selects_sdpa_and_says_why():
    from verl_lite.engine.attention import select_attention_backend

    backend, why = select_attention_backend("auto", torch.bfloat16, env={})
    assert backend == "sdpa" and "no CUDA device" in why, why
    module = attention_module(8)  # the module decides once, from its config, and keeps the reason
    assert module.backend == "sdpa" and "no CUDA device" in module.backend_reason


def test_selection_rules():
    from verl_lite.engine.attention import select_attention_backend as select

    kernel = object()  # stands for flash_attn_varlen_func
    gpu = dict(cuda=True, flash_kernel=kernel, env={})
    assert select("auto", torch.bfloat16, **gpu)[0] == "flash"
    assert select("auto", torch.float16, **gpu)[0] == "flash"
    backend, why = select("auto", torch.float32, **gpu)
    assert backend == "sdpa" and "float32" in why
    assert select("sdpa", torch.bfloat16, **gpu) == ("sdpa", "attention_backend=sdpa forces torch SDPA")
    backend, why = select("auto", torch.bfloat16, cuda=True, flash_kernel=kernel,
                          env={"VERL_LITE_ATTENTION_BACKEND": "sdpa"})
    assert backend == "sdpa" and "VERL_LITE_ATTENTION_BACKEND=sdpa" in why
    with pytest.raises(ValueError, match="no CUDA device"):
        select("flash", torch.bfloat16, cuda=False, env={})
    with pytest.raises(ValueError, match="float32"):
        select("flash", torch.float32, **gpu)
    with pytest.raises(ValueError, match="choose auto, flash or sdpa"):
        select("fused", torch.bfloat16, **gpu)
    with pytest.raises(ValueError, match="VERL_LITE_ATTENTION_BACKEND"):
        select("auto", torch.bfloat16, cuda=True, flash_kernel=kernel, env={"VERL_LITE_ATTENTION_BACKEND": "x"})


def test_engine_maps_attention_backend_onto_the_module():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    from verl_lite.engine.attention import PackedCoreAttention
    from verl_lite.engine.engine import _megatron_attention_backend

    for name, enum in (("auto", AttnBackend.auto), ("sdpa", AttnBackend.unfused), ("flash", AttnBackend.flash)):
        assert _megatron_attention_backend(name) == enum
    cfg = SimpleNamespace(attention_dropout=0.0, kv_channels=8, attention_backend=AttnBackend.unfused,
                          params_dtype=torch.bfloat16)
    module = PackedCoreAttention(cfg, 1, AttnMaskType.causal)
    assert module.backend == "sdpa" and "forces torch SDPA" in module.backend_reason
    cfg.attention_backend = AttnBackend.flash
    try:
        assert PackedCoreAttention(cfg, 1, AttnMaskType.causal).backend == "flash"  # a GPU with flash_attn
    except ValueError as err:
        assert "cannot run here" in str(err) and _gpu_reason() is not None, err


# ---------------------------------------------------------------------------------- flash path
def test_flash_path_cp1_matches_dense_reference():
    """cp = 1: the varlen call over the pack (padded rows past cu[-1] are zeros)."""
    bounds, hn = [0, 5, 5, 12, 16], 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(18, h, hn, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    module = attention_module(hn)
    out = module._thd_flash(varlen_reference, q, k, v, torch.tensor(bounds))
    torch.testing.assert_close(out, dense_causal_attention(q, k, v, bounds, hn**-0.5), rtol=0, atol=1e-12)
    # dispatch: a bf16 module whose backend is flash calls the kernel it holds
    module.backend, module._flash = "flash", varlen_reference
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = module(qb, kb, vb, None, attn_mask_type=None, attention_bias=None, packed_seq_params=_psp(bounds))
    ref = dense_causal_attention(qb.double(), kb.double(), vb.double(), bounds, hn**-0.5)
    assert float((out.double() - ref).abs().max()) <= 2**-8 * float(ref.abs().max())  # one bf16 rounding


def _cp_flash_check(rank, world):
    from megatron.core import parallel_state as ps

    from verl_lite.engine.config import MegatronConfig

    use_layout(rank, world, MegatronConfig.layout(cp=world))
    cp, hn = world, 8
    padded = [8, 0, 16, 4 * cp]  # multiples of 2 * cp, an empty sequence included
    bounds = [0]
    for n in padded:
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(bounds[-1], h, hn, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    w = torch.randn(bounds[-1], 4 * hn, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = dense_causal_attention(*ref_in, bounds, hn**-0.5)
    (ref * w).sum().backward()
    rows = torch.cat([zigzag_split(torch.arange(a, b), cp, rank) for a, b in zip(bounds[:-1], bounds[1:]) if b > a])
    mine = [x[rows].clone().requires_grad_() for x in (q, k, v)]
    module = attention_module(hn, cp_group=ps.get_context_parallel_group())
    out = module._thd_flash_cp(varlen_reference, *mine, bounds)
    (out * w[rows]).sum().backward()
    grads = [x.grad for x in mine]
    return {"out": float((out - ref[rows]).abs().max()),
            **{f"d{n}": float((a - b.grad[rows]).abs().max()) for n, a, b in zip("qkv", grads, ref_in)}}


@pytest.mark.parametrize("cp", [2])
def test_flash_path_under_cp_matches_dense_reference(cp):
    """Zig-zag CP: each local query chunk against the gathered keys up to its end, in position
    order (values, and q/k/v gradients after the reduce-scatter, on every rank)."""
    if torch.cuda.is_available():
        pytest.skip("a CPU check of the index math (gloo); on GPU the kernel test below covers the path")
    for r in spawn_ranks(_cp_flash_check, cp):
        assert max(r.values()) < 1e-12, r


# ---------------------------------------------------------------------------------- GPU
def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "flash-attn runs on NVIDIA GPUs only; this machine has no CUDA device (scripts/gpu_check.sh runs it)"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "the flash_attn package is not installed (pip install flash-attn)"
    return None


@pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or "")
def test_flash_attn_log_probs_match_sdpa_on_gpu(tmp_path):
    """bf16 engine on one GPU: log-probs with flash-attn varlen vs with SDPA, within bf16 noise."""
    from verl_lite.engine.config import EngineConfig, MegatronConfig
    from verl_lite.engine.distributed import destroy_distributed, init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.engine import MegatronEngine, SequenceBatch
    from verl_lite.utils.net import free_port
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    model_dir = make_tiny_hf_model(Path(tmp_path) / "m", "qwen2", vocab_size=256, hidden_size=128, num_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                                   tie_word_embeddings=False, seed=0)
    init_distributed(0, 1, "127.0.0.1", free_port(), MegatronConfig.layout())
    try:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(1, 256, (n,), generator=g) for n in (37, 64, 5, 90)]
        batch = SequenceBatch(ids, [20, 30, 2, 41])
        out = {}
        for backend in ("flash", "sdpa"):
            engine = MegatronEngine(EngineConfig(model_path=str(model_dir), megatron=MegatronConfig(dtype="bfloat16"),
                                                  forward_only=True, attention_backend=backend))
            layer = engine.chunks[0].decoder.layers[0].self_attention.core_attention
            assert layer.backend == backend, layer.backend_reason
            out[backend] = engine.infer(batch, [[0, 1, 2, 3]])["log_probs"]
        err = float((out["flash"] - out["sdpa"]).abs().max())
        assert err < 0.05, f"flash vs SDPA log-probs differ by {err}"
    finally:
        destroy_distributed()
